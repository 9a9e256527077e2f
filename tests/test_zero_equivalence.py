"""One process, fp32: a ZeRO engine trains exactly like plain PyTorch AdamW(fused=True).

Offload none, cpu and nvme (parameters and optimizer states alike) with
gradient accumulation 1 and 4 (the latter with clipping), and every mixed
combination (parameters on one device, optimizer states on another) with
accumulation 1: the 10-step losses match within rtol 1e-6 (in practice bit for
bit) and so do the final parameters.
"""
import copy
import os

import pytest
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig()
STEPS = 10
SAME = [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")]
MIXED = [("none", "cpu"), ("cpu", "none"), ("nvme", "cpu"), ("cpu", "nvme"), ("none", "nvme"), ("nvme", "none")]
CASES = ([(p, o, 1, 0.0) for p, o in SAME] + [(p, o, 4, 1.0) for p, o in SAME]
         + [(p, o, 1, 1.0) for p, o in MIXED])


def run_pair(tmp_path, offload_param, offload_optimizer, accumulation, clip, **extra):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS * accumulation, 4)
    config = base_config(offload_param, offload_optimizer, tmp_path, accumulation=accumulation, clip=clip,
                         lr=1e-2, sub_group_size=3000, **extra)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        losses = train_engine(engine, batches, STEPS, accumulation)
        expected = train_reference(reference, batches, STEPS, accumulation, lr=1e-2, clip=clip)
        with zero.GatheredParameters(list(model.parameters())):
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.destroy()
    return losses, expected, final, dict(reference.named_parameters())


@pytest.mark.parametrize("offload_param,offload_optimizer,accumulation,clip", CASES)
def test_losses_and_weights_match_plain_pytorch(tmp_path, offload_param, offload_optimizer, accumulation, clip):
    losses, expected, final, reference = run_pair(tmp_path, offload_param, offload_optimizer, accumulation, clip)
    assert len(losses) == STEPS * accumulation
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    assert expected[-1] < expected[0] - 0.3  # the run learned something: the comparison is not vacuous
    for name, value in final.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value, reference[name].detach(), rtol=1e-6, atol=0, msg=name)


def test_clipping_changes_the_run(tmp_path):
    """The clipped run differs from the unclipped one, so the test above exercises clipping."""
    clipped, _, _, _ = run_pair(tmp_path, "none", "none", 1, 0.05)
    free, _, _, _ = run_pair(tmp_path, "none", "none", 1, 0.0)
    assert clipped[0] == free[0] and clipped[-1] != free[-1]


def test_persistent_small_units_and_prefetch_keep_equivalence(tmp_path):
    """Persistence threshold (layer norms stay gathered) and NVMe prefetch change nothing numerically."""
    losses, expected, _, _ = run_pair(tmp_path, "nvme", "cpu", 1, 0.0,
                                      stage3_param_persistence_threshold=100,
                                      stage3_prefetch_bucket_size=10_000)
    assert losses == expected


def test_user_adamw_optimizer_is_run_as_the_zero_optimizer(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS, 4)
    config = base_config(lr=1e-2)
    del config["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, zero_opt, _, _ = zero.initialize(model=model, optimizer=opt, config=config)
    losses = train_engine(engine, batches, STEPS)
    assert losses == train_reference(reference, batches, STEPS, lr=1e-2)
    assert zero_opt is engine.optimizer and zero_opt.param_groups[0]["lr"] == 1e-2


def test_nvme_parameters_kept_in_host_memory_by_max_in_cpu(tmp_path):
    """DeepSpeed's default max_in_cpu keeps a small model's parameters in host memory: no parameter
    swap file is written, parameters view those host tensors, and the run is still exact."""
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, STEPS, 4)
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2, clip=1.0, sub_group_size=3000)
    del config["zero_optimization"]["offload_param"]["max_in_cpu"]
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        losses = train_engine(engine, batches, STEPS)
        assert all(u.free for u in engine.parts.units)
        assert os.listdir(engine.parts.param_store.swap_dir) == []
        assert os.listdir(engine.parts.optimizer_store.swap_dir)
    finally:
        engine.destroy()
    assert losses == train_reference(reference, batches, STEPS, lr=1e-2, clip=1.0)
