"""Gradients from the compute device into their host partition: one asynchronous copy per unit.

[Note: a unit's gradients cross in one copy]
With the optimizer's partition in host memory and the compute on a GPU, every gradient crosses
PCIe. A blocking copy per parameter stops the CPU from queueing kernels until the GPU has run
everything before it, once per parameter. Instead (:class:`GradCrossing`) each parameter's
gradient is made ready on the device as it arrives (a window's k summed there when that moves
fewer bytes: grad_reducer.py [Note: gradients cross to the host once]); when the unit's last
gradient is in, its payloads are packed into one device buffer and copied, on the copy stream, to
host memory registered with CUDA, in their own dtype (a 16-bit gradient crosses in 2 bytes; a unit
above 64 MiB crosses in several copies of element ranges, which bounds the staging memory); the
host lands them (copies or adds them into the partition, widening on the fly) only when the
copy's event says it is done, at the latest when the partition is read (``flush``). Two units
may be in flight; a third waits for the oldest to land. The host does the same fp32 operations
in the same order as before, so the sums are bit-identical.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, NamedTuple, Optional, Tuple

import torch

from nvmeio.host_sum import sum_series

_ALIGN = 64  # each payload starts on a cache line of the host slab (and any dtype's alignment)
MAX_IN_FLIGHT = 2
SLAB_BYTES = 64 << 20  # the most one copy stages: host memory of the crossing <= 3 slabs


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


class GradCrossing:
    """Device gradients of each unit into host slices, one copy per unit (see the note).
    ``pinned``: registered host memory for the slabs (nvmeio.RegisteredHost), else plain."""

    def __init__(self, device: torch.device, pinned=None):
        self.device = device
        self._pinned = pinned
        self._pending: Dict[int, List[Tuple[torch.Tensor, List[torch.Tensor], bool]]] = {}
        self._in_flight: Deque[Tuple[Optional["torch.cuda.Event"], torch.Tensor, List[_Landing]]] = deque()
        self._free: List[torch.Tensor] = []  # host slabs not in flight
        self.copies = 0  # copies started (tests)

    def applies(self, grad: torch.Tensor, dst: torch.Tensor) -> bool:
        """Whether ``grad`` crosses to reach ``dst``."""
        return grad.device != dst.device

    def put(self, unit_index: int, dst: torch.Tensor, grads: List[torch.Tensor], add: bool) -> None:
        """One parameter's gradients (device) for host slice ``dst``: they cross with the unit's."""
        payloads, add_on_host = device_payloads(dst, grads, add)
        self._pending.setdefault(unit_index, []).append((dst, payloads, add_on_host))

    def send(self, unit_index: int) -> None:
        """The unit's gradients are all in: start their copy (several for a unit above
        :data:`SLAB_BYTES`, each a range of elements of its parameters, so the staging memory
        stays bounded whatever the largest parameter)."""
        entries = self._pending.pop(unit_index, None)
        if not entries:
            return
        flats, landings, total = [], [], 0
        for dst, payloads, add in entries:
            per_element = sum(p.element_size() for p in payloads)
            start, n = 0, dst.numel()
            while start < n:
                room = (SLAB_BYTES - total) // per_element - _ALIGN * len(payloads)
                if room <= 0:
                    self._start_copy(flats, landings, total)
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
            self._start_copy(flats, landings, total)

    def _start_copy(self, flats: List[Tuple[int, torch.Tensor]], landings: List[_Landing], total: int) -> None:
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._land_oldest()
        slab = self._slab(total)
        event = self._copy(flats, total, slab)
        self.copies += 1
        self._in_flight.append((event, slab, landings))

    def _copy(self, flats: List[Tuple[int, torch.Tensor]], total: int, slab: torch.Tensor):
        """``flats`` packed at their offsets into ``slab``: on CUDA through one device buffer and one
        copy on the copy stream (returns its event); elsewhere at once."""
        if self.device.type != "cuda":
            for offset, flat in flats:
                slab[offset:offset + flat.numel()].copy_(flat)
            return None
        from .host_to_device import copy_stream

        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        for offset, flat in flats:
            packed[offset:offset + flat.numel()].copy_(flat)
        stream = copy_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            slab[:total].copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        packed.record_stream(stream)  # not reused before the copy stream is done with it
        return done

    def _slab(self, nbytes: int) -> torch.Tensor:
        for i, slab in enumerate(self._free):
            if slab.numel() >= nbytes:
                return self._free.pop(i)
        nbytes = min(SLAB_BYTES, -(-nbytes // (1 << 20)) << 20)  # whole MiB, so slabs are reused across units
        if self._pinned is not None:
            return self._pinned.empty(nbytes)
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
        while self._in_flight:
            self._land_oldest()

    def abandon(self) -> None:
        """A backward raised: nothing pending lands; copies in flight finish, their slabs return."""
        self._pending.clear()
        while self._in_flight:
            event, slab, _ = self._in_flight.popleft()
            if event is not None:
                event.synchronize()
            self._free.append(slab)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
