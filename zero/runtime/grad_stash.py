"""GradStash: each sub-group's gradient goes to NVMe as soon as backward completes it.

With ``offload_optimizer.device: nvme`` the rank's fp32 gradient partition is
never whole in host memory. A sub-group's gradient is gathered in a buffer of
``sub_group_size`` elements that opens when the first of its units receives a
gradient and closes when the last of its units is reduced: then the slices no
parameter wrote are zeroed (what ``GradReducer.zero_stale`` does for a
resident partition) and the buffer is written into the sub-group's gradient
swap file (``PartitionedOptimizerSwapper.swap_out_gradients``),
where the step reads it together with the master weights and Adam states.
Units complete in reverse order during backward, so only the sub-groups whose
units are half done are open at once. Closed buffers are kept for the next
sub-group to open (two at most): a fresh allocation of that size costs a page
fault per 4 KiB on first touch, which made the copy into it several times
slower than the copy itself.

[Note: the global norm is taken on the way out]
Clipping and fp16 overflow checks need the norm of the whole gradient before
any sub-group is updated. On the micro-batch that ends an accumulation window
the stash takes each parameter's norm from the completed buffer before it is
written (the same ``vector_norm`` of the same fp32 values that
``ZeroOptimizer._global_norm`` takes of a resident partition), so the step
combines those norms in the same order and results stay bit-identical to
plain PyTorch, without reading the gradients twice. On the other micro-batches
of a window the partial sum is read back when the sub-group opens again and
the next micro-batch is added to it, ``p.grad += g`` as torch does.

[Note: partial sums held in host memory]
Between the micro-batches of a window, and from the window's last backward to
its step, a completed sub-group's gradient is kept in host memory instead of
going to NVMe and back, while the bytes held stay within ``hold_budget`` (set
by the engine from the memory check: half of what MemAvailable leaves beside
the engine's planned host memory). Past the budget a sub-group goes to its
swap file as before. The values are the same either way (the file holds the
buffer's fp32 bytes), so results do not depend on the budget; only the
gradient I/O does (8 bytes per parameter per micro-batch saved).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..stores.layouts import RankLayout, SubGroup

Range = Tuple[int, int]


class NoStash:
    """The stash of a rank whose gradient partition is whole in memory: nothing to write, no
    error kept, no step run on completion (the reducer adds into the partition itself)."""

    on_nvme = False
    error: Optional[Exception] = None

    def begin(self, boundary: bool) -> None:
        pass

    def take_error(self) -> Optional[Exception]:
        return None

    def begin_steps(self, on_complete) -> None:
        raise AssertionError("sub-groups are stepped in backward only with their gradients on NVMe")

    def end_steps(self) -> None:
        pass

    def run(self, io: Callable[[], None]) -> None:
        io()

    def abandon(self) -> None:
        pass

    def clear(self, consumed: bool) -> None:
        pass


NO_STASH = NoStash()  # it keeps nothing, so one serves every reducer


class GradStash:
    """The open sub-group buffers of one rank and the norms of the last window's gradients.

    ``grad_units``: the units that receive gradients (whose completion closes a sub-group).
    ``hold_budget``: bytes of completed gradients that may stay in host memory (see the [Note]).
    ``norm_ranges``: per sub-group, the parameter pieces whose norms a step needs, taken when
    ``want_norms`` (clipping or fp16 overflow checks). ``defer_errors`` (several ranks): an error
    of this rank's gradient I/O or in-backward step is kept, not raised, so that the rank goes
    on reducing with the others (raised, it would leave them waiting in a collective); the
    engine takes it at the end of backward (:meth:`take_error`) and every rank raises.
    """

    on_nvme = True

    def __init__(self, rank_layout: RankLayout, swapper, grad_units: Set[int], *, hold_budget: int = 0,
                 norm_ranges: Optional[Dict[int, List[Range]]] = None, want_norms: bool = False,
                 defer_errors: bool = False):
        self.rank_layout = rank_layout
        self.swapper = swapper
        groups = rank_layout.trainable_sub_groups  # frozen units take no gradient
        self._sub_group = {u: sg for sg in groups for u in sg.units}
        self._needed = {sg.index: sum(1 for u in sg.units if u in grad_units) for sg in groups}
        self._open: Dict[int, torch.Tensor] = {}
        self._spare: List[torch.Tensor] = []  # closed buffers of the largest sub-group's size
        self._buffer_numel = max((sg.numel for sg in groups), default=0)
        self._done: Dict[int, int] = {}
        self._written: Set[int] = set()  # gradient on NVMe since the last step
        self._held: Dict[int, torch.Tensor] = {}  # completed gradients kept in memory (see the [Note])
        self.hold_budget = hold_budget
        self._norm_ranges = norm_ranges or {}
        self._want_norms = want_norms
        self._defer_errors = defer_errors
        self._boundary = True  # this backward ends an accumulation window (begin())
        self.norms: Dict[Range, torch.Tensor] = {}
        self.peak_open_numel = 0  # most gradient elements in open buffers at once (memory tests)
        # fn(sub_group, gradient): steps a completed sub-group instead of writing its gradient, in
        # the backward that ends a window (begin_steps(); engine/optimizer.py).
        self._on_complete: Optional[Callable[[SubGroup, torch.Tensor], None]] = None
        self.error: Optional[Exception] = None

    def begin(self, boundary: bool) -> None:
        """A backward starts; ``boundary``: it ends an accumulation window (norms are taken, a
        step may run as sub-groups complete)."""
        self._boundary = boundary

    def take_error(self) -> Optional[Exception]:
        """The error kept by :meth:`run` in this backward, if any; forgotten here."""
        error, self.error = self.error, None
        return error

    def begin_steps(self, on_complete: Callable[[SubGroup, torch.Tensor], None]) -> None:
        """This backward steps each sub-group as its gradient completes, through ``on_complete``."""
        self._on_complete = on_complete

    def end_steps(self) -> None:
        self._on_complete = None

    def sub_group(self, unit_index: int) -> SubGroup:
        return self._sub_group[unit_index]

    def unit_view(self, unit_index: int) -> torch.Tensor:
        """Where the gradient of ``unit_index``'s shard accumulates (opens its sub-group)."""
        sg = self._sub_group[unit_index]
        buf = self._open.get(sg.index)
        if buf is None:
            buf = self._held.pop(sg.index, None)  # the window's partial sum, to add this micro-batch to
            if buf is None:
                base = self._spare.pop() if self._spare else torch.empty(self._buffer_numel, dtype=torch.float32)
                buf = base[:sg.numel]
                if sg.index in self._written:  # the partial sum went to NVMe
                    self.run(lambda: self.swapper.swap_in_gradients(sg.index, buf))
            self._open[sg.index] = buf
            self.peak_open_numel = max(self.peak_open_numel, sum(b.numel() for b in self._open.values()))
        start, stop = self.rank_layout.unit_range(unit_index)
        return buf[start - sg.start:stop - sg.start]

    def unit_done(self, unit_index: int) -> Optional[SubGroup]:
        """Count a reduced unit; returns its sub-group when that was its last unit."""
        sg = self._sub_group[unit_index]
        self.unit_view(unit_index)  # a unit no parameter of which got a gradient still opens it
        done = self._done.get(sg.index, 0) + 1
        if done < self._needed[sg.index]:
            self._done[sg.index] = done
            return None
        self._done.pop(sg.index, None)
        return sg

    def write(self, sg: SubGroup) -> None:
        """The sub-group's gradient is complete (stale slices zeroed): take norms, then step it
        at once (``on_complete``, set by the optimizer on the window's last backward) or write it;
        close."""
        buf = self._open.pop(sg.index)
        if self._boundary and self._want_norms:
            for a, b in self._norm_ranges.get(sg.index, ()):
                self.norms[(a, b)] = torch.linalg.vector_norm(buf[a - sg.start:b - sg.start])
        if self._boundary and self._on_complete is not None:
            try:
                self.run(lambda: self._on_complete(sg, buf))
            finally:
                self._spare_buffer(buf)
            return
        if self._hold(sg, buf):
            return
        self.run(lambda: self.swapper.swap_out_gradients(sg.index, buf))  # copied: free at once
        self._written.add(sg.index)
        self._spare_buffer(buf)

    def _hold(self, sg: SubGroup, buf: torch.Tensor) -> bool:
        """Keep the completed gradient in memory when the budget allows (an older partial sum
        on NVMe is dropped: the buffer holds it plus this micro-batch)."""
        if self.error is not None or self.held_bytes + self._buffer_numel * 4 > self.hold_budget:
            return False
        if sg.index in self._written:
            self.run(lambda: self.swapper.drop_gradients(sg.index))
            self._written.discard(sg.index)
        self._held[sg.index] = buf
        return True

    @property
    def held_bytes(self) -> int:
        """Host memory of the gradients held (each in a buffer of the largest sub-group's size)."""
        return len(self._held) * self._buffer_numel * 4

    def run(self, io: Callable[[], None]) -> None:
        """Run one gradient swap or sub-group step; with ``defer_errors`` keep its error in
        :attr:`error` (and skip all later ones: the window is lost) instead of raising."""
        if self.error is not None:
            return
        try:
            io()
        except Exception as error:  # kept for the engine, raised at the end of backward
            if not self._defer_errors:
                raise
            self.error = error

    def _spare_buffer(self, buf: torch.Tensor) -> None:
        if len(self._spare) < 2:
            self._spare.append(buf._base if buf._base is not None else buf)

    def norm(self, a: int, b: int) -> torch.Tensor:
        found = self.norms.get((a, b))
        return found if found is not None else torch.zeros(())

    def clear(self, consumed: bool) -> None:
        """After a step (``consumed``) or a skipped one (the gradients on NVMe are dropped)."""
        if not consumed:
            for index in sorted(self._written):
                self.swapper.drop_gradients(index)
        self._written.clear()
        for buf in self._held.values():
            self._spare_buffer(buf)
        self._held.clear()
        self.norms.clear()

    def abandon(self) -> None:
        """A backward failed half way: drop every gradient of the window, open or written."""
        self.error = None
        self._open.clear()
        self._done.clear()
        self.clear(consumed=False)

    def step_grad(self, grad: Optional[torch.Tensor], sg: SubGroup) -> torch.Tensor:
        """The sub-group's gradient: held in memory, else as read with its state; zeros when
        no parameter of it got one."""
        held = self._held.get(sg.index)
        if held is not None:
            return held
        return grad if grad is not None else torch.zeros(sg.numel, dtype=torch.float32)

    @property
    def open_sub_groups(self) -> Sequence[int]:
        return tuple(self._open)
