"""Where a rank's parameter shards live between uses: the device, host memory or NVMe.

The shards are in the compute dtype (fp16/bf16/fp32), but those of frozen units
with ``zero_quantized_nontrainable_weights``, which are int8 with fp32 scales
(quantized.py, [Note: frozen weights stored quantized]). ``offload_param.device``
picks the store: ``none`` keeps them on the compute device, ``cpu`` in host
memory (pinned when computing on CUDA and ``pin_memory``), ``nvme`` in swap
files through :class:`swapper.PartitionedParamSwapper`.

[Note: a resident fp32 shard store can be the fp32 master itself]
With fp32 compute, when the parameter shards and the optimizer's fp32 master
weights would sit in the same memory (both on the device, or both in host
memory), :class:`FlatParamStore` is handed the master tensor and keeps no
copy: the optimizer step updates the shards in place and nothing is written
back. On one rank the unit's full buffer is then the shard itself, so
gathering a unit is pointing its parameters at a view (see runtime/unit.py).

[Note: on NVMe, an fp32 shard is read from the optimizer's master]
The same holds on NVMe: with fp32 compute and the optimizer on NVMe too,
:class:`NvmeParamStore` keeps no swap files of its own. Each shard's home is
its slice of the master region of its sub-group's optimizer swap file
(``PartitionedParamSwapper.store_at``): a step writes every parameter once,
with the optimizer state, instead of twice, and holds no pool buffers for
parameter writes (what that saves per step: bench/RESULTS.md, "Training
beyond memory"). A shard whose sub-group is still in the
optimizer's host memory (stepped last, its write in flight) is copied from
there instead of read, and the optimizer swapper completes the reads of a
sub-group's shards before it rewrites the file (``on_rewrite``).

[Note: host-resident shards are read ahead onto the GPU]
With ``offload_param.device: cpu`` and CUDA compute, a unit's shard crosses to the GPU when the
unit is gathered. Copied on the copy stream from registered memory, that overlaps the kernels
already queued, but only as far as the CPU runs ahead of the GPU. So :class:`FlatParamStore`
reads ahead as the NVMe store does, the read being the host-to-device copy itself: the
prefetcher (runtime/prefetch.py) starts the copies of the next units in the trace (within
``stage3_prefetch_bucket_size`` and the live-parameter bound: device memory), each on the copy
stream with nothing waiting for it (runtime/host_to_device.py ``AheadCopy``), and the unit's
gather takes the copy, the compute stream waiting for that copy's event alone. The copies not
yet taken hold at most ``stage3_prefetch_bucket_size`` elements' bytes of device memory (as
DeepSpeed's prefetch buffer), besides the live-parameter bound that counts them. A copy not yet
taken is dropped when its shard changes: :meth:`FlatParamStore.write`, and after a step or a
load every one (the fp32 master the store may be is stepped in place, unseen by ``write``).

[Note: writes from the device land before a shard is read]
With the optimizer on the GPU (``offload_optimizer: none``), a step writes each shard back from
the device into pinned host memory: an asynchronous copy on the compute stream, which the copy
stream (the reads ahead, a gather's copy) and the CPU (a checkpoint reading the shards) do not
wait for. So a write from the device records an event after its copy, and the store waits for
the latest one (each event follows the one before it) before anything reads a host shard: the
copy stream, on the device, for a copy ahead (:meth:`FlatParamStore.prefetch`), so the CPU goes
on queueing the next forward while the step's copies run; the CPU in :meth:`FlatParamStore.fetch`
of a shard not copied ahead and in :meth:`FlatParamStore.flush`.
"""
from __future__ import annotations

import abc
import contextlib
import logging

import time
import warnings
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from nvmeio import AioSettings

from swapper.host_memory import align_up

from ..config import ConfigError, Problem
from ..config.offload import min_swap_bytes
from .layouts import RankLayout, SubGroup, UnitLayout
from .pinned_host import for_gpu_copies
from .quantized import NOT_QUANTIZED, FrozenShards

_PACKED_ALIGN = 64  # each quantized shard's place in the registered block starts on a cache line


