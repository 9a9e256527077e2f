"""Optimizer sub-groups stepped during backward (offload_optimizer nvme, no clipping, no dynamic
loss scale): bit-identical to plain PyTorch AdamW(fused=True) and to the step after backward,
with gradient accumulation too; no gradient ever goes to NVMe (partial sums of a window are
held in memory within the stash's budget, written only past it); the setting is honoured, and
an explicit ``true`` that cannot apply warns once, naming why (see zero/engine/optimizer.py
[Note: sub-groups stepped during backward])."""
import copy
import warnings

import pytest
import torch

import zero
from zero.config import IgnoredSettingWarning
from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig(layers=3)
STEPS = 4


def train(tmp_path, offload_param, accumulation, step_in_backward, precision="fp32", clip=0.0, hold=True,
          pipeline=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS * accumulation, 4)
    config = base_config(offload_param, "nvme", tmp_path, accumulation=accumulation, lr=1e-2,
                         sub_group_size=3000, precision=precision, clip=clip)
    if step_in_backward is not None:
        config["zero_optimization"]["offload_optimizer"]["step_in_backward"] = step_in_backward
    if pipeline:  # five sub-groups in memory: three read ahead (zero/stores/optimizer_store.py BACKWARD_READ_AHEAD)
        config["zero_optimization"]["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    if not hold:
        engine.parts.reducer.stash.hold_budget = 0
    grad_writes = []
    swapper = engine.parts.optimizer_store.swapper
    real = swapper.swap_out_gradients
    swapper.swap_out_gradients = lambda *a, **k: grad_writes.append(a[0]) or real(*a, **k)
    try:
        losses = train_engine(engine, batches, STEPS, accumulation)
        with zero.GatheredParameters(list(model.parameters())):
            final = [p.detach().clone() for p in model.parameters()]
        assert engine.optimizer.adam_step == STEPS and not engine.optimizer.step_in_progress
    finally:
        engine.destroy()
    return losses, final, grad_writes, (reference, batches)


@pytest.mark.parametrize("offload_param,accumulation,hold,pipeline", [
    ("nvme", 1, True, False), ("cpu", 3, True, False), ("cpu", 3, False, False), ("none", 2, False, False),
    ("nvme", 1, True, True), ("nvme", 3, False, True), ("cpu", 3, False, True)])
def test_stepping_during_backward_matches_plain_pytorch_and_writes_no_gradient(tmp_path, offload_param,
                                                                               accumulation, hold, pipeline):
    losses, final, grad_writes, (reference, batches) = train(tmp_path, offload_param, accumulation, None,
                                                             hold=hold, pipeline=pipeline)
    assert losses == train_reference(reference, batches, STEPS, accumulation, lr=1e-2)
    for a, b in zip(final, reference.parameters()):
        assert torch.equal(a, b.detach())
    if hold or accumulation == 1:
        assert grad_writes == []
    else:  # the partial sums of the window's first micro-batches go to NVMe, never the last
        assert len(grad_writes) == (accumulation - 1) * STEPS * len(set(grad_writes)) > 0


@pytest.mark.parametrize("hold", [False, True], ids=["round-trip", "held"])
def test_step_in_backward_false_gives_the_same_bits(tmp_path, hold):
    on = train(tmp_path / "on", "nvme", 1, True)
    off = train(tmp_path / "off", "nvme", 1, False, hold=hold)
    assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    # the step after backward reads the gradients from NVMe, or from memory when held
    assert on[2] == [] and (off[2] == [] if hold else len(off[2]) >= STEPS * 2)


def test_clipping_keeps_the_step_after_backward_and_an_explicit_true_warns_why(tmp_path):
    with pytest.warns(IgnoredSettingWarning, match=r"step_in_backward = true has no effect: "
                                                        r"gradient_clipping needs the global gradient norm"):
        losses, final, grad_writes, (reference, batches) = train(tmp_path, "nvme", 1, True, clip=0.05,
                                                                 hold=False)
    assert losses == train_reference(reference, batches, STEPS, lr=1e-2, clip=0.05)
    assert len(grad_writes) >= STEPS  # past the hold budget, gradients wait on NVMe for the global norm


def test_the_default_warns_nothing(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, "nvme", 1, None, clip=0.05)
    assert [str(w.message) for w in caught if issubclass(w.category, IgnoredSettingWarning)] == []


def test_backward_reads_each_master_once(tmp_path):
    """fp32 shards homed in the master, stepped during backward: a shard whose sub-group is read
    for the step comes from that read (zero/stores/optimizer_store.py, [Note: backward reads a
    sub-group once]). Each step reads every sub-group's state once, backward reads far fewer
    shard bytes than the model has, and the bits are plain PyTorch's."""
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS, 4)
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2, sub_group_size=3000)
    zc = config["zero_optimization"]
    zc["offload_param"]["buffer_count"] = 2  # backward reads its shards again
    zc["stage3_max_reuse_distance"] = 0
    zc["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)  # 3 sub-groups in memory
    engine, _, _, _ = zero.initialize(model=model, config=config)
    params, optimizer = engine.parts.param_store.swapper, engine.parts.optimizer_store.swapper
    layout = engine.parts.rank_layout
    state_reads = []
    begin_read = optimizer._begin_read
    optimizer._begin_read = lambda g: state_reads.append(g.sub_group_id) or begin_read(g)
    try:
        assert engine.parts.param_store.master is engine.parts.optimizer_store  # homed shards
        losses, shard_reads, reads_per_step = [], [], []
        for x, y in batches:
            loss = engine(x, y)
            before = params.io_bytes.read
            state_reads.clear()
            engine.backward(loss)
            engine.step()
            shard_reads.append(params.io_bytes.read - before)
            reads_per_step.append(sorted(state_reads))
            losses.append(loss.item())
    finally:
        engine.destroy()
    shards = sum(u.shard_numel for u in layout.units) * 4
    groups = sorted(sg.index for sg in layout.sub_groups if sg.numel)
    assert len(groups) > 3
    assert all(r == groups for r in reads_per_step), reads_per_step  # each sub-group once a step
    assert all(s < shards // 2 for s in shard_reads[1:]), (shard_reads, shards)
    assert losses == train_reference(reference, batches, STEPS, lr=1e-2)


@pytest.mark.parametrize("clip,precision,step_in_backward,expected", [
    (0.0, "fp32", True, 5), (0.05, "fp32", True, 3), (0.0, "fp16", True, 3), (0.0, "fp32", False, 3)])
def test_three_sub_groups_are_read_ahead_only_where_backward_steps_them(tmp_path, monkeypatch, clip, precision,
                                                                        step_in_backward, expected):
    """The pool holds the stepped, the written and BACKWARD_READ_AHEAD sub-groups read ahead when
    the engine steps during backward; one read ahead where it cannot (clipping, fp16's dynamic
    loss scale) or is told not to, and the host-memory check counts what the store holds."""
    from zero.stores import memory_check

    config = base_config("cpu", "nvme", tmp_path, sub_group_size=3000, precision=precision, clip=clip)
    config["zero_optimization"]["offload_optimizer"].update(
        pipeline_read=True, pipeline_write=True, step_in_backward=step_in_backward)
    parts_seen = []
    real = memory_check.host_memory_parts
    monkeypatch.setattr(memory_check, "host_memory_parts",
                        lambda *a, **k: parts_seen.append(real(*a, **k)) or parts_seen[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredSettingWarning)
        engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    try:
        assert engine.parts.optimizer_store.swapper.buffer_count == expected
        if step_in_backward:  # the build's answer is the optimizer's
            assert (engine.optimizer.why_not_step_in_backward() is None) == (expected == 5)
        [part] = [p for p in parts_seen[0] if p.what.startswith("optimizer swap buffers")]
        assert part.what.startswith(f"optimizer swap buffers ({expected} x ")
    finally:
        engine.destroy()
