"""Real text every machine has: the Python standard library's own source, as bytes.

The demo trains a byte-level model (vocabulary 256) on it. The files are read
in a fixed order (sorted paths, ``site-packages`` and caches skipped), so the
same Python installation always gives the same corpus and the same batches.
"""
from __future__ import annotations

import os
import sysconfig
from typing import List, Tuple

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_bytes(limit: int) -> bytes:
    """Up to ``limit`` bytes of the standard library's ``.py`` files, concatenated in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    parts: List[bytes] = []
    total = 0
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    data = f.read(limit - total)
            except OSError:  # unreadable file: the corpus is what can be read
                continue
            parts.append(data)
            total += len(data)
            if total >= limit:
                return b"".join(parts)
    if not parts:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    return b"".join(parts)


class ByteBatches:
    """Random windows of a byte corpus as (inputs, next-byte targets) batches.

    The last ``held_out`` fraction is kept apart for :meth:`held_out_batches`;
    training windows come from the rest, drawn by a seeded generator.
    """

    def __init__(self, data: bytes, seq: int, batch: int, seed: int = 0, held_out: float = 0.05):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - held_out))
        if split <= seq + 1 or len(tokens) - split <= seq + 1:
            raise ValueError(f"a corpus of {len(tokens)} bytes is too small for windows of {seq + 1} bytes")
        self.train, self.test = tokens[:split], tokens[split:]
        self.seq, self.batch = seq, batch
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, tokens: torch.Tensor, starts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([tokens[s:s + self.seq + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq - 1, (self.batch,), generator=self.generator)
        return self._windows(self.train, starts)

    def held_out_batches(self, count: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``count`` fixed batches spread evenly over the held-out bytes."""
        last = len(self.test) - self.seq - 1
        starts = torch.linspace(0, last, count * self.batch).long()
        return [self._windows(self.test, chunk) for chunk in starts.chunk(count)]
