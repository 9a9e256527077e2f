"""Hooks that gather a module's parameters just before use and release them after.

Forward: a pre-hook gathers the units of the module (its own parameters and
any it shares), a post-hook releases them unless they are persistent, and
registers a hook on the module's outputs that fires when their gradients are
computed, i.e. just before the module's backward, to gather the units again.
Backward: each parameter's post-accumulate-grad hook hands its gradient to
the :class:`~zero.runtime.grad_reducer.GradReducer`; once a unit has all its gradients it is
reduced and released. A callback queued on the autograd engine finishes the
units whose gradients did not all arrive and releases everything at the end
of backward.

[Note: parameters used outside their module]
A module may read a parameter it does not own (``F.linear(x,
self.wte.weight)`` in a parent, ``nn.MultiheadAttention`` reading
``out_proj.weight``). Each module's ``_parameters`` dict is replaced by a
subclass whose ``__getitem__`` (what ``module.weight`` calls) gathers an
unavailable parameter's unit while a forward is running, holds it until the
forward of the module on top of the stack ends, and remembers the pairing so
that module's backward gathers the unit too.

[Note: prefetch by recorded trace]
The order units are fetched in during one iteration (forward and backward) is
recorded; in the next iteration each fetch that matches the recorded order
starts the NVMe reads of the next units (up to ``stage3_prefetch_bucket_size``
elements and the free pool buffers). When the order differs, prefetching stops
for the rest of that iteration and the new order is recorded: no warnings, no
stale trace.

[Note: inference reads ahead across forwards, into the buffers it computes on]
With no optimizer (a ZeRO-Inference engine) nothing changes the shards
between forwards, and ``generate`` runs the same forward once per token. So the
trace is read ahead cyclically: near the end of a forward the first units of
the next one are prefetched (kept, not dropped, when it begins), and a
non-persistent unit fetched from NVMe lends the pool buffer it was read into
to its parameters (no copy) until it is released, when the store can spare
the buffer (see ``NvmeParamStore.lend``). A training engine neither lends nor
wraps: its step rewrites shards after backward.

[Note: live parameters and reuse distance]
``stage3_max_live_parameters`` bounds the elements of non-persistent units that
are gathered or being prefetched at once: prefetching stops at the bound, and
a unit is kept gathered after use (instead of released) only within it. Only
the units the running modules need right now can push past it. A unit is kept
when the trace says it is fetched again within ``stage3_max_reuse_distance``
elements of other fetches (a block used at the end of forward and again at the
start of backward), which saves reading it from NVMe twice. ``live_numel`` and
``peak_live_numel`` make the bound observable.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from . import linear
from .grad_reducer import GradReducer
from .timers import Timers, logger
from .param_state import ParamState
from ..stores.param_store import ParamStore
from .unit import ParamUnit


def output_tensors(value) -> List[torch.Tensor]:
    """Tensors requiring grad inside a module's output (tuples, lists, dicts, nested)."""
    found: List[torch.Tensor] = []

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(value)
    return found


class _ZeroParams(dict):
    """``module._parameters`` that gathers a parameter read during a forward (see the note)."""

    coordinator: "Coordinator" = None

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        c = self.coordinator
        if c is not None and c.stack and p is not None:
            c.on_param_access(p)
        return p

    def __deepcopy__(self, memo):
        return {k: copy.deepcopy(v, memo) for k, v in dict.items(self)}

    def __reduce__(self):
        return (dict, (dict(self),))


@dataclass
class _Frame:
    module: nn.Module
    units: List[ParamUnit] = field(default_factory=list)


