"""The tensors a train_batch window saves for backward: in host memory up to a budget, past it
on NVMe (``activation_checkpointing.cpu_checkpointing`` and ``max_in_cpu_bytes``).

[Note: what is kept, what is spilled, and in which order it comes back]
A window's k forwards all run before its k backwards (window.py), so everything
autograd saves for backward (with activation checkpointing, only the inputs of
each checkpointed segment) is alive at once. :class:`SavedActivations` takes
every saved tensor through ``torch.autograd.graph.saved_tensors_hooks``, pushed
on each forward thread of the window. What it stores is the *storage* under a
saved tensor, once however many views of it are saved (attention saves q, k and
v, three views of one projection), and each saved tensor is given back as the
same view (offset, sizes, strides) of that storage or of its copy, so backward
computes on exactly the bytes and layout it would have had: results are
bit-identical whether anything was spilled or not.

Only storages that spilling can free are taken: of at least ``MIN_SPILL_BYTES``
(smaller ones are not worth an I/O), under a tensor made by an autograd op.
A leaf (a parameter, the window's alias of one, an input) and a view of one are
held by someone else anyway; a leaf is handed back as itself, so that an alias
re-pointed at its unit's data by the gather before backward is read there.

On the CPU a kept storage is the activation's own (no copy); on CUDA it is
copied to host memory on the outbound copy stream, not waited for when saved: a spill to
NVMe waits for that copy alone, a return to the device is ordered after it on
the device (the CUDA-only branches below, marked). Past the budget
the *oldest* kept storages are written to the window's swap file
(swapper/_activation_swapper.py) and dropped: the window's first units are the
ones backward needs last, which leaves their reads the most time. Reads start
when the forwards are done and go ahead of backward in the order it will unpack
the storages. On the CPU the k backwards take turns at each hooked module's
output (window.py), so a tensor saved after its forward passed n of those is
used between turns n + 1 and n, micro-batch 1 first, later saves first; on
CUDA (one autograd call) the order is the reverse of the saves. A read goes
ahead while the host bytes held stay within the budget, one read always; a
storage backward needs before its read was started (the order missed) is read
there and then (``SpillStats.reads_not_ahead``). A storage is dropped
when the last of its saved views is freed (autograd frees them as it goes), and
everything, the swap file included, when the window ends, failed or not.
"""
from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .linear import KEEPS_LEAVES

MIN_SPILL_BYTES = 64 << 10  # below this a storage stays where autograd keeps it


class StoredState(enum.Enum):
    """Where one saved storage is; the memory each state holds."""

    HOST = "host"
    """In host memory (CPU: the activation's own storage; CUDA: a pinned copy); counts in the budget."""
    ON_NVME = "on_nvme"
    """In the window's swap file only; holds no memory."""
    READING = "reading"
    """Being read ahead into a host tensor of its own; counts in the budget."""
    LOADED = "loaded"
    """Read back (CPU: host memory, counts in the budget; CUDA: device memory, does not)."""
    GONE = "gone"
    """Every saved view of it was freed, or the window ended; holds nothing."""


@dataclass
class SpillStats:
    """What the saved-tensor store did (tests and benchmarks read it)."""

    saved_bytes: int = 0  # bytes of the storages taken (each once)
    spilled_bytes: int = 0  # written to NVMe
    read_bytes: int = 0  # read back
    spilled_tensors: int = 0  # storages written
    reads_not_ahead: int = 0  # storages backward needed before their read was started (the order missed)
    peak_host_bytes: int = 0  # most bytes held in host memory at once


@dataclass(eq=False)
class _Stored:
    seq: int
    order: Tuple[int, ...]  # sorts in the order backward will unpack it
    nbytes: int
    device: torch.device
    version: int  # the saved tensor's version when packed (in-place changes after it are refused)
    ref: StorageWeakRef  # identifies the storage while it lives (never reused while held)
    state: StoredState = StoredState.HOST
    data: Optional[torch.Tensor] = None  # HOST on the CPU: a detached view of the activation; else bytes
    blob: object = None  # the swapper's, once written
    refs: int = 0  # saved views alive
    copied: object = None  # CUDA: the event of the copy into ``data``, until something waited for it
    source: object = None  # CUDA: a weak reference to the saved tensor (in-place changes are refused)