def swap_checksum(setting: str):
    """The swapper's ``checksum`` for an offload section's ``checksum`` key ("auto": xxhash or
    crc32c when installed, else off with a warning; see [Note: checksum default] in
    zero/config/offload.py)."""
    from swapper.checksum import ChecksumAlgorithm, fastest_available

    if setting == "none":
        return None
    if setting != "auto":
        return setting
    best = fastest_available()
    if best is ChecksumAlgorithm.CRC32:
        global _WARNED_NO_FAST_CHECKSUM
        if not _WARNED_NO_FAST_CHECKSUM:
            _WARNED_NO_FAST_CHECKSUM = True
            logging.getLogger("zero").warning(
                "swap-file checksums are off: neither xxhash nor crc32c is installed (pip install "
                "'nvmeio[checksum]'); set offload_param/offload_optimizer checksum to 'crc32' to use the "
                "standard library's, at a measured 20-40% of a fast step")
        return None
    return best


_WARNED_NO_FAST_CHECKSUM = False


def several_drives(section) -> bool:
    """Whether an offload section's swap files are striped: ``nvme_path`` a list of several drives."""
    path = section.nvme_path
    return section.device == "nvme" and isinstance(path, (list, tuple)) and len(path) > 1


def gds_pool(aio, compute_device, striped: bool = False) -> bool:
    """Whether the parameter swap pool is GPU memory (swapper/_pool_kind.py [Note: a parameter
    pool on the GPU]): ``aio.use_gds`` with a CUDA compute device, where cuFile moves CUDA tensors
    by DMA (``nvmeio.gds_device_path()`` "cufile") and the swap files are not ``striped`` over
    drives (a striped file takes host buffers). Without a GPUDirect path the gds_handle would
    bounce a GPU pool through host memory anyway, through staging buffers of each of the
    swapper's handles: the pool stays in host memory there."""
    from nvmeio import gds_device_path

    return (AioSettings.coerce(aio).use_gds and str(getattr(compute_device, "type", compute_device)).startswith("cuda")
            and not striped and gds_device_path() == "cufile")


def gds_checksum(setting: str):
    """The parameter swapper's checksum with its pool on the GPU: none ("auto" turns it off there,
    as DeepSpeed has none); a named algorithm is refused, naming both settings."""
    if setting in ("auto", "none"):
        return None
    raise ConfigError([Problem("zero_optimization.offload_param.checksum", (
        f"{setting!r} hashes the host bytes of each swap, and with aio.use_gds the parameter swap buffers are "
        f"GPU memory read from and written to the drive directly; set checksum to 'auto' or 'none' here "
        f"(offload_optimizer keeps its own), or use_gds to false"))])


def unit_id(layout: UnitLayout) -> str:
    """The stable swap id of a unit's shard (never ``id()``): its index and module name."""
    return f"unit{layout.index}.{layout.module_name or 'root'}"