class Coordinator:
    """Installs and runs the hooks for one engine's module."""

    def __init__(self, root: nn.Module, units: List[ParamUnit], module_units: Dict[nn.Module, List[int]],
                 reducer: Optional[GradReducer], store: ParamStore, prefetch_numel: int, timers: Timers,
                 memory_efficient_linear: bool = True, max_live_numel: int = 10**9,
                 max_reuse_distance: int = 10**9):
        self.root = root
        self.units = units
        self.module_units = {m: [units[i] for i in idx] for m, idx in module_units.items()}
        self.reducer = reducer
        self.store = store
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.live_numel = 0  # elements of non-persistent units gathered or being prefetched
        self.peak_live_numel = 0
        self.timers = timers
        self.stack: List[_Frame] = []
        self.externals: Dict[nn.Module, Set[ParamUnit]] = {}
        self.slot_of: Dict[nn.Parameter, tuple] = {}
        for u in units:
            for i, p in enumerate(u.params):
                self.slot_of[p] = (u, i)
        self.memory_efficient_linear = memory_efficient_linear
        self._linears: List[nn.Module] = []
        self._handles = []
        self._callback_queued = False
        self._trace: Optional[List[int]] = None
        self._recording: List[int] = []
        self._trace_ok = False
        self._next_use: List[int] = []  # per trace position: where the same unit is fetched next
        self._trace_numel: List[int] = []  # prefix sums of the fetched units' elements
        self._last_fetch: Dict[int, int] = {}  # unit -> its latest position in this iteration
        self._kept: Dict[ParamUnit, None] = {}  # gathered after use for a near reuse, oldest first
        self.inference = reducer is None  # see [Note: inference reads ahead across forwards]
        self._ahead: Set[int] = set()  # units prefetched for the next forward (inference)

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        modules = list(self.module_units)
        if self.root not in self.module_units:
            modules.insert(0, self.root)
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))
        for m in self.root.modules():
            if not isinstance(m._parameters, _ZeroParams):
                params = _ZeroParams(m._parameters)
                params.coordinator = self
                m.__dict__["_parameters"] = params
        if self.reducer is not None:
            for p in self.slot_of:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate))
        if self.memory_efficient_linear:
            for m, units in self.module_units.items():
                if type(m) is nn.Linear and not all(u.free for u in units):
                    linear.install(m)
                    self._linears.append(m)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._linears:
            linear.uninstall(m)
        self._linears.clear()
        for m in self.root.modules():
            if isinstance(m._parameters, _ZeroParams):
                m.__dict__["_parameters"] = dict(m._parameters)

    # -- fetch and release ----------------------------------------------------------------------
    def fetch(self, u: ParamUnit) -> None:
        self._record(u)
        if u.state is ParamState.AVAILABLE:
            return
        prefetched = u.state is ParamState.INFLIGHT
        if not u.persistent and not prefetched:  # a prefetched unit was counted when its read began
            self._make_room(u.layout.numel)
        with self.timers.phase("param fetch"):
            u.gather(lend=self.inference and not u.persistent)
        if not u.persistent and not prefetched:
            self._count_live(u.layout.numel)

    def _make_room(self, numel: int) -> None:
        """Release units kept for reuse, oldest first, until ``numel`` more fit the live bound."""
        while self._kept and self.live_numel + numel > self.max_live_numel:
            kept = next(iter(self._kept))
            del self._kept[kept]
            if kept.state is ParamState.AVAILABLE and kept.releasable:
                kept.release()
                self.live_numel -= kept.layout.numel

    def _count_live(self, numel: int) -> None:
        self.live_numel += numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def maybe_release(self, u: ParamUnit) -> None:
        if not u.releasable or u.state is not ParamState.AVAILABLE:
            return
        self._kept.pop(u, None)
        if self._reused_soon(u):
            self._kept[u] = None
            return
        u.release()
        self.live_numel -= u.layout.numel

    def _reused_soon(self, u: ParamUnit) -> bool:
        """Whether the trace fetches ``u`` again within the reuse distance, with room to keep it."""
        if not self._trace_ok or self.live_numel > self.max_live_numel:
            return False
        now = len(self._recording) - 1
        last = self._last_fetch.get(u.index, -1)
        nxt = self._next_use[last] if 0 <= last < len(self._next_use) else -1
        if nxt <= now:
            return False
        return self._trace_numel[nxt] - self._trace_numel[now + 1] <= self.max_reuse_distance

    def release_all(self) -> None:
        """Release every non-persistent unit (after a step, every unit whose shard changed)."""
        for u in self.units:
            u.fwd_refs = 0
            u.in_backward = False
            if not u.free:
                u.release()
        self.live_numel = 0
        self._kept.clear()

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args) -> None:
        if not self.stack:
            self._begin_iteration()
        frame = _Frame(module)
        self.stack.append(frame)
        for u in self.module_units.get(module, ()):
            u.hold()
            frame.units.append(u)
            self.fetch(u)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        frame = self.stack.pop()
        for u in frame.units:
            u.unhold()
            self.maybe_release(u)
        if torch.is_grad_enabled() and self.reducer is not None:
            tensors = output_tensors(output)
            if tensors:
                register_multi_grad_hook(tensors, lambda grads, m=module: self._pre_backward(m), mode="any")

    def on_param_access(self, p: nn.Parameter) -> None:
        entry = self.slot_of.get(p)
        if entry is None or entry[0].state is ParamState.AVAILABLE:
            return
        u = entry[0]
        frame = self.stack[-1]
        u.hold()
        frame.units.append(u)
        self.externals.setdefault(frame.module, set()).add(u)
        self.fetch(u)

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        units = list(self.module_units.get(module, ()))
        units += sorted(self.externals.get(module, ()), key=lambda u: u.index)
        for u in units:
            if u.grad_count and not u.reduced:
                u.in_backward = True
            self.fetch(u)

    def _post_accumulate(self, p: nn.Parameter) -> None:
        u, slot = self.slot_of[p]
        if p.grad is None:
            return
        with self.timers.phase("grad reduce"):
            self.reducer.add(u, slot, p.grad)
            p.grad = None
            u.grads_left -= 1
            if u.grads_left == 0:
                self._finish_unit(u)

    def _finish_unit(self, u: ParamUnit) -> None:
        self.reducer.finish(u)
        u.reduced = True
        u.in_backward = False
        self.maybe_release(u)

    def abandon_backward(self) -> None:
        """A backward raised half way: autograd drops the queued :meth:`_end_backward`, so reset
        what it would have reset (else every later backward skips it and reduces nothing right),
        drop the gradients parameters still hold, and release everything."""
        self.stack.clear()
        self._callback_queued = False
        for u in self.units:
            u.reduced = False
            u.grads_left = u.grad_count
            for p in u.params:
                p.grad = None
        self.release_all()

    def _end_backward(self) -> None:
        self._callback_queued = False
        with self.timers.phase("grad reduce"):
            for u in self.units:  # in unit order on every rank (see grads.py)
                if u.grad_count and not u.reduced:
                    self._finish_unit(u)
        for u in self.units:
            u.reduced = False
            u.grads_left = u.grad_count
            u.in_backward = False
            self.maybe_release(u)

    # -- trace and prefetch ---------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        if self._recording:
            if self._trace is not None and self._trace != self._recording:
                logger.debug("zero: the order of parameter fetches changed; recording the new order")
            self._trace = self._recording
            self._index_trace()
        self._recording = []
        self._last_fetch = {}
        self._trace_ok = self._trace is not None
        ahead = {i for i in self._ahead if self._trace_ok and self.units[i].state is ParamState.INFLIGHT}
        self._ahead = set()
        self.store.drop_prefetched(keep=ahead)
        for u in self.units:
            if u.state is ParamState.INFLIGHT and u.index not in ahead:  # prefetched, never used
                u.state = ParamState.NOT_AVAILABLE
        self.live_numel = sum(u.layout.numel for u in self.units if not u.persistent and (
            u.state is ParamState.AVAILABLE or u.index in ahead))

    def _index_trace(self) -> None:
        trace = self._trace
        self._next_use = [-1] * len(trace)
        last: Dict[int, int] = {}
        for pos in range(len(trace) - 1, -1, -1):
            self._next_use[pos] = last.get(trace[pos], -1)
            last[trace[pos]] = pos
        self._trace_numel = [0]
        for index in trace:
            self._trace_numel.append(self._trace_numel[-1] + self.units[index].layout.numel)

    def _record(self, u: ParamUnit) -> None:
        pos = len(self._recording)
        self._recording.append(u.index)
        self._last_fetch[u.index] = pos
        if not self._trace_ok:
            return
        if pos >= len(self._trace) or self._trace[pos] != u.index:
            self._trace_ok = False
            return
        if self.store.resident:
            return
        room = self.store.prefetch_capacity()
        budget = self.prefetch_numel
        wanted: Dict[int, object] = {}
        ahead = self._trace[pos + 1:]
        if self.inference:
            ahead = ahead + self._trace[:pos]  # the next forward's (see the note)
        for at, index in enumerate(ahead):
            if room <= 0 or budget <= 0:
                break
            nxt = self.units[index]
            if nxt.state is not ParamState.NOT_AVAILABLE or nxt is u or index in wanted:
                continue
            if self.live_numel + nxt.layout.numel > self.max_live_numel:
                break
            wanted[index] = nxt.layout
            if at >= len(self._trace) - pos - 1:
                self._ahead.add(index)
            nxt.state = ParamState.INFLIGHT
            room -= 1
            budget -= nxt.layout.shard_numel
            if not nxt.persistent:
                self._count_live(nxt.layout.numel)
        if wanted:
            self.store.prefetch(list(wanted.values()))