class _Saved:
    """What autograd keeps for one saved tensor: its storage and the view of it."""

    __slots__ = ("stored", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, stored: _Stored, t: torch.Tensor):
        self.stored = stored
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.size(), t.stride()


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage as one uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _to_host_async(t: torch.Tensor):
    """CUDA only: ``t``'s whole storage copied into pinned host memory on the device's copy
    stream, after the work queued so far; returns the host bytes and the copy's event. Saving
    does not wait for the copy (each saved tensor was a blocking copy); the caching allocator
    keeps ``t``'s memory until the copy stream is done with it."""
    from .host_to_device import copy_stream

    whole = _whole_storage(t)
    host = torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True)
    stream = copy_stream(t.device, to_host=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(whole, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    whole.record_stream(stream)
    return host, done


def _modified(t: torch.Tensor, packed: int) -> RuntimeError:
    return RuntimeError(f"a tensor of shape {tuple(t.shape)} saved for backward in a train_batch window was "
                        f"modified by an in-place operation after it was saved (version {t._version}, saved at "
                        f"version {packed}); its gradient cannot be computed. Use an out-of-place operation")


class SavedActivations:
    """The saved-tensor store of an engine's train_batch windows (see the note).

    ``budget``: host bytes of saved storages kept before the oldest go to ``swapper``
    (an :class:`~swapper.ActivationSwapper`); None with no swapper: all kept.
    """

    def __init__(self, budget: Optional[int], swapper=None, min_bytes: int = MIN_SPILL_BYTES):
        if (budget is None) != (swapper is None):
            raise ValueError("SavedActivations needs a budget and a swapper together, or neither")
        self.budget = budget
        self.swapper = swapper
        self.min_bytes = min_bytes
        self.stats = SpillStats()  # every window's, added up
        self.window_stats = SpillStats()  # the last window's
        self._lock = threading.RLock()  # packs, unpacks and frees come from several threads
        self._open = False
        self._turns = False
        self._seq = 0
        self._host_bytes = 0
        self._records: List[_Stored] = []
        self._by_storage: Dict[int, _Stored] = {}
        self._kept: "OrderedDict[int, _Stored]" = OrderedDict()  # HOST ones, oldest first
        self._spilled: List[_Stored] = []
        self._order: Optional[List[_Stored]] = None  # the spilled ones in backward's order
        self._next = 0  # the next of _order to read ahead
        self._reading = 0

    # -- a window --------------------------------------------------------------------------------
    def begin(self, backward_turns: bool) -> None:
        """A window starts. ``backward_turns``: its backwards take turns unit by unit, micro-batch 1
        first (the CPU); else they are one autograd call (CUDA)."""
        with self._lock:
            self._open, self._turns = True, backward_turns
            self.window_stats = SpillStats()

    @contextlib.contextmanager
    def saving(self, micro_batch: int, turns_passed: Callable[[], int] = lambda: 0):
        """Run the block (one micro-batch's forward, on its own thread) with its saved tensors
        taken by the store; ``turns_passed()``: where that forward is, counted in the places its
        backward will take turns at (window.py ``turns_passed``; 0 for a lone micro-batch)."""
        def pack(t: torch.Tensor):
            return self._pack(t, micro_batch, turns_passed)
        setattr(pack, KEEPS_LEAVES, True)  # a lent parameter stays lendable (linear.py)
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def forward_done(self) -> None:
        """The window's forwards are done: start reading what backward needs first."""
        with self._lock:
            self._read_ahead()

    def end(self) -> None:
        """The window ends (failed or not): every storage dropped, the swap file removed; a saved
        tensor unpacked later raises. An I/O error of the window's spills is raised here."""
        with self._lock:
            self._open = False
            for stored in self._records:
                self._drop(stored)
            self._records, self._spilled, self._order, self._next, self._reading = [], [], None, 0, 0
            self._by_storage.clear()
            self._kept.clear()
            self._host_bytes = 0
            if self.swapper is not None:
                self.swapper.end_window()

    # -- pack --------------------------------------------------------------------------------------
    def _takes(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one spilling can free (see the note)."""
        if not self._open or type(t) is not torch.Tensor or t.grad_fn is None:
            return False
        if t._base is not None and t._base.grad_fn is None:
            return False  # a view of a leaf (a parameter's slice)
        if t.layout is not torch.strided or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg():
            return False
        return t.device.type in ("cpu", "cuda") and t.untyped_storage().nbytes() >= self.min_bytes

    def _pack(self, t: torch.Tensor, micro_batch: int, turns_passed: Callable[[], int]):
        if not self._takes(t):
            return t if t.grad_fn is None else t.detach()  # a leaf as itself (see the note)
        with self._lock:
            storage = t.untyped_storage()
            stored = self._by_storage.get(storage._cdata)
            if stored is None or stored.state is StoredState.GONE or stored.version != t._version \
                    or stored.ref.expired():
                stored = self._take(t, storage, micro_batch, turns_passed)
            stored.refs += 1
            saved = _Saved(stored, t)
            weakref.finalize(saved, self._release, stored)
            self._spill_over_budget()
            return saved

    def _take(self, t, storage, micro_batch, turns_passed) -> _Stored:
        self._seq += 1
        order = (-turns_passed(), micro_batch, -self._seq) if self._turns else (-self._seq,)
        stored = _Stored(self._seq, order, storage.nbytes(), t.device, t._version, StorageWeakRef(storage))
        if t.device.type == "cpu":
            stored.data = t.detach()  # the activation itself; shares its version counter
        else:  # CUDA only: a pinned host copy (not run in this repository's CI, which has no GPU)
            stored.data, stored.copied = _to_host_async(t)
            stored.source = weakref.ref(t)
        self._records.append(stored)
        self._by_storage[storage._cdata] = stored
        self._kept[stored.seq] = stored
        self._count_host(stored.nbytes)
        self.window_stats.saved_bytes += stored.nbytes
        self.stats.saved_bytes += stored.nbytes
        return stored

    def _spill_over_budget(self) -> None:
        """Write the oldest kept storages out until the host bytes are within the budget."""
        if self.swapper is None:
            return
        while self._host_bytes > self.budget and self._kept:
            _, stored = self._kept.popitem(last=False)
            data = stored.data
            if stored.device.type == "cpu":
                if data._version != stored.version:
                    raise _modified(data, stored.version)
                data = _whole_storage(data)
            elif stored.copied is not None:  # CUDA only: the bytes are on the host before they go out
                stored.copied.synchronize()
                stored.copied = None
            stored.blob = self.swapper.write(data)
            stored.data, stored.state = None, StoredState.ON_NVME
            self._host_bytes -= stored.nbytes
            self._spilled.append(stored)
            for stats in (self.stats, self.window_stats):
                stats.spilled_bytes += stored.nbytes
                stats.spilled_tensors += 1

    # -- unpack ------------------------------------------------------------------------------------
    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        with self._lock:
            stored = packed.stored
            if stored.state is StoredState.GONE:
                raise RuntimeError("a tensor saved for backward in a train_batch window is gone: the window "
                                   "ended (its activations and swap file were dropped) before this backward "
                                   "used it; run the window again")
            if stored.state in (StoredState.ON_NVME, StoredState.READING):
                self._load(stored)
            data = stored.data
            if stored.state is StoredState.HOST and stored.device.type == "cpu" and data._version != stored.version:
                raise _modified(data, stored.version)
            source = stored.source() if stored.source is not None else None
            if source is not None and source._version != stored.version:  # CUDA: the copy may have raced it
                raise _modified(source, stored.version)
            if stored.device.type == "cuda" and stored.state is not StoredState.LOADED:
                data = self._to_device(stored)  # CUDA only
            self._read_ahead()
        return torch.empty(0, dtype=packed.dtype, device=stored.device).set_(
            data.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _load(self, stored: _Stored) -> None:
        if stored.state is StoredState.ON_NVME:
            self.swapper.read_ahead(stored.blob)
            self._count_host(stored.nbytes)
            for stats in (self.stats, self.window_stats):
                stats.reads_not_ahead += 1
        else:
            self._reading -= 1
        data = self.swapper.read(stored.blob)
        for stats in (self.stats, self.window_stats):
            stats.read_bytes += stored.nbytes
        stored.state, stored.data = StoredState.LOADED, data
        if stored.device.type == "cuda":  # CUDA only: the host copy goes once on the device
            stored.data = data.to(stored.device)
            self._host_bytes -= stored.nbytes

    def _to_device(self, stored: _Stored) -> torch.Tensor:
        """CUDA only: a kept host copy back on the device, kept there for the other saved views."""
        if stored.copied is not None:  # after the copy that filled it, on the device: the host goes on
            torch.cuda.current_stream(stored.device).wait_event(stored.copied)
            stored.copied = None
        stored.data = stored.data.to(stored.device, non_blocking=True)
        self._kept.pop(stored.seq, None)
        self._host_bytes -= stored.nbytes
        stored.state = StoredState.LOADED
        return stored.data

    def _read_ahead(self) -> None:
        """Start reads of the spilled storages backward needs next, within the budget (one always)."""
        if not self._spilled:
            return
        if self._order is None:
            self._order = sorted(self._spilled, key=lambda s: s.order)
        while self._next < len(self._order):
            stored = self._order[self._next]
            if stored.state is StoredState.ON_NVME:
                if self._reading and self._host_bytes + stored.nbytes > self.budget:
                    return
                self.swapper.read_ahead(stored.blob)
                stored.state = StoredState.READING
                self._reading += 1
                self._count_host(stored.nbytes)
            self._next += 1

    # -- freeing -----------------------------------------------------------------------------------
    def _release(self, stored: _Stored) -> None:
        """A saved view was freed (autograd is done with it); the last one drops the storage."""
        with self._lock:
            stored.refs -= 1
            if stored.refs == 0:
                self._drop(stored)

    def _drop(self, stored: _Stored) -> None:
        state = stored.state
        if state is StoredState.GONE:
            return
        if state in (StoredState.HOST, StoredState.READING) or (
                state is StoredState.LOADED and stored.device.type == "cpu"):
            self._host_bytes -= stored.nbytes
        if state is StoredState.READING:
            self._reading -= 1
        self._kept.pop(stored.seq, None)
        if stored.blob is not None and self.swapper is not None:
            self.swapper.forget(stored.blob)
        stored.data, stored.state = None, StoredState.GONE

    def _count_host(self, nbytes: int) -> None:
        self._host_bytes += nbytes
        for stats in (self.stats, self.window_stats):
            stats.peak_host_bytes = max(stats.peak_host_bytes, self._host_bytes)

    @property
    def host_bytes(self) -> int:
        """Bytes of saved storages now held in host memory."""
        return self._host_bytes
