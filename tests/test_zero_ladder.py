"""The ZeRO ladder: stages 0, 1 and 2 (with and without ZeRO-Offload) train exactly as plain
PyTorch on one rank and as DDP on two, and checkpoints move between stages and rank counts.

Below stage 3 every parameter is whole on every rank (zero/engine/build.py, [Note: the ZeRO
ladder]): one rank's losses and weights are bit-identical to plain PyTorch's fused AdamW,
with accumulation (the loop and train_batch), clipping and a scheduler. Two ranks' are
bit-identical to DDP's, run in the same processes, where the arithmetic is the same: one
micro-batch a step, no clipping (both sum two gradients and halve them, exactly). With
accumulation DDP sums each rank's micro-batches before reducing them (no_sync) while the
engine reduces each micro-batch into its partition as backward makes it, never holding a
whole gradient; with clipping the norm is composed from the ranks' partitions: those
runs agree to float rounding (stated tolerances below).
"""
import copy

import pytest
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, train_reference, train_reference_mixed
from helpers import ladder_config, run_ranks, train_engine, train_windows as train_window, weights

CFG = GPTConfig()
STEPS = 6
WORLD = 2


# -- one rank: plain PyTorch ------------------------------------------------------------------------

ONE_RANK = [(stage, opt, 1, 0.0, False) for stage in (0, 1, 2) for opt in (("none",) if stage == 0 else
                                                                             ("none", "cpu", "nvme"))]
ONE_RANK += [(2, "cpu", 4, 1.0, False), (1, "nvme", 4, 1.0, False), (2, "nvme", 4, 0.0, True),
             (0, "none", 4, 1.0, True)]


@pytest.mark.parametrize("stage,offload_optimizer,accumulation,clip,window", ONE_RANK)
def test_one_rank_equals_plain_pytorch(tmp_path, stage, offload_optimizer, accumulation, clip, window):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS * accumulation, 4)
    config = ladder_config(stage, offload_optimizer, tmp_path, accumulation, clip)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        assert engine.zero_optimization_stage() == stage
        run = train_window if window else train_engine
        losses = run(engine, batches, STEPS, accumulation)
        final = weights(model)
    finally:
        engine.destroy()
    expected = train_reference(reference, batches, STEPS, accumulation, lr=1e-2, clip=clip)
    assert losses == expected
    assert expected[-1] < expected[0] - 0.3  # it learned: the comparison is not vacuous
    for name, p in reference.named_parameters():
        assert torch.equal(final[name], p.detach()), name


@pytest.mark.parametrize("stage,offload_optimizer", [(0, "none"), (1, "nvme"), (2, "cpu"), (3, "cpu")])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_equals_the_mixed_precision_recipe(tmp_path, stage, offload_optimizer, precision):
    """bf16, and fp16 with a static loss scale, bit-identical to plain PyTorch's recipe: a 16-bit
    compute copy, an fp32 master stepped by fused AdamW, clipping and unscaling in one coefficient."""
    dtype, scale = (torch.bfloat16, 1.0) if precision == "bf16" else (torch.float16, 256.0)
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS, 4)
    config = ladder_config(stage, offload_optimizer, tmp_path, clip=1.0)
    config[precision] = {"enabled": True, **({"loss_scale": scale} if precision == "fp16" else {})}
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        losses = train_engine(engine, batches, STEPS)
        final = weights(model)
    finally:
        engine.destroy()
    expected = train_reference_mixed(reference, batches, STEPS, dtype, lr=1e-2, clip=1.0, loss_scale=scale)
    assert losses == expected and expected[-1] < expected[0] - 0.3
    for name, p in reference.named_parameters():
        assert final[name].dtype == dtype and torch.equal(final[name], p.detach()), name


def test_parameters_stay_whole_between_steps_below_stage_3(tmp_path):
    """No gather in forward: every parameter is whole after initialize and after each step."""
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, _, _, _ = zero.initialize(model=model, config=ladder_config(2, "cpu", tmp_path))
    try:
        shapes = {n: p.shape for n, p in copy.deepcopy(GPT(CFG)).named_parameters()}
        assert {n: p.shape for n, p in model.named_parameters()} == shapes
        train_engine(engine, make_batches(CFG, 2, 4), 2)
        assert {n: p.shape for n, p in model.named_parameters()} == shapes
        assert all(u.persistent for u in engine.units)
    finally:
        engine.destroy()


def test_the_scheduler_steps_the_same_below_stage_3(tmp_path):
    scheduler = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 2, "total_num_steps": STEPS}}
    runs = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = ladder_config(stage, "cpu", tmp_path, clip=1.0, scheduler=scheduler)
        engine, _, _, sched = zero.initialize(model=model, config=config)
        try:
            losses = train_engine(engine, make_batches(CFG, STEPS, 4), STEPS)
            runs[stage] = (losses, sched.get_last_lr())
        finally:
            engine.destroy()
    assert runs[1] == runs[3] and runs[1][1] != [1e-2]


