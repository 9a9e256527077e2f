"""A training engine reads its frozen units ahead across iterations (zero/runtime/prefetch.py,
[Note: frozen units are read ahead across iterations]): once the trace is known, backward starts
the reads of the next forward's frozen units, a step leaves them on their way, and nothing the
model computes changes: the losses and weights are those of the engine without it, each frozen
unit is still read once an iteration, and a frozen weight written between iterations while its
read is in flight is what the next forward computes with."""
import copy
import dataclasses

import pytest
import torch

import zero
from helpers import base_config, lora_gpt, train_engine, weights
from zero.examples import GPTConfig, make_batches, train_reference
from zero.runtime.param_state import ParamState

CFG = GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16)


def lora_model(seed: int = 0) -> torch.nn.Module:
    return lora_gpt(CFG, seed)


def batches(n: int):
    return make_batches(dataclasses.replace(CFG), n, 2)


def config(tmp_path, quantized: bool, buffer_count: int = 16) -> dict:
    tmp_path.mkdir(exist_ok=True)
    conf = base_config("nvme", "cpu", tmp_path, lr=1e-2, zero_quantized_nontrainable_weights=quantized)
    conf["zero_optimization"]["offload_param"]["buffer_count"] = buffer_count
    return conf


def in_flight_for_next_forward(engine) -> set:
    """The units read ahead for the next forward, each checked to be frozen and on its way."""
    units, ahead = engine.parts.units, engine.parts.coordinator.prefetcher.ahead
    for i in ahead:
        assert not units[i].grad_count, f"{units[i].layout.module_name} trains but was read ahead past the step"
        assert units[i].state is ParamState.INFLIGHT, units[i].layout.module_name
    return set(ahead)


def run(tmp_path, quantized: bool, wrap: bool, steps: int = 4, buffer_count: int = 16):
    """Losses, final weights, swapper bytes read per step, and what each step left in flight for
    the next forward."""
    model = lora_model()
    engine, _, _, _ = zero.initialize(model=model, config=config(tmp_path, quantized, buffer_count))
    try:
        prefetcher = engine.parts.coordinator.prefetcher
        if not wrap:
            prefetcher.unchanging = set()
        counts = engine.parts.param_store.swapper.io_bytes
        losses, reads, ahead = [], [], []
        for batch in batches(steps):
            before = counts.read
            losses += train_engine(engine, [batch], 1)
            reads.append(counts.read - before)
            ahead.append(in_flight_for_next_forward(engine))
        assert not wrap or prefetcher.any_order == (buffer_count == 16), prefetcher.any_order
        if not prefetcher.any_order:  # read in the forward's order: what is in flight comes first in it
            units = engine.parts.units
            order = list(dict.fromkeys(i for i in prefetcher.trace[:prefetcher.backward_at]
                                       if i in prefetcher.unchanging and not units[i].persistent))
            assert all(a == set(order[:len(a)]) for a in ahead), (order, ahead)
        return losses, weights(model), reads, ahead
    finally:
        engine.destroy()


@pytest.mark.parametrize("quantized,buffer_count", [(False, 16), (True, 16), (False, 4)],
                         ids=["fp32 base", "int8 base", "fp32 base, a pool smaller than the forward"])
def test_backward_reads_the_next_forwards_frozen_units_and_training_is_unchanged(tmp_path, quantized,
                                                                                  buffer_count):
    """With room for all of the next forward's frozen units they are read as backward releases
    them; with less (``any_order`` false), from the end of backward in the forward's order."""
    losses, got, reads, ahead = run(tmp_path / "wrap", quantized, wrap=True, buffer_count=buffer_count)
    plain_losses, plain, plain_reads, plain_ahead = run(tmp_path / "plain", quantized, wrap=False,
                                                        buffer_count=buffer_count)
    assert not any(plain_ahead)
    assert not ahead[0]  # the first iteration records the trace
    assert all(ahead[1:]), ahead
    assert losses == plain_losses
    assert all(torch.equal(got[k], plain[k]) for k in plain)
    # Read ahead, not twice: the second iteration also starts the third's reads, and from then on an
    # iteration reads what it did without (the next forward's part of it, during its backward).
    assert reads[1] > plain_reads[1] and reads[2:] == plain_reads[2:]
    if not quantized:
        assert losses == train_reference(lora_model(), batches(4), 4, lr=1e-2)


def test_a_frozen_weight_written_while_its_read_ahead_is_in_flight_is_what_the_next_forward_uses(tmp_path):
    model = lora_model()
    reference = copy.deepcopy(model)
    engine, _, _, _ = zero.initialize(model=model, config=config(tmp_path, quantized=False))
    try:
        data = batches(4)
        losses = train_engine(engine, data[:2], 2)
        ahead = in_flight_for_next_forward(engine)
        unit = engine.parts.units[min(ahead)]
        name = next(n for n, p in model.named_parameters() if p is unit.params[0])
        assert unit.state is ParamState.INFLIGHT
        with zero.GatheredParameters([unit.params[0]], modifier_rank=0):
            with torch.no_grad():
                unit.params[0].mul_(0.5)
        losses += train_engine(engine, data[2:], 2)
        train_reference(reference, data[:2], 2, lr=1e-2)  # the same two steps, bit for bit
        frozen = dict(reference.named_parameters())[name]
        with torch.no_grad():
            frozen.mul_(0.5)
            x, y = data[2]
            assert losses[2] == float(reference(x, y))  # the third forward saw the halved weight
        assert torch.equal(weights(model)[name], frozen.detach())
    finally:
        engine.destroy()

