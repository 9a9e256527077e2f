"""What one optimizer sub-group is: its states, its byte layout, its tensors in a buffer.

A sub-group's fp32 master partition and optimizer states are laid out back to
back after a header page, each region starting on a 4096-byte boundary, in its
swap file and in its pool buffer alike; its optional gradient has a file of
its own and follows the states in the buffer (see _optimizer_swapper.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ._async_swapper import SwapOutTicket, WriteState
from ._buffer_pool import PoolBuffer
from ._errors import SwapCorruptionError
from .host_memory import align_up

ADAM_STATES = ("exp_avg", "exp_avg_sq")

HEADER_BYTES = 4096
"""[Note: the header page]
The first 4096 bytes of a sub-group's swap file (and of its buffer) are never
written by swapping: a checkpoint writes a safetensors header there, which
describes the regions behind it, and takes the file into the checkpoint with a
hard link instead of copying its bytes (``link_state``); the swapper's next
swap-out of that sub-group goes to a new file, so the checkpoint's copy is
never changed. The same layout lets a checkpoint shard become a swap file by
a link on load (``adopt_file``)."""


class SubGroupState(enum.Enum):
    """Where a sub-group's optimizer state is, and what host memory it holds."""

    UNWRITTEN = "unwritten"
    """Registered, never initialized; holds nothing."""
    ON_NVME = "on_nvme"
    """Only in its swap file; holds no host memory."""
    READING = "reading"
    """Read in flight; holds one pool buffer, undefined until the read completes."""
    AVAILABLE = "available"
    """In its pool buffer, ready for the step; holds one pool buffer."""
    WRITING = "writing"
    """Write in flight; holds one pool buffer, which must not change until the write completes."""


@dataclass(frozen=True)
class SubGroupLayout:
    """Byte layout of one sub-group, identical in its swap file and in its pool buffer."""

    numel: int
    dtype: torch.dtype
    state_names: Tuple[str, ...]
    with_grad: bool

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def tensor_bytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def region_bytes(self) -> int:
        return align_up(self.tensor_bytes)

    def offset(self, index: int) -> int:
        """Byte offset of region ``index``: 0 master, 1.. states, then the gradient
        (after the header page, see [Note: the header page])."""
        return HEADER_BYTES + index * self.region_bytes

    def offsets(self) -> Dict[str, int]:
        """The byte offset of each tensor of the state file: ``"master"``, then each state."""
        return {"master": self.offset(0), **{n: self.offset(1 + i) for i, n in enumerate(self.state_names)}}

    @property
    def written_bytes(self) -> int:
        """The end of what a swap-out writes: master and states, padding included."""
        return HEADER_BYTES + (1 + len(self.state_names)) * self.region_bytes

    @property
    def grad_offset(self) -> int:
        """Where the gradient sits in the pool buffer (in its own file it starts at 0)."""
        return self.written_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes on disk (the state file, plus the gradient file) and in a pool buffer."""
        return self.written_bytes + (self.tensor_bytes if self.with_grad else 0)


@dataclass
class SubGroupTensors:
    """One sub-group in host memory: views of its pool buffer, valid until it is swapped out."""

    sub_group_id: int
    master: torch.Tensor
    states: Dict[str, torch.Tensor]
    grad: Optional[torch.Tensor] = None

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.states["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.states["exp_avg_sq"]


@dataclass(eq=False)
class GradientPieces:
    """The pieces of a sub-group's gradient written to its gradient file since a swap-out of its
    state last consumed them: element ranges, and the tickets of their writes."""

    ranges: List[Tuple[int, int]] = field(default_factory=list)
    tickets: List[SwapOutTicket] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def add(self, start: int, stop: int, tickets: List[SwapOutTicket]) -> None:
        self.ranges.append((start, stop))
        self.tickets.extend(tickets)

    def covered(self) -> int:
        return covered_elements(self.ranges)

    def in_flight(self) -> bool:
        return any(not t.done for t in self.tickets)

    def check_written(self, sub_group_id: int) -> None:
        """A gradient whose write failed is lost (its bytes on disk are undefined, and the source
        was freed when it was copied): never read it, until it is dropped."""
        for t in self.tickets:
            if t.state is WriteState.FAILED:
                raise SwapCorruptionError(
                    f"the gradient of sub-group {sub_group_id} was never written to {t.path} ({t.error}): "
                    f"it is lost; drop_gradients({sub_group_id}) before writing it again", t.path)

    def mark(self) -> Tuple[int, int]:
        """How many pieces there are now (for :meth:`consume`)."""
        return len(self.ranges), len(self.tickets)

    def consume(self, mark: Optional[Tuple[int, int]] = None) -> None:
        """Forget the pieces counted by ``mark`` (None: all of them)."""
        if mark is None:
            self.ranges.clear()
            self.tickets.clear()
        else:
            del self.ranges[:mark[0]]
            del self.tickets[:mark[1]]


@dataclass(eq=False)
class SubGroupEntry:
    """The swapper's record of one registered sub-group."""

    sub_group_id: int
    layout: SubGroupLayout
    file_name: str
    grad_file_name: str
    state: SubGroupState = SubGroupState.UNWRITTEN
    buffer: Optional[PoolBuffer] = None
    grad: GradientPieces = field(default_factory=GradientPieces)  # written since the last swap-out
    read_grad: bool = False  # the buffer holds a gradient read with the state
    linked: bool = False  # the swap file is also a checkpoint's: write a new file next time
    read_queue: Optional[object] = None  # the IoQueue of its read in flight (while READING)

    @property
    def nbytes(self) -> int:
        """The size of its swap files (state and gradient)."""
        return self.layout.file_bytes

    @property
    def file_names(self) -> Tuple[str, ...]:
        return (self.file_name, self.grad_file_name) if self.layout.with_grad else (self.file_name,)


def covered_elements(ranges: List[Tuple[int, int]]) -> int:
    """How many distinct elements the half-open ``(start, stop)`` ranges cover."""
    covered, end = 0, 0
    for start, stop in sorted(ranges):
        start = max(start, end)
        if stop > start:
            covered += stop - start
            end = stop
    return covered
