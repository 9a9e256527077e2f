"""zero/runtime/prefetch.py [Note: the read-ahead resumes where it stopped]: a fetch looks ahead
from where the last look stopped, not from its own position, so an iteration's looks together
pass each trace position a few times, not once per fetch (quadratic in the units)."""
import dataclasses

import torch

import zero
from helpers import base_config
from zero.examples import GPT, GPTConfig, add_lora, make_batches
from zero.runtime.unit import ParamUnit

CFG = GPTConfig(vocab=128, d_model=32, heads=2, layers=12, seq=16)


def test_a_lora_iteration_looks_at_each_trace_position_a_few_times_not_once_per_fetch(tmp_path, monkeypatch):
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=base_config("nvme", "cpu", tmp_path)):
        model = GPT(CFG)
    add_lora(model, rank=2)  # the base is kept gathered from forward to backward: most looks pass kept units
    engine, _, _, _ = zero.initialize(model=model, config=base_config("nvme", "cpu", tmp_path))
    x, y = make_batches(dataclasses.replace(CFG), 1, 1)[0]

    def iteration():
        engine.backward(engine(x, y))
        engine.step()

    for _ in range(2):  # the first records the trace
        iteration()
    looks = []
    real = ParamUnit.state.fget
    monkeypatch.setattr(ParamUnit, "state", property(lambda u: (looks.append(u), real(u))[1]))
    iteration()
    monkeypatch.undo()
    trace = len(engine.parts.coordinator.prefetcher.trace)
    assert trace > 2 * len(engine.parts.units) - 10  # fetched in forward and again in backward
    # The old walk: about trace * trace / 2. Now each position a few times, the next forward's
    # included (its frozen units are read ahead during backward: zero/runtime/prefetch.py).
    assert len(looks) < 12 * trace, (len(looks), trace)
    engine.destroy()
