"""LR schedules: DeepSpeed's definitions, from a config section, stepped by the engine."""
import json
import math
import os

import pytest
import torch

import zero
from zero.engine.lr_schedules import LRRangeTest, OneCycle, WarmupDecayLR, WarmupLR
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, run_process

DS_PYTHON = "/opt/dsvenv/bin/python"
CASES = {
    "WarmupLR": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5},
    "WarmupLR-linear": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
                        "warmup_type": "linear"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "total_num_steps": 12},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4,
                 "cycle_second_step_size": 3, "decay_lr_rate": 0.5, "decay_step_size": 2,
                 "cycle_first_stair_count": 2},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0,
                    "lr_range_test_staircase": True},
}
CLASSES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}
STEPS = 14


def ours(name, params):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = CLASSES[name.split("-")[0]](opt, **params)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_warmup_lr_formula():
    lrs = ours("WarmupLR", CASES["WarmupLR"])
    expected = [0.001] + [0.001 + 0.009 * math.log(i + 1) / math.log(5) for i in range(5)] + [0.01] * 9
    assert lrs == pytest.approx(expected)


def test_warmup_decay_formula():
    lrs = ours("WarmupDecayLR", CASES["WarmupDecayLR"])
    assert lrs[5:] == pytest.approx([0.01 * max(0.0, (12 - i) / 8) for i in range(4, STEPS)])


@pytest.mark.skipif(not os.path.exists(DS_PYTHON), reason="DeepSpeed's venv is not installed")
def test_same_curves_as_deepspeed():
    script = f"""
import json, torch
from deepspeed.runtime import lr_schedules as L
cases = json.loads({json.dumps(json.dumps(CASES))})
out = {{}}
for name, params in cases.items():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = getattr(L, name.split("-")[0])(opt, **params)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range({STEPS}):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    out[name] = lrs
print(json.dumps(out))
"""
    run = run_process([DS_PYTHON, "-c", script], timeout=300)
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for name, params in CASES.items():
        assert ours(name, params) == pytest.approx(theirs[name], rel=1e-12), name


def test_the_engine_steps_the_config_schedule_except_on_overflow(tmp_path):
    cfg = GPTConfig()
    config = base_config(precision="fp16")
    config["fp16"]["hysteresis"] = 1
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                          "warmup_num_steps": 10, "warmup_type": "linear"}}
    engine, _, _, scheduler = zero.initialize(model=GPT(cfg), config=config)
    lrs = []
    for i, (x, y) in enumerate(make_batches(cfg, 4, 4)):
        loss = engine(x, y)
        engine.backward(loss * math.inf if i == 1 else loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    engine.destroy()
    assert lrs == pytest.approx([0.0, 0.0, 0.001, 0.002])  # the overflowed step did not advance it
    assert scheduler.last_batch_iteration == 2
