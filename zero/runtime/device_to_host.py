"""Gradients from the compute device into their host partition: one asynchronous copy per unit.

[Note: a unit's gradients cross in one copy]
With the optimizer's partition in host memory and the compute on a GPU, every gradient crosses
PCIe. A blocking copy per parameter stops the CPU from queueing kernels until the GPU has run
everything before it, once per parameter. Instead (:class:`GradCrossing`) each parameter's
gradient is made ready on the device as it arrives (a window's k summed there when that moves
fewer bytes: grad_reducer.py [Note: gradients cross to the host once]); when the unit's last
gradient is in, its payloads are packed into one device buffer and copied, on the outbound copy stream, to
host memory registered with CUDA, in their own dtype (a 16-bit gradient crosses in 2 bytes; a unit
above 64 MiB crosses in several copies of element ranges, which bounds the staging memory); the
host lands them (copies or adds them into the partition, widening on the fly) only when the
copy's event says it is done, at the latest when the partition is read (``flush``). Two copies
may be in flight; a third waits for the oldest to land. The host does the same fp32 operations
in the same order as before, so the sums are bit-identical.

[Note: small units cross together]
A copy costs the same few hundred microseconds of CPU whatever its size, and with two in flight
the third waits for the GPU to reach the first: per unit, the CPU stopped queueing kernels until
the GPU caught up. A LoRA model's adapters are 192 units of 32 KiB each (the 311M stand-in):
65 ms of its backward on an H200, the disk idle. So units under :data:`BATCH_BYTES` are packed
into one device buffer as they come (on the compute stream, in order, so a gradient buffer
reused later is packed first) and cross together when the next would not fit, when a larger
unit comes, or at ``flush``.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, NamedTuple, Optional, Tuple

import torch

from nvmeio.host_sum import sum_series

from ..stores.pinned_host import BATCH_BYTES, MAX_IN_FLIGHT, SLAB_BYTES, slab_bytes  # the sizes (see there)

_ALIGN = 64  # each payload starts on a cache line of the host slab (and any dtype's alignment)


class _Payload(NamedTuple):
    offset: int  # bytes into the slab
    numel: int
    dtype: torch.dtype


class _Landing(NamedTuple):
    dst: torch.Tensor  # the host slice
    payloads: List[_Payload]
    add: bool  # add every payload to dst, else the first replaces it


def fold_on_device(grads: List[torch.Tensor], add: bool) -> bool:
    """Whether summing on the device moves fewer bytes than sending each gradient: an fp32 sum
    crosses once, plus the host's partial sum coming over when ``add``."""
    return sum(g.element_size() for g in grads) > 4 * (1 + add)


def device_payloads(dst: torch.Tensor, grads: List[torch.Tensor], add: bool) -> Tuple[List[torch.Tensor], bool]:
    """What crosses for host slice ``dst`` from the device gradients ``grads`` (successive
    micro-batches' of one parameter, copied into ``dst`` or, with ``add``, added to it), and
    whether the host adds them all (else the first replaces ``dst``). Either the gradients as
    they are, or their fp32 sum made on the device in the same order (starting from ``dst``
    brought over when ``add``)."""
    if not fold_on_device(grads, add):
        return list(grads), add
    if add:
        acc = dst.to(grads[0].device, non_blocking=True)
    else:
        acc = grads[0].to(torch.float32, copy=True)
        grads = grads[1:]
    for g in grads:
        acc.add_(g)
    return [acc], False


def land(dst: torch.Tensor, parts: List[torch.Tensor], add: bool) -> None:
    """The host's half: ``parts`` (host tensors) copied into ``dst`` or added to it, in order."""
    if add:
        sum_series(dst, parts)
    else:
        sum_series(dst, parts[1:], first=parts[0])


class _Batch:
    """Units' payloads packed into ``staging`` (compute-device memory) until they cross together
    (see [Note: small units cross together])."""

    def __init__(self, staging: torch.Tensor):
        self.staging = staging
        self.used = 0
        self.landings: List[_Landing] = []

    def room(self) -> int:
        return self.staging.numel() - self.used

    def add(self, flats: List[Tuple[int, torch.Tensor]], landings: List[_Landing], total: int) -> None:
        base = self.used
        for offset, flat in flats:
            self.staging[base + offset:base + offset + flat.numel()].copy_(flat)
        for dst, payloads, add in landings:
            self.landings.append(_Landing(dst, [p._replace(offset=base + p.offset) for p in payloads], add))
        self.used += total


