"""A rank's memory at every ZeRO stage: the per-rank formula (estimate_rank_bytes) on the example
GPT, and the bytes an engine's stores actually hold at stages 1 and 2 equal to it."""
import pytest
import torch

import zero
from swapper.host_memory import align_up
from zero.examples import GPT, GPTConfig
from zero.stores.estimator import model_sizes
from helpers import base_config, run_ranks

CFG = GPTConfig()
W = 2
STATES = 2  # Adam: exp_avg, exp_avg_sq


def crossing_slab(largest_shard):
    """A slab of the gradient crossing: the largest trained shard's payloads (8 bytes an element at
    most) and 256 KiB for their alignment, 4 MiB at least, in whole 2 MiB pages, 64 MiB at most
    (zero/stores/pinned_host.py)."""
    mib = 1 << 20
    return min(64 * mib, -(-max(4 * mib, 8 * largest_shard + 256 * 1024) // (2 * mib)) * 2 * mib)


def expected(stage, offload, P, L, b, world, sub_group_size=10**9):
    """(host, device, nvme) bytes per rank, written out from the accounting: ``offload`` is
    offload_optimizer's device, and offload_param's too at stage 3; computing on CUDA."""
    S = -(-P // world)
    Ls = -(-L // world)
    param, opt = (offload if stage == 3 else "none"), offload
    host = device = nvme = 0
    master = (2 + STATES) * 4 * S  # fp32 master, exp_avg, exp_avg_sq, fp32 gradient partition
    if opt == "none":
        device += master
    elif opt == "cpu":
        host += master
    else:
        sg = min(sub_group_size, S)
        nvme += master
        host += (1 + STATES) * align_up(4 * sg) + 4 * sg  # one sub-group in the pool (no pipeline)
        host += 2 * 4 * sg  # the gradients of the two sub-groups being filled
    is_master = b == 4 and param == opt
    if param == "nvme":
        in_cpu = min(10**9, S)  # max_in_cpu's default keeps a small model in host memory
        host += b * in_cpu
        buffers = max(5, min(min(5 * 10**8, S // 4) // Ls, 20))  # buffer_count 5, buffer_size 1e8
        host += buffers * b * Ls
        nvme += 0 if is_master else b * (S - in_cpu)
    elif not is_master:
        if param == "cpu":
            host += b * S
        else:
            device += b * S
    if opt != "none":  # the gradient crossing's two host slabs (pin_memory's default, false: no ring)
        host += 2 * crossing_slab(Ls)
    free = world == 1 and param == "none"
    if not free:
        device += b * P  # stages 0-2: every unit whole; stage 3: up to max_live (1e9) elements, the model
    return host, device, nvme


@pytest.mark.parametrize("world", [1, W])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_bytes_by_formula(stage, offload, dtype, world):
    model = GPT(CFG)
    P, L = model_sizes(model)
    b = 4 if dtype == "fp32" else 2
    if stage == 0 and offload != "none":
        with pytest.raises(ValueError, match="needs ZeRO stage 1, 2 or 3"):
            zero.estimate_rank_bytes(model, stage, "none", offload, dtype, world)
        return
    got = zero.estimate_rank_bytes(model, stage, offload if stage == 3 else "none", offload, dtype, world)
    assert (got.host_bytes, got.device_bytes, got.nvme_bytes) == expected(stage, offload, P, L, b, world)
    assert got.host_bytes + got.device_bytes + got.nvme_bytes == sum(p.nbytes for p in got.parts)
    if stage < 3:
        assert not any("stage3_" in p.setting for p in got.parts)


@pytest.mark.parametrize("stage", [1, 2])
def test_below_stage_3_the_parameters_are_whole_on_every_rank_and_the_states_partitioned(stage):
    P = 10**9
    one = zero.estimate_rank_bytes(P, stage, "none", "cpu", "bf16", world_size=1)
    eight = zero.estimate_rank_bytes(P, stage, "none", "cpu", "bf16", world_size=8)
    slabs = 2 * crossing_slab(0)  # the gradient crossing's host slabs (no largest layer given: their least)
    assert one.device_bytes == 2 * P and one.host_bytes == 16 * P + slabs
    assert eight.device_bytes == 2 * P + 2 * P // 8  # whole parameters + this rank's partition
    assert eight.host_bytes == 16 * P // 8 + slabs  # fp32 master, exp_avg, exp_avg_sq and gradient: 4·P/W each
    assert zero.estimate_rank_bytes(P, stage, world_size=8, dtype="fp32").device_bytes == 4 * P + 16 * P // 8


def test_offload_param_below_stage_3_is_refused():
    with pytest.raises(ValueError, match="offload_param .* needs ZeRO stage 3"):
        zero.estimate_rank_bytes(1000, 2, "cpu", "cpu")


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "none"), (2, "cpu"), (2, "nvme"), (3, "cpu"),
                                           (3, "nvme")])
def test_on_a_cpu_machine_the_compute_devices_bytes_are_host_memory(stage, offload):
    model = GPT(CFG)
    param = offload if stage == 3 else "none"
    cuda = zero.estimate_rank_bytes(model, stage, param, offload, "bf16", W)
    cpu = zero.estimate_rank_bytes(model, stage, param, offload, "bf16", W, compute_device="cpu")
    crossing = sum(p.nbytes for p in cuda.parts if "crossing" in p.what)
    assert crossing == (0 if offload == "none" else 2 * crossing_slab(-(-model_sizes(model)[1] // W)))
    assert cpu.device_bytes == 0
    assert cpu.host_bytes == cuda.host_bytes - crossing + cuda.device_bytes  # no copies to stage on a CPU
    assert cpu.nvme_bytes == cuda.nvme_bytes


def test_one_fp32_rank_on_the_cpu_trains_on_the_master_itself():
    P, _ = model_sizes(GPT(CFG))
    for stage in (1, 2):
        got = zero.estimate_rank_bytes(P, stage, "none", "cpu", "fp32", 1, compute_device="cpu")
        assert got.host_bytes == 16 * P  # the parameters view the fp32 master: nothing more


# -- measured: what an engine's stores hold ------------------------------------------------------

def _config(stage, offload_optimizer, precision, world_size):
    config = base_config("none", offload_optimizer, precision=precision, world_size=world_size)
    config["zero_optimization"] = {"stage": stage, "sub_group_size": 4096,
                                   "offload_optimizer": {"device": offload_optimizer}}
    return config


def _held_bytes(engine) -> dict:
    """What the engine's stores and gathered parameters actually hold, in bytes."""
    opt = engine.parts.optimizer_store
    params = engine.parts.param_store
    units = engine.parts.units
    return {
        "optimizer": opt.master.nbytes + sum(t.nbytes for t in opt.states.values()) + opt.grads.nbytes,
        "optimizer_device": opt.master.device.type,
        "partition": 0 if params.aliased else params.flat.nbytes,
        "whole": sum(u.full.nbytes for u in units if not u.free),
        "free_units": sum(u.free for u in units),
        "units": len(units),
        "rank_numel": engine.parts.rank_layout.numel,
        "padded": sum(u.layout.padded_numel for u in units),
    }


def _measure(stage, offload_optimizer, precision, world_size):
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=_config(stage, offload_optimizer, precision,
                                                                     world_size))
    try:
        return _held_bytes(engine)
    finally:
        engine.destroy()


def scenario_measure(rank, world_size, scratch, cases):
    return [_measure(*case, world_size) for case in cases]


def _check(held, stage, offload_optimizer, precision, world_size):
    P, _ = model_sizes(GPT(CFG))
    assert held["padded"] == P  # every unit of the example GPT splits evenly: the formula's P/W exactly
    assert held["rank_numel"] * world_size == P
    est = zero.estimate_rank_bytes(P, stage, "none", offload_optimizer, precision, world_size,
                                   compute_device="cpu")
    by_setting = {}
    for p in est.parts:
        by_setting.setdefault(p.setting, []).append(p.nbytes)
    optimizer_key = "zero_optimization.offload_optimizer.device"
    assert held["optimizer"] == sum(by_setting[optimizer_key]) == 16 * P // world_size
    assert held["optimizer_device"] == "cpu"
    # the parameters: the partition (unless it is the fp32 master) and, on several ranks, every unit whole
    assert held["partition"] + held["whole"] == sum(by_setting.get("zero_optimization.stage", [0]))
    assert est.host_bytes == held["optimizer"] + held["partition"] + held["whole"]
    b = 4 if precision == "fp32" else 2
    assert held["whole"] == (0 if world_size == 1 else b * P)
    assert held["free_units"] == (held["units"] if world_size == 1 else 0)  # one rank: units view the partition


ONE_RANK = [(1, "none", "fp32"), (1, "cpu", "bf16"), (2, "none", "bf16"), (2, "cpu", "fp32")]
TWO_RANKS = [(1, "none", "bf16"), (2, "cpu", "bf16"), (2, "none", "fp32")]


@pytest.mark.parametrize("stage,offload_optimizer,precision", ONE_RANK)
def test_one_rank_holds_what_the_formula_says(stage, offload_optimizer, precision):
    _check(_measure(stage, offload_optimizer, precision, 1), stage, offload_optimizer, precision, 1)


def test_two_ranks_hold_what_the_formula_says(tmp_path):
    results = run_ranks(W, [("measure", scenario_measure, {"cases": TWO_RANKS})], tmp_path)
    for rank, r in enumerate(results):
        assert "error" not in r["measure"], r["measure"]["error"]
        for held, case in zip(r["measure"], TWO_RANKS):
            _check(held, *case, W)


@pytest.mark.parametrize("compute,optimizer,pin_memory,ring", [
    ("cuda", "cpu", True, True), ("cuda", "nvme", True, True), ("cuda", "cpu", False, False),
    ("cuda", "none", True, False), ("cpu", "cpu", True, False)])
def test_a_gpus_write_back_ring_is_counted_where_the_engine_makes_it(compute, optimizer, pin_memory, ring):
    """Parameters on the GPU and a pinned host optimizer: the step's values reach the shards
    through the 64 MiB registered ring (zero/runtime/write_back.py), host memory the check counts
    (zero/engine/build.py makes it by the same rule, zero/stores/pinned_host.py makes_write_back_ring)."""
    from zero.config.offload import OffloadOptimizerConfig, OffloadParamConfig
    from zero.stores.pinned_host import RING_BYTES
    from zero.stores.rank_memory import RankSizes, rank_memory_parts

    parts = rank_memory_parts(RankSizes.of_counts(10**6, 10**5, 1, 10**9), stage=2,
                              offload_param=OffloadParamConfig.model_construct(device="none"),
                              offload_optimizer=OffloadOptimizerConfig.model_construct(device=optimizer,
                                                                                       pin_memory=pin_memory),
                              itemsize=2, compute_device=compute)
    rings = [p for p in parts if "ring" in p.what]
    assert [(p.nbytes, p.where, p.setting) for p in rings] == (
        [(RING_BYTES, "host", "zero_optimization.offload_optimizer.pin_memory")] if ring else [])
    crossing = [p.nbytes for p in parts if "crossing" in p.what]
    assert crossing == ([] if compute == "cpu" or optimizer == "none" else [2 * crossing_slab(10**5)])
