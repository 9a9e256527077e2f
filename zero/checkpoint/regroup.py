"""A checkpoint whose units group the same parameters otherwise, read in this engine's units.

[Note: a checkpoint grouped otherwise]
A checkpoint's shards are laid out by units (a module's own parameters, flattened in order), and a
resharded load reads element ranges of those units. An engine now gives a module that owns frozen
and trainable parameters two units (runtime/unit.py, [Note: a module's frozen and trainable
parameters]); a checkpoint saved before that, or by an engine whose parameters were frozen
otherwise, holds the same parameters in other units. :class:`RegroupedReader` answers the
resharded load's questions in this engine's units: each of its units is a run of parameter slots,
each slot found by its name in the checkpoint's units, so a range of it is read as the pieces of
the saved units it covers (padding past the last slot reads zeros). A piece from a unit the
checkpoint saved frozen has no optimizer states (zeros, as for a unit frozen when saved); a unit
any of whose parameters the checkpoint left out is ``excluded`` (it keeps this model's values).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from ..stores.layouts import UnitLayout
from .format import ShardReader


class RegroupedReader:
    """:class:`ShardReader`'s ``read`` / ``check`` / ``files`` / ``frozen`` / ``excluded`` in the
    engine's unit indices (see the note); the parameters must be the same, by name and shape."""

    def __init__(self, reader: ShardReader, units: Sequence[UnitLayout]):
        self.reader = reader
        where = {s.name: (u.index, s.offset) for u in reader.units for s in u.slots}
        # per unit of ours: (offset in our flat, numel, saved unit index, offset in its flat)
        self._slots: List[List[Tuple[int, int, int, int]]] = [
            [(s.offset, s.numel, *where[s.name]) for s in u.slots] for u in units]
        sources = [{saved for _, _, saved, _ in slots} for slots in self._slots]
        self.frozen = frozenset(i for i, src in enumerate(sources) if src and src <= reader.frozen)
        self.excluded = frozenset(i for i, src in enumerate(sources) if src & reader.excluded)

    def _pieces(self, index: int, start: int, stop: int) -> Iterator[Tuple[int, int, int, int]]:
        """``(saved unit, its start, out start, length)`` of each saved range in ``[start, stop)``."""
        for offset, numel, saved, saved_offset in self._slots[index]:
            a, b = max(start, offset), min(stop, offset + numel)
            if a < b:
                yield saved, saved_offset + a - offset, a - start, b - a

    def _wanted(self, saved: int, key: str) -> bool:
        return key == "master" or saved not in self.reader.frozen

    def read(self, index: int, start: int, stop: int, key: str = "master") -> torch.Tensor:
        out = torch.zeros(max(0, stop - start), dtype=torch.float32)
        for saved, src, dst, n in self._pieces(index, start, stop):
            if self._wanted(saved, key):
                out[dst:dst + n] = self.reader.read(saved, src, src + n, key)
        return out

    def check(self, index: int, start: int, stop: int, key: str = "master") -> None:
        for saved, src, _, n in self._pieces(index, start, stop):
            if self._wanted(saved, key):
                self.reader.check(saved, src, src + n, key)

    def files(self, index: int, start: int, stop: int) -> List[str]:
        paths: Dict[str, None] = {}
        for saved, src, _, n in self._pieces(index, start, stop):
            paths.update(dict.fromkeys(self.reader.files(saved, src, src + n)))
        return list(paths)

    def close(self) -> None:
        self.reader.close()
