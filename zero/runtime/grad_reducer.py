"""Gradients: from each parameter's ``.grad`` into this rank's fp32 gradient partition.

On one rank a parameter's gradient goes straight into its slice of the fp32
partition as soon as autograd has accumulated it: copied the first time after
an optimizer step, added afterwards (gradient accumulation), exactly the
``p.grad += g`` torch does, so the result is bit-identical to plain PyTorch.
When the gradient is already fp32 and where the partition lives (fp32 compute,
optimizer on the compute device, or both on the host), the tensor autograd
produced is kept instead of copied (``hold``): :meth:`GradReducer.grad` hands
it to the optimizer, as ``p.grad`` would be in plain PyTorch, and the step
releases it. That saves one pass over all gradients per micro-batch.
On several ranks the unit's gradients are first laid into one flat buffer
(compute dtype, on the device); when the unit's last gradient arrives the
buffer is reduce-scattered (summed over ranks in ``communication_data_type``)
and this rank's slice, divided by the world size, is copied or added into the
partition (``gradient_predivide_factor`` f divides by f before the sum and by
world_size / f after, which keeps fp16 sums in range). The partition lives where the optimizer states live (device for
``offload_optimizer: none``, host memory for ``cpu``); for ``nvme`` there is no
whole partition: each sub-group's gradient goes to its swap file as soon as
backward completes it (grad_stash.py).

[Note: reductions in flight (overlap_comm)]
With ``overlap_comm`` (DeepSpeed's default) a unit's reduce-scatter is started
and backward goes on to the next units while it runs; its result is added into
the partition when it is needed: before the elements in flight would pass
``reduce_bucket_size``, before a sub-group's gradient goes to NVMe, and at the
end of backward (:meth:`GradReducer.flush`); and, so that finished ones hold no
memory, when the next starts, those done already but the newest. Results are
added in the order the reductions started, so the sums are the same as without
overlap.

[Note: gradients cross to the host once]
Computing on CUDA with the partition in host memory, a window's k gradients of a parameter are
summed on the device (fp32, in micro-batch order) and cross once; a partial sum already on the
host comes back to the device for the adds. These are the fp32 additions, in the order, that the
host would make, so the result is bit-identical, and the PCIe bytes do not grow with k (they
were k copies, each waited for). A unit's gradients then cross together, in one asynchronous
copy (device_to_host.py [Note: a unit's gradients cross in one copy]).

[Note: every rank reduces the same units in the same order]
Collectives must match across ranks. A unit is reduced when the last of its
gradients arrives, which happens in the same order on every rank as long as
they run the same graph; units whose gradients did not all arrive (unused
parameters) are reduced at the end of backward, in unit order. So data-
dependent control flow that leaves a parameter unused on some ranks only is
not supported (DDP has the same rule without ``find_unused_parameters``).
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Set, Tuple, Union

import torch

from nvmeio.host_sum import sum_series

from .comm import Comm
from ..stores.pinned_host import crossing_slab_bytes
from .device_to_host import GradCrossing
from .grad_stash import NO_STASH, GradStash, NoStash
from ..stores.layouts import RankLayout
from .unit import ParamUnit


def _sum_in_torch(dst: torch.Tensor, grads: List[torch.Tensor], first: Optional[torch.Tensor] = None) -> None:
    if first is not None:
        dst.copy_(first)
    for g in grads:
        dst.add_(g)


class GradReducer:
    """Accumulates gradients into ``grads``, the flat fp32 partition of the rank, or, when
    ``grads`` is None, into the sub-group buffers of ``stash`` (a :class:`GradStash`; with the
    partition in memory a :class:`NoStash`)."""

    def __init__(self, rank_layout: RankLayout, grads: Optional[torch.Tensor], comm: Comm, device: torch.device,
                 dtype: torch.dtype, comm_dtype: torch.dtype, hold: bool = True, predivide: float = 1.0,
                 stash: Union[GradStash, NoStash] = NO_STASH, overlap: bool = False,
                 bucket_numel: int = 500_000_000, pinned=None):
        self.rank_layout = rank_layout
        self.stash = stash
        if (grads is None) != self.stash.on_nvme:
            raise ValueError("a GradReducer takes the partition in memory (grads) or a GradStash, one of them")
        self.hold = hold and comm.world_size == 1 and not self.stash.on_nvme
        self._held: Dict[int, torch.Tensor] = {}  # rank-space start of a parameter -> its gradient
        self.grads = grads
        self.comm = comm
        self.device = device
        self.dtype = dtype
        self.comm_dtype = comm_dtype
        self.predivide = float(predivide)  # gradient_predivide_factor: divide before the sum, the rest after
        n_units = len(rank_layout.units)
        # Which slices hold a gradient accumulated since the last step, and which are known zero.
        if comm.world_size == 1:
            self._fresh = [[False] * len(u.slots) for u in rank_layout.units]
            self._zero = [[False] * len(u.slots) for u in rank_layout.units]
        else:
            self._fresh = [[False] for _ in range(n_units)]
            self._zero = [[False] for _ in range(n_units)]
        self._buffers: Dict[int, Tuple[torch.Tensor, Set[int]]] = {}  # unit -> its flat buffer, slots written
        self.overlap = overlap and comm.distributed  # see [Note: reductions in flight (overlap_comm)]
        self.bucket_numel = bucket_numel
        self._in_flight: Deque[Tuple[object, torch.Tensor, torch.Tensor, int]] = deque()  # work, shard, buf, unit
        self._in_flight_numel = 0
        self.peak_in_flight_numel = 0  # most elements in flight at once (tests)
        # device gradients into a host partition, through host slabs planned for the largest trained shard
        self.crossing = GradCrossing(device, pinned, crossing_slab_bytes(rank_layout.largest_trainable_shard))

    # -- during backward -----------------------------------------------------------------------
    def _target(self, unit_index: int) -> torch.Tensor:
        """Where the gradient of one unit's shard accumulates."""
        if self.stash.on_nvme:
            return self.stash.unit_view(unit_index)
        start, stop = self.rank_layout.unit_range(unit_index)
        return self.grads[start:stop]

    def add(self, unit: ParamUnit, slot_index: int, grad: torch.Tensor) -> None:
        """Take the accumulated gradient of one parameter of ``unit``."""
        if self.comm.world_size == 1:
            self.add_series(unit, slot_index, [grad])
            return
        layout = unit.layout
        slot = layout.slots[slot_index]
        entry = self._buffers.get(layout.index)
        if entry is None:  # not zeroed: what no gradient writes is zeroed before the reduction
            entry = self._buffers[layout.index] = (torch.empty(layout.padded_numel, dtype=self.comm_dtype,
                                                               device=self.device), set())
        buf, written = entry
        buf[slot.offset:slot.stop].copy_(grad.reshape(-1))
        written.add(slot_index)

    def add_series(self, unit: ParamUnit, slot_index: int, grads: List[torch.Tensor]) -> None:
        """One rank: the gradients of one parameter of ``unit`` from successive micro-batches, in
        their order, summed as ``add`` one by one would. A window's k at once are summed natively
        (nvmeio/host_sum.py: torch's adds are slow on its threads); one micro-batch's, on the
        thread that ran the loop's backward, by torch (its gradient is still in cache there, and the
        native sum's threads would compete with that thread's spinning OpenMP team)."""
        layout = unit.layout
        slot = layout.slots[slot_index]
        start = self.rank_layout.offsets[layout.index] + slot.offset
        flats = [g.reshape(-1) for g in grads]
        combine = sum_series if len(flats) > 1 else _sum_in_torch
        fresh = self._fresh[layout.index]
        held = self._held.get(start)
        if (held is None and self.hold and not fresh[slot_index] and flats[0].dtype == torch.float32
                and flats[0].device == self.grads.device):
            held = self._held[start] = flats.pop(0)
            fresh[slot_index] = True
            self._zero[layout.index][slot_index] = False
        if held is not None:
            combine(held, flats)
            return
        dst = self._target(layout.index)[slot.offset:slot.stop]
        was_fresh = fresh[slot_index]
        fresh[slot_index] = True
        self._zero[layout.index][slot_index] = False
        if self.crossing.applies(flats[0], dst):
            self.crossing.put(layout.index, dst, flats, add=was_fresh)
            return
        first = None if was_fresh else flats.pop(0)
        combine(dst, flats, first)

    def reduce(self, unit: ParamUnit) -> None:
        """One micro-batch's gradients of ``unit`` are in: reduce-scatter them (several ranks)."""
        if self.comm.world_size > 1:
            self._reduce_scatter(unit)

    def finish(self, unit: ParamUnit) -> None:
        """All gradients of ``unit`` for this backward are in: reduce-scatter them (several ranks);
        with a stash, write its sub-group out when this was the sub-group's last unit."""
        self.crossing.send(unit.layout.index)
        self.reduce(unit)
        if self.stash.on_nvme:
            sg = self.stash.unit_done(unit.layout.index)
            if sg is not None:
                self.flush()  # the sub-group's reductions land before it is written
                for u in sg.units:
                    target = self.stash.unit_view(u)
                    for a, b in self._stale(u):
                        target[a:b].zero_()
                self.stash.write(sg)

    def _reduce_scatter(self, unit: ParamUnit) -> None:
        layout = unit.layout
        entry = self._buffers.pop(layout.index, None)
        if entry is None:
            buf = torch.zeros(layout.padded_numel, dtype=self.comm_dtype, device=self.device)
        else:
            buf, written = entry
            for i, slot in enumerate(layout.slots):
                if i not in written:  # frozen, or unused by this backward
                    buf[slot.offset:slot.stop].zero_()
            buf[layout.numel:].zero_()  # the padding
        shard = torch.empty(layout.shard_numel, dtype=self.comm_dtype, device=self.device)
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        if not self.overlap:
            self.comm.reduce_scatter(shard, buf)
            self._land(shard, layout.index)
            return
        while len(self._in_flight) > 1 and self._in_flight[0][0].is_completed():
            self._land_oldest()  # done already: its buffers go now (one always stays in flight)
        while self._in_flight and self._in_flight_numel + buf.numel() > self.bucket_numel:
            self._land_oldest()
        work = self.comm.reduce_scatter(shard, buf, async_op=True)
        self._in_flight.append((work, shard, buf, layout.index))  # buf stays alive until it lands
        self._in_flight_numel += buf.numel()
        self.peak_in_flight_numel = max(self.peak_in_flight_numel, self._in_flight_numel)

    def _land(self, shard: torch.Tensor, unit_index: int) -> None:
        """A reduced shard (the ranks' sum) into the partition, divided by the world size."""
        shard = shard.float() if shard.dtype != torch.float32 else shard
        divisor = self.comm.world_size / self.predivide
        dst = self._target(unit_index)
        if self.crossing.applies(shard, dst):  # to a host partition: with the unit's copy
            self.crossing.put(unit_index, dst, [shard.div_(divisor)], add=self._fresh[unit_index][0])
            self._fresh[unit_index][0] = True
            self._zero[unit_index][0] = False
            self.crossing.send(unit_index)
            return
        if not self._fresh[unit_index][0] and dst.device == shard.device:  # the first: divided into place
            torch.div(shard, divisor, out=dst)
            self._fresh[unit_index][0] = True
            self._zero[unit_index][0] = False
            return
        shard.div_(divisor)
        self._accumulate(dst, shard, unit_index, 0)

    def _land_oldest(self) -> None:
        work, shard, buf, unit_index = self._in_flight.popleft()
        self._in_flight_numel -= buf.numel()
        work.wait()
        self._land(shard, unit_index)

    def flush(self) -> None:
        """Every reduction in flight lands in the partition (the end of backward, before a
        sub-group is written, before anything reads the gradients)."""
        while self._in_flight:
            self._land_oldest()
        self.crossing.flush()

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor, unit_index: int, slot_index: int) -> None:
        if not self._fresh[unit_index][slot_index]:
            dst.copy_(src)
            self._fresh[unit_index][slot_index] = True
            self._zero[unit_index][slot_index] = False
        else:
            dst.add_(src)

    # -- at the step ---------------------------------------------------------------------------
    def _stale(self, unit_index: int) -> List[Tuple[int, int]]:
        """Shard-relative ranges of ``unit_index`` that got no gradient since the last step."""
        u = self.rank_layout.units[unit_index]
        fresh = self._fresh[unit_index]
        if self.comm.world_size > 1:
            return [] if fresh[0] else [(0, u.shard_numel)]
        return [(s.offset, s.stop) for s, f in zip(u.slots, fresh) if not f]

    def norm(self, start: int, stop: int) -> torch.Tensor:
        """The norm of one parameter piece's gradient (taken on the way to NVMe with a stash)."""
        if self.stash.on_nvme:
            return self.stash.norm(start, stop)
        return torch.linalg.vector_norm(self.grad(start, stop))

    def grad(self, start: int, stop: int) -> torch.Tensor:
        """The gradient of rank-space elements ``[start, stop)``: one parameter piece."""
        held = self._held.get(start)
        if held is not None and held.numel() == stop - start:
            return held
        return self.grads[start:stop]

    def zero_stale(self) -> None:
        """Zero the slices that got no gradient since the last step (unused or frozen parameters);
        a stash zeroes them as each sub-group is written."""
        if self.stash.on_nvme:
            return
        for u in self.rank_layout.trainable_units():  # the partition covers these only
            base = self.rank_layout.offsets[u.index]
            fresh, zero = self._fresh[u.index], self._zero[u.index]
            for i in range(len(fresh)):
                if fresh[i] or zero[i]:
                    continue
                if self.comm.world_size == 1:
                    slot = u.slots[i]
                    self.grads[base + slot.offset:base + slot.stop].zero_()
                else:
                    self.grads[base:base + u.shard_numel].zero_()
                zero[i] = True

    def abandon(self) -> None:
        """A backward raised half way: drop the window's gradients (partial sums included)."""
        self._buffers.clear()
        while self._in_flight:  # every rank started them: let them finish, then forget them
            work = self._in_flight.popleft()[0]
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the backward's own error is the one raised
                pass
        self._in_flight_numel = 0
        self.crossing.abandon()
        self.stash.abandon()
        self.clear(consumed=False)

    def clear(self, consumed: bool = True) -> None:
        """The step consumed the gradients (or skipped them): the next ones are copied, not added."""
        self.stash.clear(consumed)
        self._held.clear()
        for flags in self._fresh:
            for i in range(len(flags)):
                flags[i] = False
