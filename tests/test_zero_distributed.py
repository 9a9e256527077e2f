"""Two ranks (gloo processes on this CPU): partitioned parameters, reduce-scattered gradients.

Each rank trains on its half of every batch; plain PyTorch trains on the whole
batch with the mean of the two halves' losses. Losses agree within rtol 1e-4
(the sum over ranks rounds differently from one backward over the whole
batch) for offload none, cpu and nvme, gradient accumulation 1 and 4, with
clipping, with gradient_predivide_factor, and for a model built inside
zero.Init. All scenarios run in one pair of processes, started once.
"""

import os

import pytest
import torch

from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, run_ranks, scenario_train, train_engine

WORLD = 2
CASES = {
    "none-none-1": dict(offload_param="none", offload_optimizer="none", accumulation=1, clip=1.0),
    "cpu-cpu-4": dict(offload_param="cpu", offload_optimizer="cpu", accumulation=4, clip=1.0),
    "nvme-nvme-1": dict(offload_param="nvme", offload_optimizer="nvme", accumulation=1, clip=1.0),
    "nvme-cpu-4": dict(offload_param="nvme", offload_optimizer="cpu", accumulation=4, clip=0.0),
    # No clipping: each rank steps its sub-groups during backward (zero/engine/optimizer.py).
    "cpu-nvme-4": dict(offload_param="cpu", offload_optimizer="nvme", accumulation=4, clip=0.0),
    "init-cpu-1": dict(offload_param="cpu", offload_optimizer="none", accumulation=1, clip=1.0, use_init=True),
    "predivide-none-1": dict(offload_param="none", offload_optimizer="none", accumulation=1, clip=1.0,
                             config_extra={"gradient_predivide_factor": 2.0}),
}


def scenario_batch_size_check(rank, world_size, scratch):
    """train_batch_size written for one process is refused with the real world size."""
    import zero

    config = base_config(world_size=1)  # 4 = 4 x 1 x 1
    try:
        zero.initialize(model=GPT(GPTConfig()), config=config)
    except zero.ConfigError as error:
        return str(error)
    return "no error"


def scenario_fp16_overflow_on_one_rank(rank, world_size, scratch):
    """An overflow on rank 1 only makes every rank skip that step and lower its scale."""
    import math

    import zero

    torch.manual_seed(0)
    c = GPTConfig()
    model = GPT(c)
    config = base_config(world_size=world_size, precision="fp16", lr=1e-2)
    config["fp16"]["hysteresis"] = 1
    engine, _, _, _ = zero.initialize(model=model, config=config)
    scales, adam_steps = [], []
    for step, (x, y) in enumerate(make_batches(c, 4, 4 * world_size)):
        loss = engine(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        if step == 2 and rank == 1:
            loss = loss * math.inf
        engine.backward(loss)
        engine.step()
        scales.append(engine.get_loss_scale())
        adam_steps.append(engine.optimizer.adam_step)
    engine.destroy()
    return {"scales": scales, "adam_steps": adam_steps, "skipped": engine.skipped_steps}


def scenario_checkpoint(rank, world_size, scratch):
    """Save after 3 steps on two ranks; rank 0 also writes the gathered weights; train 2 more."""
    import zero

    torch.manual_seed(0)
    c = GPTConfig()
    model = GPT(c)
    config = base_config("nvme", "cpu", scratch, world_size=world_size, lr=1e-2, clip=1.0, sub_group_size=3000)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    batches = make_batches(c, 5, 4 * world_size)
    train_engine(engine, batches[:3], 3, rank=rank, shards=world_size)
    engine.save_checkpoint(f"{scratch}/ckpt")
    with zero.GatheredParameters(list(model.parameters())):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, f"{scratch}/full.pt")
    losses = train_engine(engine, batches[3:], 2, rank=rank, shards=world_size)
    engine.destroy()
    return {"losses": losses, "scratch": scratch}


