"""Gradients with offload_optimizer nvme: written to NVMe sub-group by sub-group during backward.

The rank's fp32 gradient partition is never whole in memory (the stash's
open buffers stay far below it), the global norm for clipping is taken on
the way out, accumulation adds to the partial sum (held in host memory within
the stash's budget, else read back from NVMe), and a skipped fp16 step drops
the stashed gradients; results stay those of a resident partition
(test_zero_equivalence.py covers exactness to torch) whatever the budget.
"""
import copy
import math

import pytest
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig(layers=4)


def _engine(tmp_path, optimizer, hold=True, **extra):
    tmp_path.mkdir(exist_ok=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config("cpu", optimizer, tmp_path, lr=1e-2, sub_group_size=3000, **extra)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    if not hold:  # every completed gradient goes to NVMe and back
        engine.parts.reducer.stash.hold_budget = 0
    return engine, model


def _final(engine, model):
    with zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hold", [False, True], ids=["round-trip", "held"])
def test_gradient_partition_never_whole_in_memory_and_results_match_cpu(tmp_path, hold):
    runs = {}
    for optimizer in ("cpu", "nvme"):
        engine, model = _engine(tmp_path, optimizer, hold=hold or optimizer == "cpu", accumulation=3, clip=0.5)
        try:
            losses = train_engine(engine, make_batches(CFG, 9, 4), 3, accumulation=3)
            runs[optimizer] = (losses, _final(engine, model), engine.get_global_grad_norm())
            if optimizer == "nvme":
                stash = engine.parts.reducer.stash
                numel = engine.parts.rank_layout.numel
                assert engine.parts.optimizer_store.grads is None
                assert len(engine.parts.rank_layout.sub_groups) >= 8
                # Sub-group 0 (the tied embedding, whose gradient is complete last) plus the
                # one or two being filled: well under half of the partition.
                assert 0 < stash.peak_open_numel < numel // 2, (stash.peak_open_numel, numel)
                assert stash.open_sub_groups == ()
        finally:
            engine.destroy()
    assert runs["nvme"][0] == runs["cpu"][0]
    assert runs["nvme"][2] == runs["cpu"][2] and runs["cpu"][2] > 0.5  # clipping was active
    for a, b in zip(runs["nvme"][1], runs["cpu"][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hold", [False, True], ids=["round-trip", "held"])
def test_skipped_fp16_step_drops_the_stashed_gradients(tmp_path, hold):
    runs = {}
    for optimizer in ("cpu", "nvme"):
        engine, model = _engine(tmp_path, optimizer, hold=hold or optimizer == "cpu", precision="fp16", clip=1.0)
        losses = []
        try:
            for step, (x, y) in enumerate(make_batches(CFG, 5, 4)):
                loss = engine(x, y)
                losses.append(loss.item())
                engine.backward(loss * math.inf if step == 2 else loss)
                engine.step()
            assert engine.skipped_steps == 1 and engine.optimizer.adam_step == 4
            runs[optimizer] = (losses, _final(engine, model))
        finally:
            engine.destroy()
    assert runs["nvme"][0] == runs["cpu"][0]
    for a, b in zip(runs["nvme"][1], runs["cpu"][1]):
        assert torch.equal(a, b)


def test_gradient_written_while_the_last_state_write_is_in_flight_is_kept(tmp_path):
    # One sub-group: the step's write of its state is still in flight when the next backward
    # writes the new gradient into the same file; that write's completion must not drop it.
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 5, 4)
    config = base_config("cpu", "nvme", tmp_path, lr=1e-2, sub_group_size=10**9, clip=1.0)
    config["zero_optimization"]["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    engine.parts.reducer.stash.hold_budget = 0  # the gradient goes to the file the state is written to
    try:
        assert len(engine.parts.rank_layout.sub_groups) == 1
        losses = train_engine(engine, batches, 5)
    finally:
        engine.destroy()
    assert losses == train_reference(reference, batches, 5, lr=1e-2, clip=1.0)


def _window_bytes(engine, batches, k):
    """Optimizer swap bytes (read, written) of one window of ``k`` micro-batches (the second)."""
    train_engine(engine, batches[:k], 1, accumulation=k)
    counts = engine.parts.optimizer_store.swapper.io_bytes
    before = (counts.read, counts.written)
    train_engine(engine, batches[k:], 1, accumulation=k)
    return counts.read - before[0], counts.written - before[1]


def test_held_partial_sums_make_the_loops_optimizer_bytes_independent_of_accumulation(tmp_path):
    # The micro-batch loop with the running gradient held in memory moves each window what a
    # window of one micro-batch moves (master + states in and out); without the hold every
    # micro-batch writes its sub-groups' gradients and all but the first read them back.
    k, runs = 4, {}
    for name, hold, acc in (("k1", True, 1), ("held", True, k), ("round-trip", False, k)):
        engine, model = _engine(tmp_path / name, "nvme", hold=hold, accumulation=acc, clip=0.5)
        try:
            batches = make_batches(CFG, 2 * acc, 4)
            runs[name] = _window_bytes(engine, batches, acc), _final(engine, model)
            stash = engine.parts.reducer.stash
            assert 0 <= stash.held_bytes <= stash.hold_budget
            grads = 4 * engine.parts.rank_layout.numel
        finally:
            engine.destroy()
    assert runs["held"][0] == runs["k1"][0]
    read, written = runs["round-trip"][0]
    assert read - runs["held"][0][0] == (k - 1) * grads + grads  # k-1 read-backs, and the step's read
    assert written - runs["held"][0][1] == k * grads
    for a, b in zip(runs["held"][1], runs["round-trip"][1]):
        assert torch.equal(a, b)


def test_hold_budget_sends_the_rest_to_nvme_with_the_same_results(tmp_path):
    # A budget of two sub-groups' buffers: the others go to NVMe and back; weights are those of
    # an unlimited budget.
    finals = []
    for budget in (None, 2):
        engine, model = _engine(tmp_path / str(budget), "nvme", accumulation=3, clip=0.5)
        stash = engine.parts.reducer.stash
        if budget is not None:
            stash.hold_budget = budget * stash._buffer_numel * 4
        try:
            train_engine(engine, make_batches(CFG, 6, 4), 2, accumulation=3)
            finals.append(_final(engine, model))
        finally:
            engine.destroy()
    for a, b in zip(*finals):
        assert torch.equal(a, b)
