"""Which pool a swapper stages through: whole buffers, or spans packed into one allocation.

A swapper is given a pool kind, not a pool: the pool is made when the swapper
knows its buffers' size (at construction, or from the registered entries at
first use) and locks its memory through the swapper's own handle. Both kinds
make a :class:`~swapper.StagingPool`, so the swapper asks every
pool the same questions in bytes; the one thing it asks the kind is what a
request will take from the pool before the pool exists.

- :class:`WholeBuffers` (the default): ``buffer_count`` buffers of
  ``buffer_size`` elements; a request takes a whole buffer whatever its size
  (_buffer_pool.py).
- :class:`PackedSpans`: the same bytes as one region; a request takes a span of
  its own size in whole pages, so the memory bounds the bytes held, not the
  number of requests; the last ``spare_buffers`` buffers' worth is kept for
  requests that cannot wait (_span_pool.py, [Note: read-ahead bounded by bytes,
  not by buffers]).

[Note: a parameter pool on the GPU]
With ``aio.use_gds`` DeepSpeed's parameter swapper keeps its swap buffers in GPU memory,
registered with cuFile, so that a partition goes from the drive to the GPU by DMA, never
through host memory. ``PackedSpans(device=...)`` makes that pool: the spans are GPU memory,
the swapper's handles (gds_handle) read and write them as CUDA tensors, a fetched shard is
already on the compute device (the unit gathers it without a host-to-device copy, or views
it), and host values written to a partition (the optimizer's update) are copied in first.
Swap checksums are of host bytes (checksum.py), so a swapper on such a pool has none: the
engine turns ``checksum: auto`` off there and refuses a named algorithm. The engine makes
this pool only where cuFile moves CUDA tensors itself (``nvmeio.gds_device_path()``
"cufile") and the swap files are on one drive: without the GDS driver a gds_handle stages
CUDA tensors through host memory (nvmeio/_gds.py [Note: without GPUDirect, CUDA tensors take
nvmeio's staging]), with staging buffers per handle, no faster than a host pool and more
memory; a striped file takes host buffers (nvmeio/striping.py). A span goes back to the pool
while the compute stream may still be reading it (a unit's copy out of it, a lent unit's
kernels): the next I/O into it is ordered after that work by the handle, which fences on the
current stream at submission, so the engine's work must be on the stream that is current when
it swaps (it is: one compute stream). Host values copied in (the optimizer's update, a fill
from the master in memory) are blocking copies, which wait for the compute stream's queue.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch

from ._buffer_pool import PinnedBufferPool, StagingPool
from ._span_pool import SpanPool
from .host_memory import align_up


class PoolKind(abc.ABC):
    """How a swapper's pool is made and what a request takes from it."""

    spare_buffers: int  # buffers' worth kept for requests that cannot wait (0: none)

    @abc.abstractmethod
    def make(self, buffer_count: int, buffer_size: int, dtype: torch.dtype, *, pin_memory: bool,
             handle) -> StagingPool:
        """The pool of ``buffer_count`` buffers' worth of ``buffer_size`` elements of ``dtype``,
        locked through ``handle`` when ``pin_memory``."""

    @abc.abstractmethod
    def footprint(self, request_bytes: int, buffer_bytes: Optional[int]) -> int:
        """The pool memory a request of ``request_bytes`` (whole pages) takes, with buffers of
        ``buffer_bytes`` (None: not sized yet)."""


@dataclass(frozen=True)
class WholeBuffers(PoolKind):
    """A :class:`~swapper.PinnedBufferPool`: one whole buffer per request."""

    @property
    def spare_buffers(self) -> int:
        return 0  # a pool of whole buffers has no spare region

    def make(self, buffer_count, buffer_size, dtype, *, pin_memory, handle) -> PinnedBufferPool:
        return PinnedBufferPool(buffer_count, buffer_size, dtype, pin_memory=pin_memory, handle=handle)

    def footprint(self, request_bytes: int, buffer_bytes: Optional[int]) -> int:
        return align_up(request_bytes if buffer_bytes is None else buffer_bytes)


@dataclass(frozen=True)
class PackedSpans(PoolKind):
    """A :class:`~swapper.SpanPool` of the same bytes: a span of its own size per
    request; the last ``spare_buffers`` buffers' worth is its spare region; on ``device``
    where given (see the note)."""

    spare_buffers: int = 0
    device: Optional[torch.device] = None  # a CUDA device: the pool is its memory (see the note)

    def __post_init__(self):
        if isinstance(self.spare_buffers, bool) or not isinstance(self.spare_buffers, int) or self.spare_buffers < 0:
            raise ValueError(f"spare_buffers must be a non-negative integer, got {self.spare_buffers!r}")

    def make(self, buffer_count, buffer_size, dtype, *, pin_memory, handle) -> SpanPool:
        stride = align_up(buffer_size * dtype.itemsize)
        return SpanPool(buffer_count * stride, self.spare_buffers * stride, pin_memory=pin_memory, handle=handle,
                        device=self.device)

    def footprint(self, request_bytes: int, buffer_bytes: Optional[int]) -> int:
        return request_bytes