class GradCrossing:
    """Device gradients of each unit into host slices, one copy per unit, small units' together
    (see the notes).
    ``pinned``: registered host memory for the slabs (nvmeio.RegisteredHost), else plain."""

    def __init__(self, device: torch.device, pinned=None, slab_bytes: int = 0):
        self.device = device
        self._pinned = pinned
        self.slab_bytes = slab_bytes  # the planned size of each slab (stores/pinned_host.py crossing_slab_bytes)
        self._pending: Dict[int, List[Tuple[torch.Tensor, List[torch.Tensor], bool]]] = {}
        self._in_flight: Deque[Tuple[Optional["torch.cuda.Event"], torch.Tensor, List[_Landing]]] = deque()
        self._free: List[torch.Tensor] = []  # host slabs not in flight
        self._batch: Optional[_Batch] = None  # units packed, not crossing yet
        self.copies = 0  # copies started (tests)

    def applies(self, grad: torch.Tensor, dst: torch.Tensor) -> bool:
        """Whether ``grad`` crosses to reach ``dst``."""
        return grad.device != dst.device

    def put(self, unit_index: int, dst: torch.Tensor, grads: List[torch.Tensor], add: bool) -> None:
        """One parameter's gradients (device) for host slice ``dst``: they cross with the unit's."""
        payloads, add_on_host = device_payloads(dst, grads, add)
        self._pending.setdefault(unit_index, []).append((dst, payloads, add_on_host))

    def send(self, unit_index: int) -> None:
        """The unit's gradients are all in: pack them for a copy (several for a unit above
        :data:`SLAB_BYTES`, each a range of elements of its parameters, so the staging memory
        stays bounded whatever the largest parameter); a small unit's copy waits for others
        (see [Note: small units cross together])."""
        entries = self._pending.pop(unit_index, None)
        if not entries:
            return
        for flats, landings, total in self._pieces(entries):
            if self._batch is not None and (total > self._batch.room() or total >= BATCH_BYTES):
                self._send_batch()
            if self._batch is None:
                staging = torch.empty(max(total, min(BATCH_BYTES, SLAB_BYTES)), dtype=torch.uint8, device=self.device)
                self._batch = _Batch(staging)
            self._batch.add(flats, landings, total)
            if total >= BATCH_BYTES:
                self._send_batch()

    @staticmethod
    def _pieces(entries):
        """``(flats, landings, total)`` of each copy the entries need: ``flats`` the payloads'
        element ranges at their byte offsets, at most :data:`SLAB_BYTES` in all."""
        flats, landings, total = [], [], 0
        for dst, payloads, add in entries:
            per_element = sum(p.element_size() for p in payloads)
            start, n = 0, dst.numel()
            while start < n:
                room = (SLAB_BYTES - total) // per_element - _ALIGN * len(payloads)
                if room <= 0:
                    yield flats, landings, total
                    flats, landings, total = [], [], 0
                    continue
                stop = min(n, start + room)
                metas = []
                for p in payloads:
                    flat = p.reshape(-1)[start:stop]
                    metas.append(_Payload(total, flat.numel(), flat.dtype))
                    flats.append((total, flat.view(torch.uint8)))
                    total += -(-flat.numel() * flat.element_size() // _ALIGN) * _ALIGN
                landings.append(_Landing(dst[start:stop], metas, add))
                start = stop
        if flats:
            yield flats, landings, total

    def _send_batch(self) -> None:
        """The open batch crosses: one copy into a host slab, on CUDA on the outbound copy stream
        (its event is recorded)."""
        batch, self._batch = self._batch, None
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._land_oldest()
        event, slab = None, self._slab(batch.used)
        if self.device.type != "cuda":
            slab[:batch.used].copy_(batch.staging[:batch.used])  # (the arithmetic's tests, on the CPU)
        else:
            from .host_to_device import copy_stream

            stream = copy_stream(self.device, to_host=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                slab[:batch.used].copy_(batch.staging[:batch.used], non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the host waits for it asleep: I/O threads need the cores
                event.record(stream)
            batch.staging.record_stream(stream)  # not reused before the copy stream is done with it
        self.copies += 1
        self._in_flight.append((event, slab, batch.landings))

    def _slab(self, nbytes: int) -> torch.Tensor:
        """The smallest free slab of at least ``nbytes``; else a new one of the planned size (or the
        copy's, if larger), after giving back a free one that is too small where keeping it would
        make more slabs than can be in use at once (:data:`MAX_IN_FLIGHT`: one may be in flight when
        another is taken). Planned for the rank's largest trained shard, no slab grows: the
        crossing's host memory is MAX_IN_FLIGHT planned slabs (stores/rank_memory.py counts them),
        made and registered once, at the first backward's first copies."""
        fits = [i for i, slab in enumerate(self._free) if slab.numel() >= nbytes]
        if fits:  # the smallest that fits, keeping larger ones for larger copies
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if self._free and len(self._free) + len(self._in_flight) >= MAX_IN_FLIGHT:
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].numel())
            old = self._free.pop(smallest)  # landed: its copy's event was waited for
            if self._pinned is not None:
                self._pinned.release(old)
            del old  # its memory goes before the larger slab's is mapped (torch's pinned allocator keeps it cached)
        nbytes = max(self.slab_bytes, slab_bytes(nbytes, SLAB_BYTES))
        if self._pinned is not None:
            return self._pinned.empty(nbytes, staging=True)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _land_oldest(self) -> None:
        event, slab, landings = self._in_flight.popleft()
        if event is not None:
            event.synchronize()  # this copy alone
        for dst, payloads, add in landings:
            land(dst, [slab[p.offset:p.offset + p.numel * p.dtype.itemsize].view(p.dtype) for p in payloads], add)
        self._free.append(slab)

    def flush(self) -> None:
        """Every unit sent lands (before anything reads the partition)."""
        if self._batch is not None:
            self._send_batch()
        while self._in_flight:
            self._land_oldest()

    def abandon(self) -> None:
        """A backward raised: nothing pending lands; copies in flight finish, their slabs return."""
        self._pending.clear()
        self._batch = None  # its device buffer goes back in the compute stream's order
        while self._in_flight:
            event, slab, _ = self._in_flight.popleft()
            if event is not None:
                event.synchronize()
            self._free.append(slab)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