# -- checkpoints move between rungs -------------------------------------------------------------------

def _engine(stage, offload_optimizer, tmp_path, **extra):
    torch.manual_seed(1)  # other initial weights: the load must replace them
    model = GPT(CFG)
    config = ladder_config(stage, offload_optimizer, tmp_path, clip=1.0)
    if stage == 3:
        config["zero_optimization"].update(extra)
    return zero.initialize(model=model, config=config)[0]


@pytest.mark.parametrize("saved,loaded", [((2, "cpu"), (3, "nvme")), ((3, "none"), (1, "cpu")),
                                          ((0, "none"), (2, "nvme")), ((1, "nvme"), (0, "none"))])
def test_a_checkpoint_moves_between_stages_exactly(tmp_path, saved, loaded):
    batches = make_batches(CFG, 5, 4)
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(CFG), config=ladder_config(*saved, tmp_path, clip=1.0))[0]
    try:
        train_engine(engine, batches[:3], 3)
        engine.save_checkpoint(tmp_path / "ckpt", tag="t3")
        uninterrupted = train_engine(engine, batches[3:], 2)
    finally:
        engine.destroy()
    state = zero.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    resumed = _engine(*loaded, tmp_path, offload_param={"device": "cpu"})
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(w, state[n].to(w.dtype)) for n, w in weights(resumed.module).items())
        assert train_engine(resumed, batches[3:], 2) == uninterrupted
        assert resumed.global_steps == 5
    finally:
        resumed.destroy()


# -- two ranks: DDP ------------------------------------------------------------------------------------

def _ddp_reference(rank, world_size, batches, accumulation, clip):
    """DDP over the same process group: fused AdamW, each rank its half of every batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    it = iter(batches)
    for _ in range(STEPS):
        for micro in range(accumulation):
            x, y = next(it)
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = micro == accumulation - 1
            with model.no_sync() if not last else torch.enable_grad():
                loss = model(x, y)
                losses.append(loss.detach().item())
                (loss / accumulation if accumulation > 1 else loss).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach() for n, p in model.module.named_parameters()}


def scenario_ladder(rank, world_size, scratch, stage, offload_optimizer, accumulation, clip, window=False,
                    **zero_extra):
    batches = make_batches(CFG, STEPS * accumulation, 4 * world_size)
    torch.manual_seed(0)
    model = GPT(CFG)
    config = ladder_config(stage, offload_optimizer, scratch, accumulation, clip, world_size=world_size)
    config["zero_optimization"].update(zero_extra)
    engine = zero.initialize(model=model, config=config)[0]
    try:
        run = train_window if window else train_engine
        losses = run(engine, batches, STEPS, accumulation, rank=rank, shards=world_size)
        final = weights(model)
        in_flight = engine.parts.reducer.peak_in_flight_numel
        largest_unit = max(u.layout.padded_numel for u in engine.units)
    finally:
        engine.destroy()
    expected, reference = _ddp_reference(rank, world_size, batches, accumulation, clip)
    return {"losses": losses, "expected": expected, "peak_in_flight": in_flight, "largest_unit": largest_unit,
            "unequal_weights": [n for n, p in reference.items() if not torch.equal(final[n], p)],
            "weight_error": max(((final[n] - p).abs().max() / p.abs().max()).item() for n, p in reference.items())}


def scenario_save_at_stage_1(rank, world_size, scratch):
    batches = make_batches(CFG, 5, 4 * world_size)
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(CFG), config=ladder_config(1, "cpu", scratch, clip=1.0,
                                                                  world_size=world_size))[0]
    try:
        train_engine(engine, batches[:3], 3, rank=rank, shards=world_size)
        engine.save_checkpoint(f"{scratch}/ckpt", tag="t3")
        return {"scratch": scratch, "losses": train_engine(engine, batches[3:], 2, rank=rank, shards=world_size)}
    finally:
        engine.destroy()


def scenario_ranks_start_from_rank_0(rank, world_size, scratch, stage):
    """Each rank builds the model with its own seed; the engine starts every rank from rank 0's."""
    torch.manual_seed(rank)
    model = GPT(CFG)
    engine = zero.initialize(model=model, config=ladder_config(stage, "cpu", scratch, world_size=world_size))[0]
    try:
        torch.manual_seed(0)
        rank0 = dict(GPT(CFG).named_parameters())
        return [n for n, w in weights(model).items() if not torch.equal(w, rank0[n].detach())]
    finally:
        engine.destroy()


