"""One training step three ways, as the training benchmarks time it: plain PyTorch (the model in
memory, fused AdamW), our engine and DeepSpeed's (``engine(x, y); engine.backward(loss);
engine.step()``), and the loop that times them.

    ex = examples(deepspeed=False)
    model = ex.GPT(ex.GPTConfig(**shape))
    step = torch_step(model, x, y, lr=1e-4)          # or engine_step(engine, x, y)
    times, losses = timed_steps(step, warmup=2, steps=10)
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

from bench.harness import ROOT, free_port


def examples(deepspeed: bool = False):
    """zero.examples (the GPT). DeepSpeed's venv has no nvmeio, so there the file is loaded on
    its own (it needs torch only)."""
    if not deepspeed:
        import zero.examples

        return zero.examples
    spec = importlib.util.spec_from_file_location("gpt_examples", os.path.join(ROOT, "zero", "examples.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def torch_step(model, x, y, lr: float, weight_decay: float = 0.01):
    """Plain PyTorch at its best: forward, backward, ``AdamW(fused=True)``; returns the step."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)

    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def engine_step(engine, x, y):
    """Our engine's or DeepSpeed's step (the same three calls)."""
    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def join_as_single_rank() -> None:
    """The environment ``deepspeed.initialize`` wants for a single rank, on a free port."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def timed_steps(step, warmup: int, steps: int) -> tuple:
    """Runs ``step`` ``warmup + steps`` times; every step's seconds and loss."""
    times, losses = [], []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return times, losses
