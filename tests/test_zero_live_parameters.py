"""stage3_max_live_parameters and stage3_max_reuse_distance are the memory bounds DeepSpeed users set.

Parameters on NVMe: the elements of gathered or prefetching units never pass
``stage3_max_live_parameters`` (beyond what the running modules need at once),
a unit fetched again within ``stage3_max_reuse_distance`` is kept instead of
read again, and neither changes a single bit of the results.
"""
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig(layers=3)
STEPS = 3


def run(tmp_path, **zero_extra):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config("nvme", "cpu", tmp_path, lr=1e-2, **zero_extra)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    fetches = []
    store = engine.parts.param_store
    inner = store.fetch
    store.fetch = lambda layout: (fetches.append(layout.index), inner(layout))[1]
    try:
        losses = train_engine(engine, make_batches(CFG, STEPS, 4), STEPS)
        sizes = sorted(u.layout.numel for u in engine.parts.units)
        return losses, engine.parts.coordinator.peak_live_numel, len(fetches), sizes
    finally:
        engine.destroy()


def test_live_parameters_stay_within_the_bound_and_results_do_not_change(tmp_path):
    free_losses, free_peak, _, sizes = run(tmp_path)
    # What the running modules can need at once: the root's unit, the tied embedding, one layer.
    bound = sum(sizes[-3:])
    assert free_peak > bound  # the default bound (1e9) keeps much more: the test below bites
    losses, peak, _, _ = run(tmp_path, stage3_max_live_parameters=bound)
    assert peak <= bound
    assert losses == free_losses


def test_units_reused_within_the_distance_are_not_read_again(tmp_path):
    near_losses, _, near_fetches, _ = run(tmp_path, stage3_max_reuse_distance=10**9)
    far_losses, _, far_fetches, _ = run(tmp_path, stage3_max_reuse_distance=0)
    assert near_fetches < far_fetches
    assert near_losses == far_losses
