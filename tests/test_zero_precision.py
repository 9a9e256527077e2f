"""bf16 and fp16 training: close to fp32, identical across offloads, fp16 overflow handling.

Stated tolerances against the fp32 plain-PyTorch losses over 10 steps of the
test GPT: bf16 within rtol 2e-2 (measured 6e-3), fp16 within rtol 5e-3
(measured 4e-4). Master weights stay fp32 in every case: only the compute
copies are 16-bit.
"""
import logging
import math

import pytest
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig()
STEPS = 10
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}


@pytest.fixture(scope="module")
def fp32_losses():
    torch.manual_seed(0)
    return train_reference(GPT(CFG), make_batches(CFG, STEPS, 4), STEPS, lr=1e-2, clip=1.0)


def train(tmp_path, precision, offload="none", steps=STEPS, **extra):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config(offload, offload, tmp_path, clip=1.0, lr=1e-2, precision=precision)
    config.update(extra)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine, model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_runs_track_fp32_and_agree_across_offloads(tmp_path, fp32_losses, precision):
    runs = {}
    for offload in ("none", "cpu", "nvme"):
        engine, model = train(tmp_path, precision, offload)
        try:
            runs[offload] = train_engine(engine, make_batches(CFG, STEPS, 4), STEPS)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            assert {p.dtype for p in model.parameters()} == {dtype}
            grads = engine.parts.optimizer_store.grads  # nvme: on NVMe, sub-group by sub-group
            assert grads is None if offload == "nvme" else grads.dtype == torch.float32
            assert engine.skipped_steps == 0
        finally:
            engine.destroy()
    torch.testing.assert_close(torch.tensor(runs["none"]), torch.tensor(fp32_losses),
                               rtol=TOLERANCE[precision], atol=0)
    assert runs["none"] != fp32_losses  # really 16-bit
    assert runs["cpu"] == runs["none"] and runs["nvme"] == runs["none"]


def snapshot(model):
    with zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_overflow_skips_exactly_that_step_and_lowers_the_scale(tmp_path, caplog, hysteresis):
    engine, model = train(tmp_path, "fp16", fp16={"enabled": True, "initial_scale_power": 8,
                                                  "hysteresis": hysteresis})
    batches = make_batches(CFG, 6, 4)
    scales, changed = [], []
    try:
        with caplog.at_level(logging.INFO, logger="zero"):
            for step, (x, y) in enumerate(batches):
                before = snapshot(model)
                loss = engine(x, y)
                if step == 3:
                    loss = loss * math.inf  # the injected overflow
                engine.backward(loss)
                engine.step()
                after = snapshot(model)
                changed.append(any(not torch.equal(a, b) for a, b in zip(before, after)))
                scales.append(engine.get_loss_scale())
    finally:
        engine.destroy()
    assert changed == [True, True, True, False, True, True]
    assert engine.skipped_steps == 1 and engine.global_steps == 6
    assert engine.optimizer.adam_step == 5
    lowered = 128.0 if hysteresis == 1 else 256.0
    assert scales == [256.0, 256.0, 256.0, lowered, lowered, lowered]
    overflow = [r.getMessage() for r in caplog.records if "OVERFLOW" in r.getMessage()]
    assert len(overflow) == 1
    if hysteresis == 1:
        assert "Attempted loss scale: 256, reducing to 128" in overflow[0]
    else:
        assert "hysteresis is 2. Reducing hysteresis to 1" in overflow[0]


def test_fp16_scale_grows_after_a_window_without_overflow(tmp_path):
    engine, _ = train(tmp_path, "fp16", fp16={"enabled": True, "initial_scale_power": 8,
                                              "loss_scale_window": 2})
    try:
        train_engine(engine, make_batches(CFG, 5, 4), 5)
        # DeepSpeed's rule: doubled after steps 3 and 5 (2 stable steps after the first one).
        assert engine.get_loss_scale() == 256.0 * 4
    finally:
        engine.destroy()


def test_static_fp16_loss_scale_is_applied_and_kept(tmp_path, fp32_losses):
    engine, _ = train(tmp_path, "fp16", fp16={"enabled": True, "loss_scale": 64})
    try:
        losses = train_engine(engine, make_batches(CFG, STEPS, 4), STEPS)
        assert engine.get_loss_scale() == 64.0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32_losses), rtol=5e-3, atol=0)
    finally:
        engine.destroy()
