"""Where the test ranks compute (tests/helpers.py, [Note: where the test ranks compute]): the CPU
suite's ranks use gloo and the CPU though CUDA is there (on a one-GPU machine NCCL refused two
ranks on cuda:0); ranks are spawned, not forked, once this process has initialised CUDA; ranks on
CUDA need a GPU each and skip, saying so, with fewer. On a machine with a GPU per rank the last
test trains two ranks over NCCL against plain PyTorch on the GPU.
"""
import sys

import pytest
import torch

from helpers import base_config, rank_start_method, run_ranks, scenario_train, train_engine
from zero.examples import GPT, GPTConfig, make_batches, train_reference

WORLD = 2
MARK = "as imported"  # the test changes it; a forked rank sees the change, a spawned one imports afresh


def scenario_where(rank, world_size, scratch):
    """The backend and device this rank got, and a step trained (real collectives)."""
    import torch.distributed as dist

    import zero

    c = GPTConfig()
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(c), config=base_config(world_size=world_size, clip=1.0))
    batches = [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in make_batches(c, 1, 4 * world_size)]
    losses = train_engine(engine, batches, 1)
    where = {"backend": dist.get_backend(), "device": str(engine.device),
             "collective_device": str(engine.comm.collective_device), "losses": losses, "mark": MARK}
    engine.destroy()
    return where


def scenario_mark(rank, world_size, scratch):
    return MARK


def test_cpu_ranks_use_gloo_and_the_cpu_though_cuda_is_there(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (forked ranks inherit the answer)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_start_method() == "fork"
    results = run_ranks(WORLD, [("where", scenario_where, {})], tmp_path)
    for rank in range(WORLD):
        got = results[rank]["where"]
        assert "error" not in got, got["error"]
        assert (got["backend"], got["device"], got["collective_device"]) == ("gloo", "cpu", "cpu")


def test_ranks_are_spawned_once_cuda_is_initialised(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "MARK", "changed by the test")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # CUDA cannot be used in a forked child
    assert rank_start_method() == "spawn"
    results = run_ranks(WORLD, [("mark", scenario_mark, {})], tmp_path)
    assert [r["mark"] for r in results] == ["as imported"] * WORLD


def test_forked_ranks_see_what_this_process_changed(tmp_path, monkeypatch):
    """(The check above means something: a forked rank sees the change.)"""
    monkeypatch.setattr(sys.modules[__name__], "MARK", "changed by the test")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    results = run_ranks(WORLD, [("mark", scenario_mark, {})], tmp_path)
    assert [r["mark"] for r in results] == ["changed by the test"] * WORLD


def test_cuda_ranks_need_a_gpu_each_else_the_test_skips_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=r"2 ranks on CUDA need 2 GPUs \(NCCL refuses two ranks on one "
                                                    r"device\); this machine has 1"):
        run_ranks(WORLD, [("mark", scenario_mark, {})], tmp_path, device="cuda")


def test_two_ranks_on_two_gpus_track_plain_pytorch_on_the_gpu(tmp_path):
    case = dict(offload_param="cpu", offload_optimizer="cpu", accumulation=1, clip=1.0)
    results = run_ranks(WORLD, [("train", scenario_train, case)], tmp_path, device="cuda")  # skips without 2 GPUs
    torch.manual_seed(0)
    c = GPTConfig()
    model = GPT(c).cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(c, 10, 4 * WORLD)]
    expected = train_reference(model, batches, 10, lr=1e-2, clip=1.0, shards=WORLD)
    for rank in range(WORLD):
        assert "error" not in results[rank]["train"], results[rank]["train"]["error"]
        got = torch.tensor(results[rank]["train"], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(expected[rank::WORLD], dtype=torch.float64), rtol=1e-4, atol=0)