class ParamStore(abc.ABC):
    """Interface of the shard stores; see the concrete classes."""

    resident = True  # every shard is a tensor that lives as long as the store, updated in place
    read_wait_seconds = 0.0  # blocked on NVMe reads (wall_clock_breakdown)
    write_wait_seconds = 0.0  # blocked handing shards to NVMe writes (a full pool waits for writes)
    frozen: FrozenShards = NOT_QUANTIZED  # the units stored quantized

    def as_stored(self, layout: UnitLayout, values: torch.Tensor) -> torch.Tensor:
        """The fp32 values :meth:`fetch` will give back after ``write(layout, values)``, where they
        differ from ``values`` (a quantized shard's): what the unit's fp32 master holds."""
        return self.frozen.as_stored(layout, values)

    def keep_unchanged(self, layout: UnitLayout, values: torch.Tensor) -> None:
        """A step left the shard's master as it was (no trainable parameter in it): nothing to
        write where the store holds its own copy, which equals it already."""

    @abc.abstractmethod
    def init_shard(self, layout: UnitLayout, values: torch.Tensor) -> None:
        ...

    @abc.abstractmethod
    def fetch(self, layout: UnitLayout, widen: bool = False) -> torch.Tensor:
        """The shard's values, readable until :meth:`fetched`; ``widen``: a quantized shard's in
        fp32 (its master's values) rather than rounded to the compute dtype."""
        ...

    def resident_shard(self, layout: UnitLayout) -> Optional[torch.Tensor]:
        """The shard itself when it lives in memory for good (updated in place by :meth:`write`)."""
        return None

    def fetched(self, layout: UnitLayout) -> None:
        """The caller is done with the tensor :meth:`fetch` returned."""

    def fetched_a_copy(self, layout: UnitLayout) -> bool:
        """Whether the tensor :meth:`fetch` just returned is a copy made for the caller alone (a
        dequantized shard, a copy read ahead onto the device), which one rank may keep as its
        unit's buffer instead of copying it once more."""
        return self.frozen.packs(layout)

    def lend(self, layout: UnitLayout) -> bool:
        """Whether the caller may go on viewing the tensor :meth:`fetch` just returned until it
        calls :meth:`fetched` (instead of copying it first); True records the loan."""
        return False

    def prefetch(self, layouts: Iterable[UnitLayout]) -> int:
        """Start bringing these shards in (NVMe); a later :meth:`fetch` finds them ready. Returns
        how many of them, from the first, are on their way (the rest found no room)."""
        return 0

    def prefetch_capacity(self) -> int:
        """Bytes of shards that may be read ahead now (see :meth:`prefetch_cost`)."""
        return 0

    def prefetch_cost(self, layout: UnitLayout) -> int:
        """Bytes of :meth:`prefetch_capacity` that prefetching this shard takes."""
        return 0

    def prefetch_batch_bytes(self) -> int:
        """Read ahead in batches of at least this many bytes when room is what limits it."""
        return 0

    def prefetch_room(self) -> int:
        """The bytes :meth:`prefetch_capacity` gives with nothing read ahead or lent."""
        return 0

    def drop_prefetched(self, keep: Iterable[int] = ()) -> None:
        """Give back the memory of prefetched shards that were not fetched, but those of the unit
        indices in ``keep``."""

    @property
    def reads_ahead(self) -> bool:
        """Whether :meth:`prefetch` brings shards closer (the prefetcher asks first)."""
        return not self.resident

    @abc.abstractmethod
    def write(self, layout: UnitLayout, values: torch.Tensor) -> None:
        """Replace the shard with ``values`` (any dtype/device; cast on copy)."""
        ...

    def flush(self) -> None:
        """Complete writes in flight."""

    def discard_unsaved(self) -> None:
        """Drop shard values whose write failed (a checkpoint load replaces every shard)."""

    def check_free_space(self) -> None:
        """Refuse now if the shards' swap files will not fit (before the model is handed over)."""

    def close(self) -> None:
        pass