TWO_RANKS = {  # name: (scenario arguments, exact)
    "0-none-1": (dict(stage=0, offload_optimizer="none", accumulation=1, clip=0.0), True),
    "1-cpu-1": (dict(stage=1, offload_optimizer="cpu", accumulation=1, clip=0.0), True),
    "2-nvme-1": (dict(stage=2, offload_optimizer="nvme", accumulation=1, clip=0.0), True),
    "0-none-1-clip": (dict(stage=0, offload_optimizer="none", accumulation=1, clip=1.0), False),
    "2-none-4-clip": (dict(stage=2, offload_optimizer="none", accumulation=4, clip=1.0), False),
    "2-cpu-4-window": (dict(stage=2, offload_optimizer="cpu", accumulation=4, clip=1.0, window=True), False),
    "1-nvme-4": (dict(stage=1, offload_optimizer="nvme", accumulation=4, clip=0.0), False),
    "2-none-4-no-overlap": (dict(stage=2, offload_optimizer="none", accumulation=4, clip=1.0,
                                 overlap_comm=False), False),
    "2-none-4-small-bucket": (dict(stage=2, offload_optimizer="none", accumulation=4, clip=1.0,
                                   reduce_bucket_size=3000), False),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    scenarios = [(name, scenario_ladder, kwargs) for name, (kwargs, _) in TWO_RANKS.items()]
    scenarios.append(("save_at_stage_1", scenario_save_at_stage_1, {}))
    scenarios += [(f"start_{stage}", scenario_ranks_start_from_rank_0, {"stage": stage}) for stage in (2, 3)]
    return run_ranks(WORLD, scenarios, tmp_path_factory.mktemp("ladder"))


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_equal_ddp(two_ranks, name):
    exact = TWO_RANKS[name][1]
    for rank in range(WORLD):
        got = two_ranks[rank][name]
        assert "error" not in got, got.get("error")
        if exact:
            assert got["losses"] == got["expected"]
            assert got["unequal_weights"] == []
        else:  # float rounding of a different summation order (see the module's note), no more
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["expected"]),
                                       rtol=1e-5, atol=0)
            # Adam's step of a near-zero gradient element turns its rounding into up to lr
            # (1e-2) of change: weights agree to a fraction of the largest weight, the losses above
            # to 1e-5, where a wrong reduction (a missed halving, a lost micro-batch) is far off.
            assert got["weight_error"] < 1e-2, got["weight_error"]
        assert got["expected"][-1] < got["expected"][0] - 0.3
    assert two_ranks[0][name]["losses"] != two_ranks[1][name]["losses"]  # each rank its own half


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_starts_from_rank_0s_weights(two_ranks, stage):
    """As DDP and DeepSpeed: a model each rank built with its own seed trains from rank 0's values."""
    assert [two_ranks[rank][f"start_{stage}"] for rank in range(WORLD)] == [[], []]


def test_overlap_comm_keeps_reductions_in_flight_within_reduce_bucket_size(two_ranks):
    """overlap_comm (the default) leaves several units' reductions in flight, no more elements than
    reduce_bucket_size allows (one unit always may go), and changes no result."""
    for rank in range(WORLD):
        overlapped, bounded = two_ranks[rank]["2-none-4-clip"], two_ranks[rank]["2-none-4-small-bucket"]
        serial = two_ranks[rank]["2-none-4-no-overlap"]
        assert serial["peak_in_flight"] == 0
        assert overlapped["peak_in_flight"] > overlapped["largest_unit"]  # several units at once
        assert bounded["peak_in_flight"] <= max(3000, bounded["largest_unit"])
        assert overlapped["losses"] == serial["losses"] == bounded["losses"]


@pytest.mark.parametrize("stage", [0, 3])
def test_two_ranks_at_stage_1_resume_on_one_rank(two_ranks, tmp_path, stage):
    got = [two_ranks[rank]["save_at_stage_1"] for rank in range(WORLD)]
    assert all("error" not in g for g in got), [g.get("error") for g in got]
    batches = make_batches(CFG, 5, 4 * WORLD)
    torch.manual_seed(1)
    config = ladder_config(stage, "none", tmp_path, clip=1.0, train_micro_batch_size_per_gpu=4 * WORLD,
                           train_batch_size=4 * WORLD)
    engine = zero.initialize(model=GPT(CFG), config=config)[0]
    try:
        engine.load_checkpoint(f"{got[0]['scratch']}/ckpt")
        losses = train_engine(engine, batches[3:], 2)
    finally:
        engine.destroy()
    two = [(a + b) / 2 for a, b in zip(got[0]["losses"], got[1]["losses"])]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(two), rtol=1e-4, atol=0)
