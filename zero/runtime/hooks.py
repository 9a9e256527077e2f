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

[Note: lending in training]
A unit read from NVMe arrives in a pool buffer; copying it out costs a pass over
every parameter, twice an iteration, plus fresh pages for each copy. Inference
lets the parameters view the buffer itself (prefetch.py). Training does too when
nothing can keep that view past the unit's release (the buffer then holds other
data): the unit's one user is an nn.Linear running ZeroLinear (linear.py), whose
autograd keeps the parameter, not its data. A read of the unit by another module
(``F.linear(x, self.wte.weight)``) or a Linear forward that would keep the data
(F.linear on a non-contiguous input, or any Linear forward under a saved-tensor
hook that may store the data: torch.utils.checkpoint's recomputation saves
``weight.detach()``) copies it first and ends the lending for that unit
(``ParamUnit.unlend``). A step during backward (engine/optimizer.py) rewrites a
sub-group's shards in their buffers only once all its units' gradients are in,
when no backward needs their old values.

The prefetch and keep policy (which units to read ahead, which to keep gathered,
the live-parameter bound) is prefetch.py's.
"""
from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from . import linear
from .grad_reducer import GradReducer
from .prefetch import LiveBound, Prefetcher
from .timers import Timers
from .param_state import ParamState
from ..stores.param_store import ParamStore
from .unit import ParamUnit
from .window import MicroBatchWindow


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
        if c is not None and c.window is not None and p in c.slot_of:
            if c.window.index is None:
                raise RuntimeError(
                    f"train_batch: {c.slot_of[p][0].layout.module_name or 'the model'} read a parameter outside "
                    f"the window's micro-batches (a forward recomputed during backward by a checkpoint function "
                    f"train_batch cannot bind, such as torch.utils.checkpoint called directly); run the "
                    f"micro-batch loop (forward, backward, step) for this model")
            return c.window.alias(p, c.slot_of[p][0], c.window_grad)  # see window.py
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
                 max_reuse_distance: int = 10**9, whole: bool = False):
        self.root = root
        self.whole = whole  # stages 0-2: every unit persistent, all gathered at the build
        self._again: Set[ParamUnit] = set()  # persistent units a refresh released, to gather again
        self.units = units
        self.module_units = {m: [units[i] for i in idx] for m, idx in module_units.items()}
        self.reducer = reducer
        self.store = store
        self.live = LiveBound(max_live_numel)
        self.inference = reducer is None  # see prefetch.py [Note: inference reads ahead across forwards]
        self.prefetcher = Prefetcher(units, store, self.live, prefetch_numel, max_reuse_distance, self.inference)
        self.timers = timers
        self._local = threading.local()  # each thread's stack of forwards (window.py runs k at once)
        self.window: Optional[MicroBatchWindow] = None
        self.externals: Dict[nn.Module, Set[ParamUnit]] = {}
        self.slot_of: Dict[nn.Parameter, tuple] = {}
        for u in units:
            for i, p in enumerate(u.params):
                self.slot_of[p] = (u, i)
        self.memory_efficient_linear = memory_efficient_linear
        self._linears: List[nn.Module] = []
        self._handles = []
        self._callback_queued = False

    @property
    def stack(self) -> List[_Frame]:
        """The modules whose forward is running on this thread, innermost last."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @property
    def live_numel(self) -> int:
        return self.live.numel

    @property
    def peak_live_numel(self) -> int:
        return self.live.peak

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        # Per module, the frozen units released after its backward (persistence is chosen by now).
        self._frozen_units = {m: [u for u in us if not u.grad_count and not u.persistent]
                              for m, us in self.module_units.items()}
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
                    linear.install(m, before_saving_weight=lambda units=units: self._unlend(units))
                    self._linears.append(m)
        self._choose_lent()

    def _choose_lent(self) -> None:
        """Training lends a unit's pool buffer only to an nn.Linear that is the unit's one user and
        keeps no view of it (see [Note: lending in training])."""
        users: Dict[ParamUnit, List[nn.Module]] = {}
        for m, units in self.module_units.items():
            for u in units:
                users.setdefault(u, []).append(m)
        linears = set(self._linears)
        for u, ms in users.items():
            only = ms[0] if len(ms) == 1 else None
            if only in linears and {id(p) for p in u.params} <= {id(p) for p in only._parameters.values()
                                                                  if p is not None}:  # (a split module's: unit.py)
                u.owner = only

    def _unlend(self, units: List[ParamUnit]) -> None:
        for u in units:
            u.owner = None  # from now on copied: this use would keep a view past the release
            u.unlend()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._linears:
            linear.uninstall(m)
        self._linears.clear()
        for u in self.units:
            u.owner = None
        for m in self.root.modules():
            if isinstance(m._parameters, _ZeroParams):
                m.__dict__["_parameters"] = dict(m._parameters)

    # -- fetch and release ----------------------------------------------------------------------
    def fetch(self, u: ParamUnit, by: Optional[nn.Module] = None) -> None:
        """Gather ``u`` for module ``by``'s forward or backward (None: a parameter read elsewhere)."""
        if self.window is None or self.window.first:  # a window's trace is its first micro-batch's
            if u.state is ParamState.NOT_AVAILABLE:
                self._read_first(u)
            self.prefetcher.record(u)
        if u.state is ParamState.AVAILABLE:
            return
        prefetched = u.state is ParamState.INFLIGHT
        if not u.persistent and not prefetched:  # a prefetched unit was counted when its read began
            self.live.make_room(u.layout.numel)
        lend = not u.persistent and (self.inference or (by is not None and by is u.owner))
        with self.timers.phase("param fetch"):
            u.gather(lend=lend)
        if not u.persistent and not prefetched:
            self.live.count(u.layout.numel)

    def _read_first(self, u: ParamUnit) -> None:
        """Start ``u``'s own read before the reads ahead that recording it starts (prefetch.py,
        [Note: the first reads go first]); counted as a read ahead is."""
        if not self.store.reads_ahead or u.layout.shard_numel == 0:
            return
        if not u.persistent:
            self.live.make_room(u.layout.numel)
        if self.store.prefetch([u.layout]):
            u.mark_prefetched()
            if not u.persistent:
                self.live.count(u.layout.numel)

    def maybe_release(self, u: ParamUnit) -> None:
        if not u.releasable or u.state is not ParamState.AVAILABLE:
            return
        self.live.kept.pop(u, None)
        if self.prefetcher.reused_soon(u):
            self.live.kept[u] = None
            return
        u.release()
        self.live.numel -= u.layout.numel

    def release_all(self) -> None:
        """Release every unit but the free ones (after a load, an abandoned forward or backward)."""
        self._release(lambda u: True)

    def _release(self, changed: Callable[[ParamUnit], bool]) -> List[ParamUnit]:
        """Release every non-persistent unit, and the persistent ones ``changed`` says changed;
        returns the persistent units it released that were gathered."""
        gathered = []
        for u in self.units:
            u.drop_holds()
            if u.free or (u.persistent and not changed(u)):
                continue
            if u.state is ParamState.INFLIGHT and not changed(u):
                continue  # read ahead for the next forward (prefetch.py, [Note: frozen units are read ahead across iterations])
            if u.persistent and u.state is ParamState.AVAILABLE:
                gathered.append(u)
            u.release()
        self.live.numel = 0
        self.live.kept.clear()
        return gathered

    def gather_persistent(self) -> None:
        """Gather the units that stay gathered and are not: the free ones, every unit below stage
        3 and the persistent units a refresh released (DeepSpeed too all-gathers its persistent
        parameters after each step), so that no forward waits for them one at a time. From NVMe
        their reads go in batches as large as the room for reads ahead allows, all of a batch in
        flight before the first is gathered; the gathers are started, then waited for, so that
        one's latency is not added to the next's."""
        again, self._again = self._again, set()
        todo = [u for u in self.units if (u.free or (self.whole and u.persistent) or u in again)
                and u.state is not ParamState.AVAILABLE]
        works = []
        while todo:
            started = len(todo) if self.store.resident else self.store.prefetch([u.layout for u in todo])
            batch = todo[:max(1, started)]
            works += [u.gather(wait=False) for u in batch]  # each gathered unit's pool room comes back
            todo = todo[len(batch):]
        for work in works:
            if work is not None:
                work.wait()

    def refresh(self, after_step: bool = False) -> None:
        """The shards changed: every unit's (a load) or, ``after_step``, the trainable units'
        (a step never changes a unit without a trainable parameter, so a frozen persistent unit,
        such as a LoRA base's layer norm, stays gathered). Release what views the old values,
        drop the copies of a host-resident store read ahead before the change (stores/param_store.py,
        [Note: host-resident shards are read ahead onto the GPU]), and gather again at once the
        persistent units it released: below stage 3 now, in stage 3 when the next forward starts,
        so that a read failing there goes the forward's way (on several ranks: the error deferred
        until every rank has finished its collectives) rather than out of ``step()`` after the
        update."""
        self._again.update(self._release((lambda u: u.grad_count > 0) if after_step else (lambda u: True)))
        if self.store.resident and self.store.reads_ahead:  # a step leaves frozen units' copies valid
            keep = self.prefetcher.unchanging if after_step else set()
            self.store.drop_prefetched(keep=keep)
            for u in self.units:
                if u.index not in keep:
                    u.drop_prefetch()
        if self.whole:  # below stage 3 the parameters are whole between steps, as in DeepSpeed
            self.gather_persistent()

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args) -> None:
        window = self.window
        if not self.stack and (window is None or window.first):
            self.prefetcher.begin_iteration()
            if self._again:
                self.prefetcher.read_ahead_at_start()  # the disk works while the persistent units copy
                self.gather_persistent()
        if window is not None and module in self.module_units:
            window.reached(module)
        frame = _Frame(module)
        self.stack.append(frame)
        for u in self.module_units.get(module, ()):
            u.hold()
            frame.units.append(u)
            self.fetch(u, by=module)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        frame = self.stack.pop()
        last = self.window is None or self.window.last  # a window releases after its last micro-batch
        # A forward run inside backward recomputes a checkpointed segment: what it saved for backward
        # holds frozen parameters themselves, not detached views ([Note: frozen units in backward]);
        # unless its output takes no gradient (nothing of it was saved).
        keep = torch._C._current_graph_task_id() != -1 and bool(output_tensors(output))
        for u in frame.units:
            u.unhold()
            if last and not keep:
                self.maybe_release(u)
        if torch.is_grad_enabled() and self.reducer is not None:
            self._release_after_backward(module, args)
        if torch.is_grad_enabled() and self.reducer is not None:
            tensors = output_tensors(output)
            if tensors:
                if len(tensors) == 1:  # one tensor's hook fires once a backward: torch's multi-grad
                    # hook (locks, a table per backward) cost twice as much per module in a window
                    tensors[0].register_hook(functools.partial(self._output_grad, module))
                else:
                    register_multi_grad_hook(tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
                if self.window is not None:
                    self.window.finished(module)  # its backwards take turns there

    # [Note: frozen units in backward]
    # A unit with no parameter that requires grad (a LoRA base) has no gradient whose reduction
    # says its module's backward is over, so a unit gathered for a backward stayed gathered until
    # the backward ended: by then a LoRA model's whole frozen base, past stage3_max_live_parameters.
    # Instead, a forward registers a hook on its module's inputs that need a gradient; it fires once
    # the module's backward has computed theirs, and nothing in that backward reads the frozen
    # weights after it: then they go. A module whose inputs need no gradient has no backward
    # through its weights (nothing is fetched for it), except to recompute a checkpointed segment,
    # whose forward releases it at once. Otherwise a forward recomputed in backward
    # (torch.utils.checkpoint) releases nothing when it ends: non-reentrant checkpointing saves a
    # frozen parameter itself (a trainable one as a detached view), and releasing it would empty
    # the very tensor backward reads ("Recomputed values ... have different metadata"); the hooks
    # of the original forward, or of the reentrant recompute's own backward, release it. In a
    # train_batch window the unit serves k backwards: it goes once the last of them is done with it.
    def _release_after_backward(self, module: nn.Module, args) -> None:
        units = self._frozen_units.get(module)
        inputs = output_tensors(args) if units else []
        if inputs:
            window = self.window
            index = window.index if window is not None else None
            register_multi_grad_hook(inputs, functools.partial(self._backward_done, units, window, index, module),
                                     mode="all")

    def _backward_done(self, units: List[ParamUnit], window: Optional[MicroBatchWindow], index: Optional[int],
                       module: nn.Module, grads) -> None:
        if window is not None and not window.backward_passed(module, index):
            return
        for u in units:
            self.maybe_release(u)

    def on_param_access(self, p: nn.Parameter) -> None:
        entry = self.slot_of.get(p)
        if entry is None:
            return
        u = entry[0]
        frame = self.stack[-1]
        if u.owner is not None and frame.module is not u.owner:
            self._unlend([u])  # read by another module, which may keep a view of the data
        if u.state is ParamState.AVAILABLE:
            return
        u.hold()
        frame.units.append(u)
        self.externals.setdefault(frame.module, set()).add(u)
        self.fetch(u)

    # -- backward -------------------------------------------------------------------------------
    def _output_grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        self._pre_backward(module)

    def _pre_backward(self, module: nn.Module) -> None:
        window = self.window
        if window is not None and window.index is not None:  # one of a window's backwards (window.py)
            if not window.replaying:
                window.reached(module)
        elif not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            self._callback_queued = True
        if window is None or window.first:
            self.prefetcher.backward_begins()
        units = list(self.module_units.get(module, ()))
        units += sorted(self.externals.get(module, ()), key=lambda u: u.index)
        for u in units:
            u.begin_backward()
            self.fetch(u, by=module)

    def _post_accumulate(self, p: nn.Parameter) -> None:
        u, slot = self.slot_of[p]
        if p.grad is None:
            return
        with self.timers.phase("grad reduce"):
            self.reducer.add(u, slot, p.grad)
            p.grad = None
            if u.grad_arrived():
                self._finish_unit(u)

    def window_grad(self, p: nn.Parameter, i: int, grad: torch.Tensor) -> None:
        """Micro-batch ``i``'s gradient of ``p`` (window.py): kept until the unit has all k."""
        u = self.slot_of[p][0]
        self.window.take(p, i, grad)
        if u.grad_arrived():
            self._finish_window_unit(u)

    def _finish_window_unit(self, u: ParamUnit) -> None:
        """The reducer gets the unit's gradients micro-batch by micro-batch, as in the loop (on one
        rank a parameter's k at once, summed in the same order: nvmeio/host_sum.py)."""
        window = self.window
        with self.timers.phase("grad reduce"):
            if self.reducer.comm.world_size == 1:
                for slot, p in enumerate(u.params):
                    grads = [g for g in (window.pop_grad(p, i) for i in range(window.k)) if g is not None]
                    if grads:
                        self.reducer.add_series(u, slot, grads)
                self._finish_unit(u)
                return
            for i in range(window.k):
                for slot, p in enumerate(u.params):
                    grad = window.pop_grad(p, i)
                    if grad is not None:
                        self.reducer.add(u, slot, grad)
                if i < window.k - 1:
                    self.reducer.reduce(u)
            self._finish_unit(u)

    def _finish_unit(self, u: ParamUnit) -> None:
        self.reducer.finish(u)
        u.mark_reduced()
        self.maybe_release(u)

    # -- accumulation windows (engine/train_batch.py) ----------------------------------------------
    def begin_window(self, window: MicroBatchWindow) -> None:
        """The next forwards and backward are ``window``'s k micro-batches, unit-major."""
        for u in self.units:
            u.expect_grads(window.k)
        self.window = window

    def end_window(self, failed: bool) -> MicroBatchWindow:
        """The window is over: its aliases go; after a failure also every hold, gradient count and
        gathered unit. Returns it (its own bookkeeping is the caller's to forget)."""
        window, self.window = self.window, None
        for u in self.units:
            u.forget_aliases()
            if failed:
                u.expect_grads()
                u.drop_holds()
        if failed:
            self.stack.clear()
            self.release_all()
        return window

    def abandon_forward(self, release: bool) -> None:
        """A forward raised: its frames go; ``release``: every unit too (one may hold zeros for a
        read that failed on this rank)."""
        self.stack.clear()
        if release:
            self.release_all()

    def abandon_backward(self) -> None:
        """A backward raised half way: autograd drops the queued :meth:`end_backward`, so reset
        what it would have reset (else every later backward skips it and reduces nothing right),
        drop the gradients parameters still hold, and release everything."""
        self.stack.clear()
        self._callback_queued = False
        for u in self.units:
            u.end_backward()
            for p in u.params:
                p.grad = None
        self.release_all()

    def end_backward(self) -> None:
        """The end of backward (queued on autograd's engine; called by a window once its k
        backwards are done): finish the units whose gradients did not all arrive, release."""
        self._callback_queued = False
        with self.timers.phase("grad reduce"):
            for u in self.units:  # in unit order on every rank (see grad_reducer.py)
                if u.unreduced and self.window is not None:
                    self._finish_window_unit(u)
                elif u.unreduced:
                    self._finish_unit(u)
            self.reducer.flush()
        for u in self.units:
            u.end_backward()
            self.maybe_release(u)
        self.prefetcher.backward_ended()
