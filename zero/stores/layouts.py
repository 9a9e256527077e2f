"""Flat partitioning: where each parameter's elements live, on which rank.

[Note: a unit is the parameters one module owns directly]
Parameters are partitioned in *units*: the parameters a module registers
itself (``module._parameters``, not its children's), flattened back to back
in registration order. A unit is gathered, released and reduce-scattered as
one flat buffer, so a Linear layer costs one collective, not two. The flat
unit is padded to a multiple of the world size and rank ``r`` owns the
``r``-th equal slice, its *shard*. A parameter shared by several modules
(tied embeddings) belongs to the unit of the first module that registers it
(``named_modules()`` order); the others gather that unit too.

Each rank lays its shards of all units end to end in its *rank space*: one
flat range ``[0, numel)`` that the fp32 master weights, the optimizer states,
the gradient partition and (when resident) the parameter shards all share.
Sub-groups, the optimizer's step tiles and the NVMe swap granularity, are runs
of whole unit shards of at most ``sub_group_size`` elements (a larger shard is a
sub-group alone), so a unit's shard is never split between two sub-groups.

[Note: the optimizer covers the trainable units only]
In an engine with an optimizer, a unit none of whose parameters requires grad
(a LoRA base, a frozen encoder) is *frozen*: no step changes it, so it has no
fp32 master, no optimizer states and no gradient, as DeepSpeed keeps states for
trainable parameters only. Its shard comes after every trainable unit's in the
rank space, in sub-groups of frozen units alone, so the optimizer's partition
is the prefix ``[0, trainable_numel)`` tiled by the trainable sub-groups, and a
frozen sub-group's values are its parameters' shards (what a checkpoint saves
as its master: param_store.py ``MasterFromParameters``). Before, each frozen
parameter cost 16 bytes of master, states and gradient, and with the optimizer
on NVMe every step read and wrote its 12 (a 21M GPT with 2% of it in LoRA
adapters: 245 MiB each way a step, of which the adapters' state was 4.5).
Which units are frozen is fixed at ``zero.initialize``, as DeepSpeed's
optimizer groups are; a checkpoint records them to rebuild the layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import AbstractSet, FrozenSet, List, Sequence, Tuple


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside its unit's flat buffer."""

    names: Tuple[str, ...]  # every name the model knows it by; names[0] is the canonical one
    shape: Tuple[int, ...]
    numel: int
    offset: int  # first element in the unit's flat buffer

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of a parameter that falls in one rank's shard."""

    slot: int  # index of the parameter in its unit
    param_start: int  # first element, in the parameter's flattened coordinates
    param_stop: int
    shard_offset: int  # where it starts inside the shard

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


@dataclass(frozen=True)
class UnitLayout:
    """The flat layout of one unit and how it is split across ``world_size`` ranks."""

    index: int
    module_name: str
    slots: Tuple[ParamSlot, ...]
    world_size: int

    @functools.cached_property  # asked on every fetch and read-ahead: computed once
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @functools.cached_property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_start(self, rank: int) -> int:
        """First element of rank ``rank``'s shard, in unit coordinates."""
        return rank * self.shard_numel

    def pieces(self, rank: int) -> List[Piece]:
        """The parameters (or parts of them) inside rank ``rank``'s shard, in order."""
        lo, hi = self.shard_start(rank), self.shard_start(rank) + self.shard_numel
        out = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.stop)
            if a < b:
                out.append(Piece(i, a - s.offset, b - s.offset, a - lo))
        return out


def build_unit_layout(index: int, module_name: str, params: Sequence[Tuple[Tuple[str, ...], tuple]],
                      world_size: int) -> UnitLayout:
    """A unit of ``params``: ``(names, shape)`` pairs in order."""
    slots, offset = [], 0
    for names, shape in params:
        numel = 1
        for d in shape:
            numel *= int(d)
        slots.append(ParamSlot(tuple(names), tuple(int(d) for d in shape), numel, offset))
        offset += numel
    return UnitLayout(index, module_name, tuple(slots), world_size)


@dataclass(frozen=True)
class SubGroup:
    """A step tile of the rank space: whole unit shards ``units``, elements ``[start, stop)``."""

    index: int
    start: int
    stop: int
    units: Tuple[int, ...]
    frozen: bool = False  # its units are frozen: no master, states or gradient (see the [Note])

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RankLayout:
    """Rank ``rank``'s shards of every unit, end to end, tiled into sub-groups."""

    rank: int
    units: Tuple[UnitLayout, ...]
    offsets: Tuple[int, ...]  # rank-space offset of each unit's shard
    sub_groups: Tuple[SubGroup, ...]
    frozen: FrozenSet[int] = frozenset()  # the frozen units, after the others (see the [Note])

    @property
    def numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    @functools.cached_property
    def trainable_numel(self) -> int:
        """Elements of the optimizer's partition: the trainable units' shards, first in the rank space."""
        return sum(u.shard_numel for u in self.units if u.index not in self.frozen)

    @functools.cached_property
    def trainable_sub_groups(self) -> Tuple[SubGroup, ...]:
        """The sub-groups the optimizer holds and steps (indices ``0 .. len - 1``)."""
        return tuple(sg for sg in self.sub_groups if not sg.frozen)

    def trainable_units(self) -> List[UnitLayout]:
        return [u for u in self.units if u.index not in self.frozen]

    @functools.cached_property
    def largest_trainable_shard(self) -> int:
        """Elements of the largest trainable unit's shard: the most gradient one unit sends."""
        return max((u.shard_numel for u in self.trainable_units()), default=0)

    def unit_range(self, unit_index: int) -> Tuple[int, int]:
        start = self.offsets[unit_index]
        return start, start + self.units[unit_index].shard_numel

    def sub_group_of(self, unit_index: int) -> SubGroup:
        for sg in self.sub_groups:
            if unit_index in sg.units:
                return sg
        raise KeyError(unit_index)

    def param_ranges(self) -> List[Tuple[int, int, int, int]]:
        """``(unit, slot, start, stop)`` rank-space ranges of every parameter piece of this rank."""
        out = []
        for u in self.units:
            base = self.offsets[u.index]
            for p in u.pieces(self.rank):
                out.append((u.index, p.slot, base + p.shard_offset, base + p.shard_offset + p.numel))
        return out


def build_rank_layout(units: Sequence[UnitLayout], rank: int, sub_group_size: int,
                      frozen: AbstractSet[int] = frozenset()) -> RankLayout:
    """Lay the shards of ``units`` end to end and tile them into sub-groups of whole shards.

    A sub-group takes whole shards while it stays within ``sub_group_size``
    elements; a shard larger than that forms a sub-group alone. The ``frozen``
    units' shards come after the others', in sub-groups of their own (see the
    [Note: the optimizer covers the trainable units only]).
    """
    frozen = frozenset(frozen)
    offsets = [0] * len(units)
    groups: List[SubGroup] = []
    pos = 0
    for is_frozen in (False, True):
        members: List[int] = []
        start = pos
        for u in units:
            if (u.index in frozen) != is_frozen:
                continue
            if members and pos - start + u.shard_numel > sub_group_size:
                groups.append(SubGroup(len(groups), start, pos, tuple(members), is_frozen))
                members, start = [], pos
            offsets[u.index] = pos
            members.append(u.index)
            pos += u.shard_numel
        if members:
            groups.append(SubGroup(len(groups), start, pos, tuple(members), is_frozen))
    return RankLayout(rank, tuple(units), tuple(offsets), tuple(groups), frozen)
