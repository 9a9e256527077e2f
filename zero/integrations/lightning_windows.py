"""The training dataloader in accumulation windows, for ``ZeroStrategy(use_train_batch=True)``.

Lightning's loop hands ``training_step`` one batch at a time and finishes it (outputs, logs,
hooks) before it fetches the next, but a window run unit-major needs all its micro-batches at
once. So the strategy gives Lightning a loader whose every batch is a :class:`Window` of k
batches (the last of an epoch may be shorter), and trains each Window through
``engine.train_batch`` (lightning_strategy.py, [Note: accumulation windows in Lightning]).
"""
from __future__ import annotations

from typing import Iterator


class Window(list):
    """The k batches of one accumulation window, as the loop gets them (a list, so that Lightning
    moves them to the device as it moves any batch)."""


class WindowLoader:
    """``loader``'s batches, ``k`` at a time; its length, sampler and batch sampler are the loader's
    (Lightning counts batches with the first and sets the epoch on the others)."""

    def __init__(self, loader, k: int):
        self.loader, self.k = loader, k

    def __iter__(self) -> Iterator[Window]:
        window = Window()
        for batch in self.loader:
            window.append(batch)
            if len(window) == self.k:
                yield window
                window = Window()
        if window:
            yield window

    def __len__(self) -> int:
        return -(-len(self.loader) // self.k)

    @property
    def sampler(self):
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self):
        return getattr(self.loader, "batch_sampler", None)
