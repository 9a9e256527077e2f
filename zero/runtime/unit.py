"""ParamUnit: the parameters one module owns, gathered and released together.

See stores/layouts.py for the layout and param_state.py for the states. A
unit's state changes only through its own methods: ``NOT_AVAILABLE`` to
``INFLIGHT`` by :meth:`ParamUnit.mark_prefetched` (a read ahead started, by
prefetch.py) and back by :meth:`ParamUnit.drop_prefetch`; to ``AVAILABLE`` by
:meth:`ParamUnit.gather`
(fetch the shard from its store, all-gather across ranks, point every
parameter's ``.data`` at its part of the flat buffer) and
:meth:`ParamUnit.release` (point them at an empty tensor; the flat buffer is
freed with its last reference). ``gather(lend=True)`` lets the parameters view
the store's fetched tensor itself (an NVMe pool buffer) instead of a copy,
when the store can spare it: the store gets it back at :meth:`release`. Autograd keeps the parameter objects, not
their data, so a released parameter is gathered again before backward uses it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import host_to_device
from .comm import Comm
from .param_state import ParamState
from ..stores.param_store import ParamStore
from ..stores.layouts import UnitLayout, build_unit_layout

_EMPTY: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_like_released(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The shared 0-element tensor a released parameter holds."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


class ParamUnit:
    """One unit: its layout, its parameters and their state on this rank."""

    def __init__(self, layout: UnitLayout, params: List[nn.Parameter], comm: Comm, device: torch.device,
                 dtype: torch.dtype):
        self.layout = layout
        self.params = params
        self.comm = comm
        self.device = device
        self.dtype = dtype
        self.store: Optional[ParamStore] = None  # attach(): the stores are built after the units
        self.optimizer_store = None  # fp32 master of the shard, when there is an optimizer
        self._state = ParamState.NOT_AVAILABLE
        self.full: torch.Tensor = None
        self.lent = False  # ``full`` is the store's fetched tensor, handed back at release
        self.owner = None  # the one module using the unit, when training may lend it (hooks.py)
        self.persistent = False  # stays gathered between uses (threshold, or gathering is free)
        self.free = False  # gathering is free (see free_gather); decided once the stores are filled
        self.holds = 0  # users that need it gathered: forwards in progress, GatheredParameters, saves
        self.in_backward = False  # gathered for a backward that has not reduced its gradients yet
        self.grad_count = sum(1 for p in params if p.requires_grad)
        self.grads_left = self.grad_count  # gradients still to arrive in this backward (or window)
        self.reduced = False  # gradients reduced during the current backward
        self.aliases: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (param, alias) of a window (window.py)
        # Called when the unit stops being gathered or on its way (the prefetcher's, prefetch.py)
        self.on_unavailable: Optional[Callable[["ParamUnit"], None]] = None

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def state(self) -> ParamState:
        return self._state

    def __repr__(self) -> str:
        return f"ParamUnit({self.layout.index}, {self.layout.module_name or '<root>'!r}, {self._state.name})"

    def attach(self, store: ParamStore, optimizer_store=None) -> None:
        """The stores that hold the shard (and its fp32 master), once they exist; None detaches."""
        self.store = store
        self.optimizer_store = optimizer_store

    # -- holds and the release rule ---------------------------------------------------------------
    def hold(self) -> None:
        """One more user needs the unit gathered until it calls :meth:`unhold`."""
        self.holds += 1

    def unhold(self) -> None:
        """Ends a :meth:`hold`; the caller releases the unit if it is now :attr:`releasable`."""
        self.holds -= 1

    @property
    def releasable(self) -> bool:
        """The one release rule: not persistent, not held, not waiting for its gradients."""
        return not self.persistent and self.holds == 0 and not self.in_backward

    # -- prefetch (prefetch.py) -------------------------------------------------------------------
    def mark_prefetched(self) -> None:
        """A read of the shard ahead of use started."""
        self._state = ParamState.INFLIGHT

    def drop_prefetch(self) -> None:
        """The read ahead will not be used (the store dropped it)."""
        if self._state is ParamState.INFLIGHT:
            self._state = ParamState.NOT_AVAILABLE
            self._unavailable()

    def _unavailable(self) -> None:
        if self.on_unavailable is not None:
            self.on_unavailable(self)

    # -- backward (hooks.py) -----------------------------------------------------------------------
    def expect_grads(self, micro_batches: int = 1) -> None:
        """The next backward (a window's ``micro_batches`` backwards) delivers this many gradients
        per parameter that requires one."""
        self.grads_left = self.grad_count * micro_batches

    @property
    def unreduced(self) -> bool:
        """It takes gradients and this backward has not reduced them yet."""
        return self.grad_count > 0 and not self.reduced

    def begin_backward(self) -> None:
        """Gathered for a backward that will reduce its gradients: kept until it has."""
        if self.unreduced:
            self.in_backward = True

    def grad_arrived(self) -> bool:
        """Count one gradient; True when it was the last expected."""
        self.grads_left -= 1
        return self.grads_left == 0

    def mark_reduced(self) -> None:
        """Its gradients of this backward are reduced: nothing more keeps it gathered for them."""
        self.reduced = True
        self.in_backward = False

    def end_backward(self) -> None:
        """Backward ended (or was abandoned): ready for the next."""
        self.reduced = False
        self.in_backward = False
        self.expect_grads()

    def drop_holds(self) -> None:
        """Every user is gone at once (after a step, a failed forward or window)."""
        self.holds = 0
        self.in_backward = False

    def add_alias(self, p: nn.Parameter, alias: torch.Tensor) -> None:
        """``alias`` (a window's leaf for ``p``) follows ``p``'s data through gathers and releases."""
        self.aliases.append((p, alias))

    def forget_aliases(self) -> None:
        """A window's aliases of the parameters end with it (window.py)."""
        self.aliases.clear()

    def free_gather(self) -> bool:
        """Whether gathering costs nothing: one rank, and the shard lives in memory for good, on
        the compute device, in the compute dtype (so the parameters can view it)."""
        if self.comm.world_size != 1:
            return False
        shard = self.store.resident_shard(self.layout)
        return shard is not None and shard.device == self.device and shard.dtype == self.dtype

    def gather(self, lend: bool = False, wait: bool = True):
        """``lend``: view the fetched shard itself when one rank computes on it as it is and the
        store can spare it until :meth:`release` (inference: no copy out of the pool).
        ``wait=False`` with a resident store (its shard stays valid): returns the all-gather's
        work, or None when there is none, and the caller waits for it before the parameters are
        read (stages 0-2 gather every unit at once after a step: hooks.py)."""
        if self._state is ParamState.AVAILABLE:
            return None
        work = None
        try:
            shard = self.store.fetch(self.layout)
        except Exception as error:  # kept for the engine (Comm.deferring)
            if not self.comm.deferring:
                raise
            self.comm.defer(error)
            shard = None
        lent = shard is not None and lend and self._is_whole(shard) and self.store.lend(self.layout)
        # A copy made for this gather alone (a dequantized shard, a copy read ahead onto the
        # device): on one rank it is the unit, not copied once more.
        own = (shard is not None and not lent and self.store.fetched_a_copy(self.layout) and self._is_whole(shard))
        try:
            if shard is None:  # this rank's read failed: zeros, so the others' all_gather completes
                full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
                self.comm.all_gather_into(full, torch.zeros(self.layout.shard_numel, dtype=self.dtype,
                                                            device=self.device))
            elif self.free or lent or own:
                full = shard
            else:
                copied, made_here = None, shard.device != self.device
                if made_here:
                    if self.device.type == "cuda":
                        shard, copied = host_to_device.to_device(shard, self.device)
                    else:
                        shard = shard.to(self.device)
                if made_here and self._is_whole(shard):
                    full = shard  # the copy just made onto the device is the unit on one rank
                else:
                    full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
                    async_op = not wait and self.store.resident
                    work = self.comm.all_gather_into(full, shard, async_op=async_op)
                if copied is not None and not self.store.resident:
                    copied.synchronize()  # the pool buffer is reused next: its copy alone is waited for
        finally:
            if shard is not None and not lent:
                self.store.fetched(self.layout)
        self._point(full)
        self.lent = lent
        self._state = ParamState.AVAILABLE
        return work

    def _is_whole(self, shard: torch.Tensor) -> bool:
        """Whether ``shard`` can be the unit's buffer as it is: one rank, and the shard on the
        compute device, in the compute dtype, of the unit's padded size."""
        return (self.comm.world_size == 1 and shard.device == self.device and shard.dtype == self.dtype
                and shard.numel() == self.layout.padded_numel)

    def unlend(self) -> None:
        """View a copy instead of the store's tensor, which goes back to the store now (something
        may keep the data past the release: see hooks.py [Note: lending in training])."""
        if not self.lent:
            return
        self._point(self.full.clone())
        self.lent = False
        self.store.fetched(self.layout)

    def _point(self, full: torch.Tensor) -> None:
        for slot, p in zip(self.layout.slots, self.params):
            p.data = full[slot.offset:slot.stop].view(slot.shape)
        for p, alias in self.aliases:
            alias.data = p.data
        self.full = full

    def release(self, force: bool = False) -> None:
        """Point the parameters at an empty tensor; ``force`` also when the unit was never gathered."""
        if self._state is ParamState.NOT_AVAILABLE and not force:
            return
        empty = empty_like_released(self.dtype, self.device)
        for p in self.params:
            p.data = empty
        for _, alias in self.aliases:
            alias.data = empty
        self.full = None
        if self.lent:
            self.lent = False
            self.store.fetched(self.layout)
        was = self._state
        self._state = ParamState.NOT_AVAILABLE
        if was is not ParamState.NOT_AVAILABLE:
            self._unavailable()


def named_param_aliases(module: nn.Module) -> Dict[nn.Parameter, List[str]]:
    """Every name of every parameter, shared ones under all their names, in model order."""
    names: Dict[nn.Parameter, List[str]] = OrderedDict()
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


# [Note: a module's frozen and trainable parameters]
# A unit is a module's own parameters, gathered together. Where a module owns frozen and
# trainable parameters together (peft's bias="all" or "lora_only": a frozen base weight beside a
# trained bias; BitFit: every bias trained) one unit made the whole module trainable: an fp32
# master, Adam states and a gradient for the frozen weight too (16 bytes a parameter, read and
# written every step with the optimizer on NVMe) and no int8 storage for it. So an engine that
# trains gives such a module two units, its trainable parameters and its frozen ones, both
# gathered for its forward (as a parameter shared with an earlier module is); the frozen one is
# then as any frozen unit (stores/layouts.py [Note: the optimizer covers the trainable units
# only]). A checkpoint saved with the module as one unit loads by parameter name
# (checkpoint/regroup.py).
def plan_units(module: nn.Module, world_size: int, split_frozen: bool = False):
    """Split ``module``'s parameters into units, one per module owning parameters directly;
    with ``split_frozen`` (an engine that trains), two for a module that owns frozen and
    trainable parameters together (see [Note: a module's frozen and trainable parameters]).

    Returns ``(layouts, params_per_unit, module_units)``, where
    ``module_units[m]`` lists the units module ``m`` must gather before its
    forward (its own, plus those of parameters it shares with an earlier module).
    """
    aliases = named_param_aliases(module)
    owner: Dict[nn.Parameter, int] = {}
    layouts: List[UnitLayout] = []
    params_per_unit: List[List[nn.Parameter]] = []
    module_units: Dict[nn.Module, List[int]] = OrderedDict()
    for mod_name, mod in module.named_modules():
        direct = [p for p in mod._parameters.values() if p is not None]
        new = []
        for p in direct:
            if p not in owner and all(p is not q for q in new):
                new.append(p)
        groups = [new] if new else []
        if split_frozen:  # a group per kind, in the order they come
            groups = [[p for p in new if p.requires_grad == kind] for kind in dict.fromkeys(p.requires_grad for p in new)]
        for group in groups:
            index = len(layouts)
            shapes = [(tuple(aliases[p]), tuple(getattr(p, "ds_shape", p.shape))) for p in group]
            layouts.append(build_unit_layout(index, mod_name, shapes, world_size))
            params_per_unit.append(group)
            for p in group:
                owner[p] = index
        needed = []
        for p in direct:
            if owner[p] not in needed:
                needed.append(owner[p])
        if needed:
            module_units[mod] = needed
    return layouts, params_per_unit, module_units
