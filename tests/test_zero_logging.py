"""steps_per_print and wall_clock_breakdown: what a DeepSpeed user expects to see in the log."""
import logging
import re

import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()


def run(tmp_path, caplog, offload="none", **extra):
    config = base_config(offload, offload, tmp_path, lr=1e-2, precision="fp16")
    config.update(extra)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    with caplog.at_level(logging.INFO, logger="zero"):
        train_engine(engine, make_batches(CFG, 4, 4), 4)
    engine.destroy()
    return [r.getMessage() for r in caplog.records if r.name == "zero"]


def test_steps_per_print_logs_step_loss_scale_and_lr(tmp_path, caplog):
    lines = run(tmp_path, caplog, steps_per_print=2)
    progress = [line for line in lines if line.startswith("step=")]
    assert progress == [
        "step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)], loss_scale=256",
        "step=4, skipped=0, lr=[0.01], mom=[(0.9, 0.999)], loss_scale=256",
    ]
    assert not any(line.startswith("time (ms)") for line in lines)


def test_wall_clock_breakdown_logs_every_step_forward_backward_optimizer_and_nvme_waits(tmp_path, caplog):
    lines = run(tmp_path, caplog, offload="nvme", steps_per_print=4, wall_clock_breakdown=True)
    times = [line for line in lines if line.startswith("time (ms)")]
    assert [t.split(" |")[0] for t in times] == [f"time (ms) step {n}" for n in (1, 2, 3, 4)]
    for line in times:
        names = [part.split(":")[0].strip() for part in line.split("|")[1:]]
        assert names[:5] == ["forward", "backward", "optimizer", "read wait", "write wait"]
        fields = dict(re.findall(r"([a-z -]+?): ([0-9.]+)", line.split("|", 1)[1]))
        fields = {k.strip(): float(v) for k, v in fields.items()}
        assert {"param fetch", "grad reduce"} <= set(fields)
        assert fields["forward"] > 0 and fields["backward"] > 0 and fields["optimizer"] > 0
        assert fields["read wait"] > 0  # NVMe reads were timed
        assert fields["param fetch"] <= fields["forward"] + fields["backward"]


def test_nothing_is_logged_between_prints(tmp_path, caplog):
    lines = run(tmp_path, caplog, steps_per_print=100)
    assert not any(line.startswith(("step=", "time (ms)")) for line in lines)
    assert torch.is_grad_enabled()
