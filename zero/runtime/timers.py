"""The ``zero`` logger, rank-0 logging, and the wall-clock breakdown timers.

Messages go to the standard ``logging`` logger named ``"zero"``; when the
script configured no handler for it, one that prints to stderr is added, so
``steps_per_print`` lines are seen as users of DeepSpeed expect.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict

import torch

logger = logging.getLogger("zero")


def _ensure_handler() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[zero] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def log_rank0(rank: int, message: str, level: int = logging.INFO) -> None:
    if rank == 0:
        _ensure_handler()
        logger.log(level, message)


class Timers:
    """Accumulated seconds per phase since the last report (``wall_clock_breakdown``).

    On CUDA each phase is closed by a device synchronize, so it measures the
    work it launched, not only the launch.
    """

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.device = device
        self.totals: Dict[str, float] = OrderedDict()

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    # What bounds a step, first: compute, the optimizer, and the time blocked on NVMe.
    HEADLINE = ("forward", "backward", "optimizer", "read wait", "write wait")

    def report(self, step: int) -> str:
        """``time (ms) step N | name: ms | ...`` since the last report, then reset.

        ``read wait`` / ``write wait``: blocked on NVMe reads (parameters, optimizer
        states) and writes; the other fields include the waits inside them."""
        names = [n for n in self.HEADLINE] + [n for n in self.totals if n not in self.HEADLINE]
        text = " | ".join(f"{name}: {1000.0 * self.totals.get(name, 0.0):.2f}" for name in names)
        self.totals.clear()
        return f"time (ms) step {step} | {text}"