class FlatParamStore(ParamStore):
    """All shards of this rank in one flat tensor on ``device`` (``none``) or the host (``cpu``);
    the quantized ones (``frozen``) each in a packed tensor of its own there, outside the flat
    tensor (which then holds only the others, unless it is the master itself)."""

    def __init__(self, rank_layout: RankLayout, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False, flat: Optional[torch.Tensor] = None,
                 frozen: FrozenShards = NOT_QUANTIZED, compute_device: Optional[torch.device] = None,
                 copy_ahead=None, ahead_bytes: int = 0, staged_writes=None):
        self.rank_layout = rank_layout
        # staged_writes: runtime/write_back.py StagedWrites, for shards on the GPU written from host
        # values (a host or NVMe optimizer's step); None where the shards are not on a GPU.
        self.staged_writes = staged_writes
        # copy_ahead(shard, device, after=event): an object whose take() is the shard on the compute
        # device, copied after the event (see the notes on read-ahead and on writes from the device);
        # None where the shards need no copy to be computed on.
        self.copy_ahead = copy_ahead
        self.ahead_bytes = ahead_bytes  # the most the copies not yet taken may hold
        self._ahead: Dict[int, Tuple[object, int]] = {}  # unit index -> (its copy started ahead, bytes)
        self.dtype = dtype
        self.frozen = frozen
        self.compute_device = compute_device or device  # where quantized shards are dequantized
        self.aliased = flat is not None
        self._ranges = {u.index: rank_layout.unit_range(u.index) for u in rank_layout.units}
        # pin_memory: host memory registered for the flat tensor of its own (a given one is the
        # optimizer's master, pinned by it) and for the quantized shards, which are read ahead too
        self._pinned = for_gpu_copies(pin_memory) if device.type == "cpu" else None
        if flat is None:
            end, self._ranges = 0, {}
            for u in rank_layout.units:
                if not frozen.packs(u):
                    self._ranges[u.index] = (end, end + u.shard_numel)
                    end += u.shard_numel
            if self._pinned is not None:
                flat = self._pinned.empty(end, dtype)
            else:
                flat = torch.empty(end, dtype=dtype, device=device)
        self.flat = flat
        self._packed: Dict[int, torch.Tensor] = {}  # unit index -> its quantized shard
        # with pin_memory, the quantized shards' places in one registered block (see _pack)
        self._packed_places: Dict[int, torch.Tensor] = {}
        packs = [u for u in rank_layout.units if frozen.packs(u)]
        if self._pinned is not None and packs:
            sizes = [align_up(frozen.nbytes(u), _PACKED_ALIGN) for u in packs]
            block, start = self._pinned.empty(sum(sizes)), 0
            for u, size in zip(packs, sizes):
                self._packed_places[u.index] = block[start:start + frozen.nbytes(u)]
                start += size
        self._writing = None  # the event after the latest write from the device still in flight (see the note)
        self._took_copy: Optional[int] = None  # the unit whose copy made ahead the last fetch took (fetched_a_copy)

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
        if self.staged_writes is not None:
            self.staged_writes.close()

    def shard(self, layout: UnitLayout) -> torch.Tensor:
        start, stop = self._ranges[layout.index]
        return self.flat[start:stop]

    def init_shard(self, layout: UnitLayout, values: torch.Tensor) -> None:
        self._ahead.pop(layout.index, None)
        if self.frozen.packs(layout):
            self.write(layout, values)
        elif self._writes_own(layout):
            self.shard(layout).copy_(values)

    def _writes_own(self, layout: UnitLayout) -> bool:
        """Whether the store writes the shard's values: in a flat tensor that is the master, the
        optimizer writes the trainable units' (layouts.py: the frozen ones have no master of theirs)."""
        return not self.aliased or layout.index in self.rank_layout.frozen

    def _stored(self, layout: UnitLayout) -> torch.Tensor:
        """What the store holds for the shard: its packed bytes or its slice of the flat tensor."""
        return self._packed[layout.index] if self.frozen.packs(layout) else self.shard(layout)

    def fetch(self, layout: UnitLayout, widen: bool = False) -> torch.Tensor:
        ahead = self._ahead.pop(layout.index, None)
        if ahead is None:
            self.flush()  # the caller reads the host shard
        self._took_copy = None if ahead is None else layout.index
        stored = ahead[0].take() if ahead is not None else self._stored(layout)
        if self.frozen.packs(layout):
            return self.frozen.decode(layout, stored, torch.float32 if widen else self.dtype, self.compute_device)
        return stored

    def fetched_a_copy(self, layout: UnitLayout) -> bool:
        return self._took_copy == layout.index or super().fetched_a_copy(layout)

    # -- read-ahead onto the compute device (see the note) -----------------------------------------
    @property
    def reads_ahead(self) -> bool:
        return self.copy_ahead is not None

    def prefetch(self, layouts: Iterable[UnitLayout]) -> int:
        started = 0
        for layout in layouts:
            if layout.index not in self._ahead and layout.shard_numel > 0:
                # the copy stream reads the host shard once the writes from the device landed (see the note)
                self._ahead[layout.index] = (self.copy_ahead(self._stored(layout), self.compute_device,
                                                             after=self._writing), self.prefetch_cost(layout))
            started += 1
        return started

    def prefetch_capacity(self) -> int:
        return max(0, self.ahead_bytes - sum(nbytes for _, nbytes in self._ahead.values()))

    def prefetch_room(self) -> int:
        return self.ahead_bytes

    def prefetch_cost(self, layout: UnitLayout) -> int:
        stored = self._stored(layout)
        return stored.numel() * stored.element_size()

    def drop_prefetched(self, keep: Iterable[int] = ()) -> None:
        for index in set(self._ahead).difference(keep):
            del self._ahead[index]

    def resident_shard(self, layout: UnitLayout) -> Optional[torch.Tensor]:
        return None if self.frozen.packs(layout) else self.shard(layout)

    def write(self, layout: UnitLayout, values: torch.Tensor) -> None:
        self._ahead.pop(layout.index, None)  # a copy started before this write holds the old values
        if values.device.type != self.compute_device.type:
            self.flush()  # a write from the device still in flight would land over these host values
        if self.frozen.packs(layout):
            self._packed[layout.index] = self._pack(layout, values)
        elif self._writes_own(layout):
            shard = self.shard(layout)
            if self.staged_writes is not None and self.staged_writes.takes(values, shard):
                self.staged_writes.write(shard, values)  # runtime/write_back.py [Note: a write-back goes through registered staging]
                return
            if values.device != shard.device and values.dtype != shard.dtype:
                values = values.to(shard.dtype)  # cast where the values are: 16-bit shards cross in 2 bytes
            shard.copy_(values, non_blocking=True)
            landing = copy_landing(values, shard, after=self._writing)
            if landing is not None:
                self._writing = landing

    def _pack(self, layout: UnitLayout, values: torch.Tensor) -> torch.Tensor:
        """A frozen unit's int8 shard. With ``pin_memory``, in its place in one registered block:
        its read-ahead from pageable memory would be a copy the driver stages while the CPU waits,
        and one registration per unit would map each on whole pages. A rewrite (a checkpoint load)
        goes into the same bytes, as the flat shards' do."""
        encoded = self.frozen.encode(layout, values)
        place = self._packed_places.get(layout.index)
        if place is None:
            return encoded.to(self.flat.device)
        return place.copy_(encoded)

    def flush(self) -> None:
        """Writes from the device into host shards have landed (see the note). Writes into shards
        on the device need no wait: what reads them is queued after them on the same stream."""
        if self._writing is not None:
            self._writing.synchronize()
            self._writing = None


