"""A step's new parameter values, from host memory into shards that live on the GPU.

[Note: a write-back goes through registered staging]
With the parameters on the GPU (``offload_param: none``) and the optimizer on the host (``cpu``)
or on NVMe, a step writes each unit's shard from host values: a slice of the fp32 master, in a
swap pool's buffer for an NVMe optimizer, and for a 16-bit compute dtype cast to it. A copy from
memory CUDA has not registered (the NVMe optimizer's pool; a cast's fresh tensor) is staged by
the driver: the call returns only once the driver has copied the bytes into its own small
staging buffers, which drain no faster than the copy stream, so for a unit of any size the CPU
waits for the copy, and for the GPU to reach it: with sub-groups stepped during backward
(engine/optimizer.py), that is the rest of the backward queued before it, per unit. And the cast
allocated a tensor per unit. Here (:class:`StagedWrites`) the values are copied, or cast, into a
ring of host memory registered with CUDA, :data:`RING_BYTES` at most, and sent from there as an
asynchronous copy on the current stream, where the kernels after it (the next forward) read the
shard in order and the kernels before it (the backward that read the old values) have run. A
region of the ring is reused only after the event of the copy that read it: the CPU waits only
when the copies not yet run hold the whole ring. A unit larger than half the ring goes in
pieces of that size, so one piece is filled while the one before it crosses. The ring is pinned
memory, made only where ``offload_optimizer.pin_memory`` allows it (engine/build.py); without it
the copies are the driver's, as asked.

Values already in registered memory and in the shard's dtype (the host optimizer's pinned fp32
master, the only such source) are copied directly, as before. Nothing changes them before that
copy has run: the next step starts with a device synchronize (engine/optimizer.py ``step``), a
write of the master from the device (``GatheredParameters``) is a blocking copy queued after it,
and a checkpoint load that overwrites the master writes every shard again after it, on the same
stream. A source that may change sooner must not be registered memory in the shard's dtype, or
must go through the ring.

Writes come from one thread at a time (the main one, or autograd's while the main one waits in
``backward``): the ring takes no lock.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Optional, Tuple

import torch

from ..stores.pinned_host import RING_BYTES  # its size (counted by the memory check)
_ALIGN = 64  # each region starts on a cache line (and any dtype's alignment)


def _copy_on_current_stream(dest: torch.Tensor, src: torch.Tensor):
    """``dest.copy_(src)`` queued on the current stream; the event after it."""
    dest.copy_(src, non_blocking=True)
    done = torch.cuda.Event(blocking=True)  # a wait for it yields the CPU
    done.record(torch.cuda.current_stream(dest.device))
    return done


class StagedWrites:
    """Host values into device tensors through a registered staging ring (see the note).

    ``host`` makes the ring (``host.empty(nbytes, staging=True)``) at the first write and unregisters it at
    :meth:`close` (nvmeio.RegisteredHost); ``copy(dest, src)`` queues the asynchronous copy and
    returns an event: ``query()`` whether it ran, ``synchronize()`` waits for it (a test injects
    stand-ins for both)."""

    def __init__(self, host, ring_bytes: int = RING_BYTES,
                 copy: Callable[[torch.Tensor, torch.Tensor], object] = _copy_on_current_stream):
        if ring_bytes < 2 * _ALIGN:
            raise ValueError(f"a staging ring of {ring_bytes} bytes; it needs at least {2 * _ALIGN}")
        self._host = host
        self._ring_bytes = ring_bytes
        self._copy = copy
        self._ring: Optional[torch.Tensor] = None
        self._head = 0  # where the next region starts
        self._in_flight: Deque[Tuple[int, int, object]] = deque()  # (start, stop, event), oldest first
        self.copies = 0  # copies queued
        self.waits = 0  # copies the CPU waited for before reusing their region

    @staticmethod
    def takes(values: torch.Tensor, shard: torch.Tensor) -> bool:
        """Whether writing ``values`` into ``shard`` goes through the ring: host values into a
        shard on the GPU, but for values already in registered memory and in the shard's dtype
        (see the note)."""
        if values.device.type != "cpu" or shard.device.type != "cuda":
            return False
        return values.dtype != shard.dtype or not values.is_pinned()

    def write(self, dest: torch.Tensor, values: torch.Tensor) -> None:
        """``dest`` (a contiguous device tensor) gets ``values`` (host, any dtype: cast here)."""
        dest, values = dest.view(-1), values.reshape(-1)
        if values.numel() != dest.numel():
            raise ValueError(f"a write-back of {values.numel()} values into a shard of {dest.numel()}")
        piece = max(1, (self._ring_bytes // 2) // dest.element_size())
        for start in range(0, dest.numel(), piece):
            stop = min(dest.numel(), start + piece)
            where, staged = self._region((stop - start) * dest.element_size())
            staged = staged.view(dest.dtype)
            staged.copy_(values[start:stop])  # the cast, if any, into registered memory
            self._in_flight.append(where + (self._copy(dest[start:stop], staged),))
            self.copies += 1

    def _region(self, nbytes: int) -> Tuple[Tuple[int, int], torch.Tensor]:
        """``(start, stop)`` and the bytes of a region of the ring that no copy in flight reads,
        for ``nbytes``; waits for the oldest copies while any of them holds a part of it (they
        run in order on one stream, so waiting for the oldest first waits for nothing extra)."""
        if self._ring is None:
            self._ring = self._host.empty(self._ring_bytes, staging=True)
        size = -(-nbytes // _ALIGN) * _ALIGN
        if self._head + size > self._ring_bytes:
            self._head = 0
        start, stop = self._head, self._head + size
        while self._in_flight and self._in_flight[0][2].query():  # done already: forget, never wait
            self._in_flight.popleft()
        while any(a < stop and start < b for a, b, _ in self._in_flight):
            self._in_flight.popleft()[2].synchronize()
            self.waits += 1
        self._head = stop
        return (start, stop), self._ring[start:start + nbytes]

    def synchronize(self) -> None:
        """Every copy queued has run (the ring is free)."""
        while self._in_flight:
            self._in_flight.popleft()[2].synchronize()

    def close(self) -> None:
        """The ring's registration ends (after the copies that read it)."""
        try:
            self.synchronize()
        finally:
            self._host.close()