def scenario_tags(rank, world_size, scratch):
    """Ranks that disagree on the tag: Fail raises on every rank, Warn saves under rank 0's tag."""
    import zero

    outcome = {}
    for policy in ("Fail", "Warn"):
        config = base_config(world_size=world_size)
        config["checkpoint"] = {"tag_validation": policy}
        engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=config)
        try:
            engine.save_checkpoint(f"{scratch}/{policy}", tag=f"mine{rank}")
            outcome[policy] = sorted(os.listdir(f"{scratch}/{policy}"))
        except ValueError as error:
            outcome[policy] = str(error)
        engine.destroy()
    return outcome


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    scenarios = [(name, scenario_train, kwargs) for name, kwargs in CASES.items()]
    scenarios.append(("batch_size_check", scenario_batch_size_check, {}))
    scenarios.append(("fp16_overflow", scenario_fp16_overflow_on_one_rank, {}))
    scenarios.append(("checkpoint", scenario_checkpoint, {}))
    scenarios.append(("tags", scenario_tags, {}))
    return run_ranks(WORLD, scenarios, tmp_path_factory.mktemp("ranks"))


def reference_losses(accumulation, clip, steps=10):
    torch.manual_seed(0)
    c = GPTConfig()
    model = GPT(c)
    batches = make_batches(c, steps * accumulation, 4 * WORLD)
    return train_reference(model, batches, steps, accumulation, lr=1e-2, clip=clip, shards=WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_track_plain_pytorch(results, name):
    for rank in range(WORLD):
        assert "error" not in results[rank][name], results[rank][name]["error"]
    case = CASES[name]
    expected = reference_losses(case["accumulation"], case["clip"])
    # reference_losses interleaves the shards: [micro0 rank0, micro0 rank1, micro1 rank0, ...]
    for rank in range(WORLD):
        got = torch.tensor(results[rank][name], dtype=torch.float64)
        want = torch.tensor(expected[rank::WORLD], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    assert expected[-1] < expected[0] - 0.3


def test_ranks_differ_so_the_data_is_split(results):
    assert results[0]["none-none-1"][0] != results[1]["none-none-1"][0]


def test_batch_size_is_checked_against_the_real_world_size(results):
    for rank in range(WORLD):
        message = results[rank]["batch_size_check"]
        assert "train_batch_size (4) must equal train_micro_batch_size_per_gpu (4) × " \
               "gradient_accumulation_steps (1) × world_size (2) = 8" in message


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(results):
    for rank in range(WORLD):
        got = results[rank]["fp16_overflow"]
        assert "error" not in got, got.get("error")
        assert got == {"scales": [256.0, 256.0, 128.0, 128.0], "adam_steps": [1, 2, 2, 3], "skipped": 1}


def test_a_two_rank_checkpoint_consolidates_and_resumes_on_one_rank(results, tmp_path):
    import zero

    got = [results[rank]["checkpoint"] for rank in range(WORLD)]
    assert all("error" not in g for g in got), [g.get("error") for g in got]
    scratch = got[0]["scratch"]
    state = zero.get_fp32_state_dict_from_zero_checkpoint(f"{scratch}/ckpt")
    full = torch.load(f"{scratch}/full.pt", weights_only=True)
    assert set(full) <= set(state) and all(torch.equal(state[n], full[n]) for n in full)

    torch.manual_seed(1)
    c = GPTConfig()
    engine, _, _, _ = zero.initialize(model=GPT(c), config=base_config("cpu", "nvme", tmp_path, lr=1e-2,
                                                                        clip=1.0, micro=4 * WORLD))
    engine.load_checkpoint(f"{scratch}/ckpt")
    losses = train_engine(engine, make_batches(c, 5, 4 * WORLD)[3:], 2)
    engine.destroy()
    two_ranks = [(a + b) / 2 for a, b in zip(got[0]["losses"], got[1]["losses"])]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(two_ranks), rtol=1e-4, atol=0)


def test_checkpoint_tags_are_validated_across_ranks(results):
    for rank in range(WORLD):
        got = results[rank]["tags"]
        assert "error" not in got, got.get("error")
        assert got["Fail"] == (f"ranks save different checkpoint tags (rank {rank}: 'mine{rank}', rank 0: "
                               f"'mine0') and checkpoint.tag_validation is Fail")
        assert got["Warn"] == ["latest", "mine0"]