def copy_landing(source: torch.Tensor, dest: torch.Tensor, after=None):
    """The event after an asynchronous copy from CUDA ``source`` into host ``dest`` just queued on
    the current stream, and after the event ``after`` (so the latest event stands for every write,
    from whichever stream); None for any other copy (it has landed: see [Note: writes from the
    device land before a shard is read])."""
    if source.device.type != "cuda" or dest.device.type != "cpu":
        return None
    stream = torch.cuda.current_stream(source.device)
    if after is not None:
        stream.wait_event(after)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def swap_buffer_count(offload, largest_shard: int, total_numel: int) -> int:
    """The parameter swapper's pool, in buffers of the largest shard (rather than of
    ``buffer_size``). Its spans hold each shard in its own size, so the ``buffer_count x
    buffer_size`` elements the user allowed hold more shards in flight (fewer waits for room,
    read-ahead further ahead), up to 4x ``buffer_count`` buffers and a quarter of the rank's
    parameters (more would not be in flight at once)."""
    allowed = min(offload.buffer_count * offload.buffer_size, total_numel // 4)
    return max(offload.buffer_count, min(allowed // max(1, largest_shard), 4 * offload.buffer_count))


class NvmeParamStore(ParamStore):
    """Shards in swap files under ``offload_param.nvme_path``, one file per unit.

    The first ``max_in_cpu`` elements stay in host memory, and so does every shard under
    ``min_swap_bytes`` (both DeepSpeed's rules; zero/config/offload.py ``min_swap_bytes``).
    The pool holds ``swap_buffer_count`` buffers' worth of the largest shard and
    gives each shard a span of its own size (swapper/_span_pool.py, [Note:
    read-ahead bounded by bytes, not by buffers]); ``offload_param.buffer_size``
    smaller than the largest shard is refused when the engine is built. The
    last :data:`SPARE_BUFFERS` buffers' worth is kept for a fetch that was not
    prefetched and for writes: prefetched and lent (:meth:`lend`) shards never
    hold it. Reads go through :data:`READ_QUEUES` handles, so a fetch waits for
    its own batch of reads only (see the note in swapper/_param_swapper.py):
    read-ahead goes in batches of at least 1/:data:`READ_AHEAD_BATCHES` of the
    room, each on a queue of its own, one queue left for a fetch.
    """

    resident = False
    READ_QUEUES = 8
    WRITE_QUEUES = 4  # a full pool waits for the oldest writes only (swapper/_io_queue.py WriteRing)
    SPARE_BUFFERS = 2
    READ_AHEAD_BATCHES = READ_QUEUES - 1

    def __init__(self, rank_layout: RankLayout, dtype: torch.dtype, offload, aio, job_id: str, rank: int,
                 master=None, frozen: FrozenShards = NOT_QUANTIZED, compute_device: torch.device = torch.device("cpu")):
        from swapper import PackedSpans, PartitionedParamSwapper
        from swapper import HOME_SLACK_BYTES

        self.rank_layout = rank_layout
        self.dtype = dtype
        self.frozen = frozen
        self.compute_device = compute_device  # where quantized shards are dequantized
        # An NvmeOptimizerStore whose fp32 master holds the shards (see the module's note), or None.
        self.master = master
        largest = max((u.shard_numel for u in rank_layout.units), default=1)
        if offload.buffer_size < largest:
            unit = max(rank_layout.units, key=lambda u: u.shard_numel)
            raise ConfigError([Problem("zero_optimization.offload_param.buffer_size", (
                f"{offload.buffer_size} elements is smaller than the largest parameter partition "
                f"({largest} elements, module '{unit.module_name or '<root>'}' on this rank); each "
                f"partition must fit one buffer: set buffer_size >= {largest}"))])
        count = swap_buffer_count(offload, largest, rank_layout.numel)
        # With use_gds on a GPU the pool is GPU memory: drive <-> GPU (swapper/_pool_kind.py
        # [Note: a parameter pool on the GPU]); its bytes are never on the host to hash.
        striped = several_drives(offload) or (master is not None and master.swapper.swap_dir.striped)
        on_device = gds_pool(aio, compute_device, striped)
        checksum = gds_checksum(offload.checksum) if on_device else swap_checksum(offload.checksum)
        self.swapper = PartitionedParamSwapper(
            offload.nvme_path, aio, buffer_count=count,
            buffer_size=max(1, largest) + (HOME_SLACK_BYTES // 4 if master is not None else 0),
            max_in_cpu=offload.max_in_cpu, dtype=dtype, job_id=job_id, rank=rank, name="params",
            min_swap_bytes=min_swap_bytes(offload, AioSettings.coerce(aio).block_size),
            pin_memory=offload.pin_memory, remove_stale=True, checksum=checksum,
            read_queues=self.READ_QUEUES, write_queues=self.WRITE_QUEUES,
            pool=PackedSpans(spare_buffers=min(self.SPARE_BUFFERS, count),
                             device=compute_device if on_device else None))
        self._ids = {u.index: unit_id(u) for u in rank_layout.units}
        if compute_device.type == "cuda" and not on_device:
            why = self.swapper.pool.register_with_cuda()
            if why is not None:
                warnings.warn(f"nvmeio: the parameter swap pool could not be registered with CUDA ({why}); "
                              "training goes on, with slower copies to the GPU", RuntimeWarning, stacklevel=2)
        try:
            for u in rank_layout.units:
                if frozen.packs(u):  # its packed bytes (max_in_cpu counts them as elements)
                    self.swapper.register(self._ids[u.index], frozen.nbytes(u), torch.uint8)
                else:
                    self.swapper.register(self._ids[u.index], u.shard_numel)
        except BaseException:
            self.swapper.cleanup()  # never returned, so never closed by the caller
            raise
        # Unit index -> pool bytes, of the shards read ahead and not fetched yet, and of the fetched
        # shards whose pool buffers their units view (lent).
        self._prefetched: Dict[int, int] = {}
        self._lent: Dict[int, int] = {}
        if master is not None:
            master.swapper.on_rewrite = self._settle_sub_group

    def _homed(self, layout: UnitLayout) -> bool:
        """Whether the shard is the optimizer's master (a frozen unit has none: layouts.py)."""
        return (self.master is not None and layout.shard_numel > 0 and not self.frozen.packs(layout)
                and layout.index not in self.rank_layout.frozen)

    def _settle_sub_group(self, sub_group_index: int) -> None:
        self.swapper.settle([self._ids[i] for i in self.rank_layout.sub_groups[sub_group_index].units])

    def _fill_from_master(self, layouts: Iterable[UnitLayout]) -> List[UnitLayout]:
        """Copy the shards whose master is in host memory into pool buffers; returns the others."""
        from swapper import PartitionState

        rest = []
        for u in layouts:
            pid = self._ids[u.index]
            values = None
            if self._homed(u) and self.swapper.state(pid) is PartitionState.ON_NVME:
                values = self.master.resident_master(u.index)
                if values is None and self.master.reading_master(u.index):
                    values = self.master.await_master(u.index)  # read once (see the note)
            if values is None:
                rest.append(u)
            else:
                self.swapper.fill([pid], [values])
        return rest

    def init_shard(self, layout: UnitLayout, values: torch.Tensor) -> None:
        self.write(layout, values)

    def fetch(self, layout: UnitLayout, widen: bool = False) -> torch.Tensor:
        t0 = time.perf_counter()
        self._fill_from_master([layout])
        tensor = self.swapper.swap_in([self._ids[layout.index]])[0]
        self.read_wait_seconds += time.perf_counter() - t0
        self._prefetched.pop(layout.index, None)
        if self.frozen.packs(layout):  # a tensor of its own; the pool buffer goes back at fetched(), after
            # the unit's copies (on CUDA it synchronizes first: runtime/unit.py)
            return self.frozen.decode(layout, tensor, torch.float32 if widen else self.dtype, self.compute_device)
        return tensor

    def fetched(self, layout: UnitLayout) -> None:
        self._lent.pop(layout.index, None)
        self.swapper.release_or_write([self._ids[layout.index]])  # retries a write that failed

    def lend(self, layout: UnitLayout) -> bool:
        from swapper import PartitionState

        pid = self._ids[layout.index]
        # A shard in the spare region is copied instead: that memory must come back at once; a
        # quantized one is never in the pool in the compute dtype.
        if (self.frozen.packs(layout) or self.swapper.state(pid) is not PartitionState.AVAILABLE
                or self.swapper.in_spare(pid)):
            return False
        self._lent[layout.index] = self.swapper.buffer_bytes(pid)
        return True

    def resident_shard(self, layout: UnitLayout) -> Optional[torch.Tensor]:
        from swapper import PartitionState

        pid = self._ids[layout.index]
        if self.frozen.packs(layout) or self.swapper.state(pid) is not PartitionState.IN_CPU:
            return None
        return self.swapper.swap_in([pid])[0]  # the partition's host tensor; no I/O

    def prefetch_capacity(self) -> int:
        held = sum(self._prefetched.values()) + sum(self._lent.values())
        return max(0, self.swapper.pool.main_bytes - held)

    def prefetch_cost(self, layout: UnitLayout) -> int:
        return self.swapper.buffer_bytes(self._ids[layout.index]) if layout.shard_numel else 0

    def prefetch_batch_bytes(self) -> int:
        return self.swapper.pool.main_bytes // self.READ_AHEAD_BATCHES

    def prefetch_room(self) -> int:
        return self.swapper.pool.main_bytes

    def prefetch(self, layouts: Iterable[UnitLayout]) -> int:
        layouts = list(layouts)
        costs = [self.prefetch_cost(u) for u in layouts]
        total = sum(costs)
        batches = max(1, min(len(layouts), total // max(1, self.prefetch_batch_bytes())))
        first, done = 0, 0
        for b in range(1, batches + 1):  # cut where the running bytes pass b/batches of the total
            end = first
            while end < len(layouts) and (b == batches or done < total * b // batches):
                done += costs[end]
                end += 1
            batch = [u for u in layouts[first:end] if u.index not in self._prefetched and u.shard_numel > 0]
            started = self._read_ahead(batch)
            if started < len(batch):
                return layouts.index(batch[started])
            first = end
        return len(layouts)

    def _read_ahead(self, layouts: List[UnitLayout]) -> int:
        """Starts one batch (one read queue); returns how many, from the first, are on their way."""
        if not layouts:
            return 0
        from swapper import PartitionState

        ids = [self._ids[u.index] for u in layouts]
        copies = {}  # shards whose master the optimizer holds in memory: copied, not read
        for at, (u, pid) in enumerate(zip(layouts, ids)):
            if self._homed(u) and self.swapper.state(pid) is PartitionState.ON_NVME:
                values = self.master.resident_master(u.index)
                if values is None and self.master.reading_master(u.index):
                    # Its sub-group's state is being read for the step: this shard comes from that
                    # read (see the note); this read-ahead stops here until it has landed.
                    values = self.master.resident_master(u.index)
                    if values is None:
                        layouts, ids = layouts[:at], ids[:at]
                        break
                if values is not None:
                    copies[pid] = values
        started = self.swapper.read_ahead(ids, copies)
        for u, pid in zip(layouts[:started], ids):
            self._prefetched[u.index] = self.swapper.buffer_bytes(pid)
        return started

    def drop_prefetched(self, keep: Iterable[int] = ()) -> None:
        dropped = sorted(set(self._prefetched).difference(keep))
        if dropped:
            self.swapper.release_or_write([self._ids[i] for i in dropped])
            for i in dropped:
                del self._prefetched[i]

    def write(self, layout: UnitLayout, values: torch.Tensor) -> None:
        t0 = time.perf_counter()
        pid = self._ids[layout.index]
        if self._homed(layout):  # values are the master's, which the optimizer store writes
            self.swapper.store_at([pid], [self.master.master_home(layout.index)], [values])
            self.write_wait_seconds += time.perf_counter() - t0
            return
        if self.frozen.packs(layout):
            values = self.frozen.encode(layout, values)
        self.swapper.swap_out_tensors([pid], [values], async_op=True)
        if layout.index in self._lent:  # its unit views the buffer: keep it once written
            self.swapper.swap_in([pid], async_op=True)
        self.write_wait_seconds += time.perf_counter() - t0

    def keep_unchanged(self, layout: UnitLayout, values: torch.Tensor) -> None:
        if self._homed(layout):  # recorded at its home again, as the master's file is rewritten: no I/O
            self.write(layout, values)

    def flush(self) -> None:
        self.swapper.flush_writes()  # reads ahead for the next forward go on

    def discard_unsaved(self) -> None:
        self.swapper.discard_unsaved()

    def check_free_space(self) -> None:
        if self.master is None:
            self.swapper.check_free_space()
            return
        # homed shards take no space of their own (the master's file holds them): only the others
        own = sum(self.frozen.nbytes(u) if self.frozen.packs(u) else u.shard_numel * self.dtype.itemsize
                  for u in self.rank_layout.units if not self._homed(u))
        self.swapper.check_free_space(own_bytes=own)

    @property
    def swap_dir(self) -> str:
        return self.swapper.swap_dir.path

    def close(self) -> None:
        self._lent.clear()  # the pool's memory lives on in the views of units still gathered
        if self.master is not None:
            self.master.swapper.on_rewrite = None  # its last writes have no reads of ours to wait for
        self.swapper.cleanup()


class MasterFromParameters:
    """The checkpointed state of sub-groups no optimizer holds (an engine without one, for
    inference; the frozen sub-groups of one that has: layouts.py [Note: the optimizer covers the
    trainable units only]): each sub-group's master is its parameters' shards, in fp32, and there
    are no other states. Implements the checkpoint protocol of optimizer_store.py ([Note: each
    store saves and loads its own state])."""

    state_names: tuple = ()

    def __init__(self, rank_layout: RankLayout, params: ParamStore):
        self.rank_layout = rank_layout
        self.params = params

    def read(self, sub_group: SubGroup) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        master = torch.empty(sub_group.numel, dtype=torch.float32)
        for index in sub_group.units:
            unit = self.rank_layout.units[index]
            start, stop = self.rank_layout.unit_range(index)
            master[start - sub_group.start:stop - sub_group.start].copy_(self.params.fetch(unit, widen=True))
            self.params.fetched(unit)
        return master, {}

    @contextlib.contextmanager
    def viewed(self, sub_group: SubGroup) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        yield self.read(sub_group)

    def save_shard(self, sub_group: SubGroup, shards, path: str) -> None:
        master, _ = self.read(sub_group)
        shards.save_shard(path, sub_group.numel, ["master"], tensors={"master": master})

    def load_shard(self, sub_group: SubGroup, shard, path: str, keys, load_states: bool, carried=None) -> torch.Tensor:
        return shard.get_tensor("master")

    def stage_shard(self, sub_group: SubGroup, shard, path: str, keys, load_states: bool, algorithm):
        return None  # verified by a read of its own, then its master read (the parameters' values)

    def discard_staged(self, staged) -> None:
        pass

    def load(self, sub_group: SubGroup, master: torch.Tensor, states) -> None:
        """Nothing beside the parameters, which the engine writes from the master."""
