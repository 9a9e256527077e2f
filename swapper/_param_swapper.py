"""PartitionedParamSwapper: parameter partitions between pool buffers and NVMe, by stable id.

[Note: a partition lives in one pool buffer while in host memory]
As in DeepSpeed, a swapped-in partition occupies one whole pool buffer, so
``buffer_count`` bounds how many NVMe-resident partitions can be in memory at
once and ``buffer_size`` must hold the largest one. Unlike DeepSpeed, running
short is never an assert: ``buffer_size=None`` sizes the buffers from the
partitions registered before the first swap (the largest one), an explicit
``buffer_size`` too small for a partition is refused when that partition is
registered (naming both sizes), and a swap-in that finds no free buffer first
completes the writes in flight (which return theirs) and otherwise raises
:class:`PoolExhaustedError` naming the partitions that hold the buffers.
The first ``max_in_cpu`` elements registered (first fit, in registration
order) stay in ordinary host memory for good and never touch NVMe, and so does
every partition of fewer than ``min_swap_bytes`` bytes (DeepSpeed's swapper keeps
those under 1 MiB in host memory: an op costs as much for 4 KiB). Swap files
are named after the caller's ids (``param_<id>.swp``), which must therefore be
stable across runs: a parameter's name or its index, never ``id()``.

With ``pool=PackedSpans(spare_buffers=k)`` (_pool_kind.py) each partition takes
a span of its own size from the same bytes instead of a whole buffer, and
:meth:`read_ahead`, which never fails for want of room, stays out of the last
``k`` buffers' worth, kept for blocking swap-ins and writes.

[Note: a ring of read queues, so a fetch waits for its own read only]
A handle's ``wait()`` completes every op submitted on it (_io_queue.py), so
with one read queue a blocking :meth:`swap_in` of a prefetched partition waits
for every prefetch issued after it too: a forward reading ahead along its
trace would stall on the whole read-ahead at each module. ``read_queues`` > 1
gives the swapper that many read handles; each :meth:`swap_in` batch goes to
an idle one (else the next in turn), each partition remembers its queue, and
a blocking :meth:`swap_in` drains only the queues of the partitions it asked
for (and the writes of those being written), not every op in flight.
``write_queues`` > 1 does the same for writes (io_queue.WriteRing): a full pool
then waits for the oldest batch of writes, not for all of them.

Partitions stored in another owner's file (:meth:`store_at`): _partition.py,
[Note: a partition homed in another owner's file].
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from nvmeio import AioSettings
from nvmeio.striping import fspath

from ._buffer_pool import PoolBuffer, as_count
from .host_memory import PAGE_BYTES, align_up
from .checksum import ChecksumAlgorithm, ChecksumTable
from ._errors import BufferTooSmallError, SwapStateError, add_note
from ._io_queue import IoKind, WriteRing
from ._partition import HOME_SLACK_BYTES, Home, ParamId, Partition, PartitionState, swap_file_name
from ._pool_kind import PoolKind, WholeBuffers
from ._swap_dir import FreeSpaceFn
from ._swapper_base import SwapperBase

def _on_host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s elements as host memory of ``dtype`` (itself when it is that already)."""
    return t.detach().reshape(-1).to(device="cpu", dtype=dtype)


class PartitionedParamSwapper(SwapperBase):
    """Swaps parameter partitions, registered by stable id, between NVMe and pool buffers.

    Files live in ``<nvme_path>/<job_id>/rank<rank>/<name>/``. ``aio_config`` is a
    DeepSpeed ``aio`` dict or :class:`nvmeio.AioSettings`; ``buffer_size`` and ``max_in_cpu``
    count elements of ``dtype`` (integral floats such as ``1e8`` are accepted); ``pool`` is the
    kind of pool they make (_pool_kind.py: :class:`WholeBuffers`, the default, or
    :class:`PackedSpans`).
    ``checksum`` (``"xxhash"``, ``"crc32c"``, ``"crc32"`` or ``None``) verifies every
    swap-in. Tensors returned by :meth:`swap_in` / :meth:`get_buffer` view pool
    memory: they are valid until the partition is released or swapped out.
    Not thread-safe: one thread drives a swapper.
    """

    _State = PartitionState
    _entry_noun = "parameter partitions"

    def __init__(
        self,
        nvme_path,
        aio_config: Union[AioSettings, dict, None] = None,
        buffer_count: int = 5,
        buffer_size: Optional[int] = int(1e8),
        max_in_cpu: int = int(1e9),
        dtype: torch.dtype = torch.float32,
        *,
        min_swap_bytes: int = 0,
        job_id: str = "default",
        rank: int = 0,
        name: str = "params",
        checksum: Union[str, ChecksumAlgorithm, ChecksumTable, None] = None,
        pin_memory: bool = True,
        free_space_fn: Optional[FreeSpaceFn] = None,
        remove_stale: bool = False,
        read_queues: int = 1,
        write_queues: int = 1,
        pool: PoolKind = WholeBuffers(),
    ):
        config = AioSettings.coerce(aio_config)
        read_queues = as_count(read_queues, "read_queues")
        write_queues = as_count(write_queues, "write_queues")
        self.buffer_count = as_count(buffer_count, "buffer_count")
        self.buffer_size = None if buffer_size is None else as_count(buffer_size, "buffer_size")
        if max_in_cpu < 0 or max_in_cpu != int(max_in_cpu):
            raise ValueError(f"max_in_cpu must be a non-negative integer, got {max_in_cpu!r}")
        self.max_in_cpu = int(max_in_cpu)
        if isinstance(min_swap_bytes, bool) or not isinstance(min_swap_bytes, int) or min_swap_bytes < 0:
            raise ValueError(f"min_swap_bytes must be a non-negative int, got {min_swap_bytes!r}")
        self.min_swap_bytes = min_swap_bytes
        if getattr(pool, "device", None) is not None and checksum is not None:
            raise ValueError("swap checksums are of host bytes, and a pool on the GPU never holds the bytes in host "
                             "memory: pass checksum=None with a device pool (_pool_kind.py [Note: a parameter pool "
                             "on the GPU])")
        if pool.spare_buffers > self.buffer_count:
            raise ValueError(f"spare_buffers must be an integer from 0 to buffer_count ({self.buffer_count}), "
                             f"got {pool.spare_buffers!r}")
        self._parts: Dict[ParamId, Partition] = {}
        self._by_file: Dict[str, ParamId] = {}
        self._cpu_numel = 0  # under max_in_cpu
        self._small_numel = 0  # kept in host memory for their size (min_swap_bytes)
        self._nvme_bytes = 0
        super().__init__(
            nvme_path, config, dtype, job_id=job_id, rank=rank, name=name, checksum=checksum,
            pin_memory=pin_memory, free_space_fn=free_space_fn, remove_stale=remove_stale, pool_kind=pool,
        )
        self._writes = WriteRing(self._writes, self._new_queue, write_queues)
        self._spread_reads(read_queues)
        if self.buffer_size is not None:
            try:
                self._pool = self._make_pool(self.buffer_size)
            except BaseException:
                self.cleanup()  # the directory and the handles' threads, not only the directory
                raise

    def __repr__(self) -> str:
        return (
            f"PartitionedParamSwapper({self.swap_dir.path!r}, partitions={len(self._parts)}, "
            f"in_cpu={self._cpu_numel} elements, pool={self._pool!r})"
        )

    # -- registration ------------------------------------------------------------------------
    def register(self, param_id: ParamId, numel: int, dtype: Optional[torch.dtype] = None) -> PartitionState:
        """Register a partition of ``numel`` elements; returns ``IN_CPU`` or ``UNWRITTEN`` (NVMe)."""
        self._check_open()
        if isinstance(param_id, bool) or not isinstance(param_id, (int, str)):
            raise TypeError(f"param_id must be an int or a str, got {type(param_id).__name__}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        file_name = swap_file_name(param_id)
        if param_id in self._parts or file_name in self._by_file:
            raise ValueError(f"partition id {param_id!r} is registered already")
        dtype = dtype or self.dtype
        part = Partition(param_id, numel, dtype, file_name, PartitionState.UNWRITTEN)
        small = self._small(part)
        if small or self._cpu_numel + numel <= self.max_in_cpu:
            part.state = PartitionState.IN_CPU
            part.cpu_tensor = torch.empty(numel, dtype=dtype)
            if small:
                self._small_numel += numel
            else:
                self._cpu_numel += numel
        else:
            capacity = self._buffer_nbytes()
            if capacity is not None and part.nbytes > capacity:
                origin = "buffer_size" if self.buffer_size is not None else "the pool, sized at first use,"
                raise BufferTooSmallError(
                    f"partition {param_id!r} has {numel} elements of {dtype} ({part.nbytes} bytes), but "
                    f"{origin} holds {capacity} bytes per buffer; set buffer_size >= "
                    f"{math.ceil(part.nbytes / self._itemsize())} or buffer_size=None to size buffers "
                    f"from the registered partitions"
                )
            self._nvme_bytes += part.nbytes
        self._parts[param_id] = part
        self._by_file[file_name] = param_id
        return part.state

    def remove(self, param_ids: Iterable[ParamId]) -> None:
        """Forget partitions: their buffers go back to the pool, their files are deleted."""
        parts = self._lookup(param_ids)
        if any(p.state in (PartitionState.READING, PartitionState.WRITING) for p in parts):
            self.synchronize()
        for p in parts:
            self._drop_buffer(p)
            if p.home is not None:
                self._unhome(p)  # counted on disk again, as below
            if p.cpu_tensor is not None and self._small(p):
                self._small_numel -= p.numel
            elif p.cpu_tensor is not None:
                self._cpu_numel -= p.numel
            else:
                self._nvme_bytes -= p.nbytes
            self.swap_dir.remove(p.file_name)
            if self._checksums is not None:
                self._checksums.forget(self.swap_dir.file(p.file_name))
            del self._parts[p.param_id]
            del self._by_file[p.file_name]

    # -- queries ------------------------------------------------------------------------------
    def state(self, param_id: ParamId) -> PartitionState:
        return self._lookup([param_id])[0].state

    def _small(self, part: Partition) -> bool:
        return part.nbytes < self.min_swap_bytes

    @property
    def cpu_numel(self) -> int:
        """Elements kept in host memory under ``max_in_cpu``."""
        return self._cpu_numel

    @property
    def small_numel(self) -> int:
        """Elements kept in host memory because their partitions are under ``min_swap_bytes``."""
        return self._small_numel

    @property
    def nvme_bytes(self) -> int:
        """Bytes the registered NVMe-resident partitions take on disk."""
        return self._nvme_bytes

    def buffer_bytes(self, param_id: ParamId) -> int:
        """The pool memory ``param_id`` takes while in a buffer (_pool_kind.py: one whole buffer, or
        its span); 0 for a partition kept in host memory."""
        part = self._lookup([param_id])[0]
        if part.cpu_tensor is not None:
            return 0
        return self.pool_kind.footprint(part.span_bytes(), self._buffer_nbytes())

    def in_spare(self, param_id: ParamId) -> bool:
        """Whether the partition's buffer lies in the pool's spare region (``PackedSpans``,
        _span_pool.py): memory kept for blocking swap-ins and writes, which should go back soon."""
        buffer = self._lookup([param_id])[0].buffer
        return buffer is not None and buffer.spare

    # -- data movement ------------------------------------------------------------------------
    def get_buffer(self, param_id: ParamId) -> torch.Tensor:
        """Memory to write new data of ``param_id`` into (then :meth:`swap_out` it).

        For an NVMe partition this takes a pool buffer without reading the file.
        """
        part = self._lookup([param_id])[0]
        if part.state in (PartitionState.READING, PartitionState.WRITING):
            self.synchronize()
        if part.cpu_tensor is not None:
            part.has_data = True
        elif part.buffer is None:
            part.buffer = self._acquire([part], "get_buffer")[0]
            part.state = PartitionState.AVAILABLE
        if part.home is not None:  # new data of its own: written to its own file again
            self._unhome(part)
        part.on_nvme = False
        return part.tensor()

    def swap_out_tensors(
        self, param_ids: Sequence[ParamId], tensors: Sequence[torch.Tensor], async_op: bool = False
    ) -> None:
        """Make ``tensors[i]`` the data of ``param_ids[i]`` and write it out.

        The tensors are copied (into pool buffers or the host copy), so they are
        free to reuse on return; the writes complete by :meth:`synchronize`
        unless ``async_op`` is false.
        """
        if len(param_ids) != len(tensors):
            raise ValueError(f"swap_out_tensors got {len(param_ids)} ids and {len(tensors)} tensors")
        parts = self._lookup(param_ids)
        for part, t in zip(parts, tensors):
            if t.numel() != part.numel:
                raise ValueError(f"partition {part.param_id!r} has {part.numel} elements, the tensor {t.numel()}")
        self._check_space()
        for part, t in zip(parts, tensors):
            self.get_buffer(part.param_id).copy_(t.reshape(-1))
            if part.cpu_tensor is None:
                self._submit_write(part)
        if not async_op:
            self._writes.drain()

    def swap_out(self, param_ids: Iterable[ParamId], async_op: bool = False) -> None:
        """Write the partitions held in buffers to NVMe; their buffers return to the pool.

        With ``async_op`` the writes complete by :meth:`synchronize`; until then the
        partitions are ``WRITING`` and their tensors must not be modified.
        Partitions kept in host memory or already on NVMe are left as they are.
        """
        parts = self._lookup(param_ids)
        for p in parts:
            if p.state is PartitionState.UNWRITTEN or (p.cpu_tensor is not None and not p.has_data):
                raise SwapStateError(f"partition {p.param_id!r} has no data to swap out; use get_buffer first")
        if any(p.state is PartitionState.READING for p in parts):
            self._read_ring.drain()
        self._check_space()
        for p in parts:
            if p.state is PartitionState.AVAILABLE and p.home is not None:
                self._evict(p)  # stored by its owner already (store_at): nothing to write
            elif p.state is PartitionState.AVAILABLE:
                self._submit_write(p)
        if not async_op:
            self._writes.drain()

    def swap_in(self, param_ids: Sequence[ParamId], async_op: bool = False) -> List[torch.Tensor]:
        """Bring partitions into host memory; returns one tensor per id, viewing its buffer.

        With ``async_op`` the tensors hold valid data only after :meth:`synchronize`.
        Partitions in buffers already are not read again. A swap file shorter than
        its partition raises :class:`SwapFileTruncatedError`; with checksums on, a
        changed file raises :class:`SwapCorruptionError` (both name the file).
        """
        parts = self._lookup(param_ids)
        self._check_readable(parts)
        self._start_swap_in(parts, spare=True)
        if not async_op:
            self._complete(parts)
        return [p.tensor() for p in parts]

    def read_ahead(self, param_ids: Sequence[ParamId], copies: Optional[Dict[ParamId, torch.Tensor]] = None) -> int:
        """Start bringing in the leading partitions of ``param_ids`` that the pool holds now
        (packed: outside its spare region, see _span_pool.py), completing the oldest writes
        first if that makes room; never raises :class:`PoolExhaustedError`. A partition in
        ``copies`` (stored with :meth:`store_at`, its data still in its owner's memory, as for
        :meth:`fill`) is copied from there, the others are read, on one read queue. Returns how
        many of ``param_ids``, from the first, are held or on their way."""
        parts = self._lookup(param_ids)
        self._check_readable(parts)
        fit = self._leading_that_fit(parts)
        while fit < len(parts) and len(self._writes):
            self._writes.drain_some()
            fit = self._leading_that_fit(parts)
        self._start_swap_in(parts[:fit], spare=False, copies=copies)
        return fit

    def _check_readable(self, parts: List[Partition]) -> None:
        for p in parts:
            if p.state is PartitionState.UNWRITTEN or (p.cpu_tensor is not None and not p.has_data):
                raise SwapStateError(f"partition {p.param_id!r} was never written; nothing to swap in")

    def _start_swap_in(self, parts: List[Partition], spare: bool,
                       copies: Optional[Dict[ParamId, torch.Tensor]] = None) -> None:
        """Take buffers for the partitions of ``parts`` on NVMe, all or none, and start their
        reads (or copy them from ``copies``)."""
        copies = copies or {}
        for p in parts:  # being written: kept in its buffer, also if taking buffers completes the write
            if p.state is PartitionState.WRITING:
                p.keep_after_write = True
        wanted = list({id(p): p for p in parts if p.state is PartitionState.ON_NVME}.values())
        if not wanted:
            return
        copied = [p for p in wanted if p.param_id in copies]
        if any(p.home is None for p in copied):
            raise SwapStateError("copies are for partitions stored with store_at")
        reads = [p for p in wanted if p.param_id not in copies]
        for p in reads:
            self._check_stored_size(p)
        buffers = self._acquire(wanted, "swap_in", spare)
        for p, buf in zip(wanted, buffers):
            p.buffer = buf
        for p in copied:
            p.state, p.on_nvme = PartitionState.AVAILABLE, True
            p.tensor().copy_(copies[p.param_id].reshape(-1))
        if not reads:
            return
        queue = self._read_ring.next_queue()
        for p in reads:
            p.state, p.queue = PartitionState.READING, queue
        submitted = 0
        try:
            for p in reads:
                offset, nbytes = p.read_span()
                path, data = self._stored_path(p), p.buffer.bytes()[:nbytes]
                queue.submit(IoKind.READ, data, path, offset, self._on_read(p, path, offset, data))
                submitted += 1
        except BaseException:
            for p in reads[submitted + 1 :]:  # never submitted (the failed one was called back)
                self._evict(p)
            raise

    # -- partitions homed in another owner's file (see the note) --------------------------------
    def store_at(self, param_ids: Sequence[ParamId], homes: Sequence[Tuple[str, int]],
                 tensors: Sequence[torch.Tensor]) -> None:
        """Make ``tensors[i]`` the data of ``param_ids[i]``, stored by another owner at
        ``homes[i]`` = (path, byte offset) of its file: nothing is written here. A partition held
        in a buffer is updated there; its own swap file, if any, is deleted. Partitions kept in
        host memory (``max_in_cpu``) just copy the tensor."""
        parts = self._lookup(param_ids)
        if not len(parts) == len(homes) == len(tensors):
            raise ValueError(f"store_at got {len(parts)} ids, {len(homes)} homes and {len(tensors)} tensors")
        capacity = self._buffer_nbytes()
        for p, (path, offset), t in zip(parts, homes, tensors):
            if t.numel() != p.numel:
                raise ValueError(f"partition {p.param_id!r} has {p.numel} elements, the tensor {t.numel()}")
            need = align_up(offset % PAGE_BYTES + p.nbytes)
            if p.cpu_tensor is None and capacity is not None and need > capacity:
                raise BufferTooSmallError(
                    f"partition {p.param_id!r} stored at byte {offset} of {path} needs {need} bytes of buffer, "
                    f"the pool holds {capacity}: give it {HOME_SLACK_BYTES} bytes more than the largest partition")
        busy = [p for p in parts if p.state in (PartitionState.READING, PartitionState.WRITING)]
        if busy:
            self._complete(busy)  # a read in flight is verified against the digest it was read for
        for p, home, t in zip(parts, homes, tensors):
            if p.cpu_tensor is not None:
                p.cpu_tensor.copy_(t.reshape(-1))
                p.has_data = True
                continue
            need = p.span_bytes(skew=int(home[1]) % PAGE_BYTES)
            if p.state is PartitionState.AVAILABLE and p.buffer.nbytes < need:
                # a span holds the data from the old home's offset in a page, too few pages for the new one's
                # (a whole buffer has room for any: checked above)
                wider = self._acquire([p], "store_at", sizes=[need])[0]
                self._pool.release([p.buffer])
                p.buffer = wider
            if p.home is None:
                self.swap_dir.remove(p.file_name)
                self._nvme_bytes -= p.nbytes
            elif self._checksums is not None:
                self._checksums.forget_region(p.home.path, p.home.offset, p.nbytes)
            p.home = Home(fspath(home[0]), int(home[1]))
            if p.state is PartitionState.AVAILABLE:
                p.tensor().copy_(t.reshape(-1))
            else:
                p.state = PartitionState.ON_NVME
            if self._checksums is not None:  # of host bytes in the partition's dtype, never of a device tensor
                held = p.tensor() if p.state is PartitionState.AVAILABLE else _on_host(t, p.dtype)
                self._checksums.record(p.home.path, p.home.offset, held)
            p.on_nvme = True

    def fill(self, param_ids: Sequence[ParamId], tensors: Sequence[torch.Tensor]) -> None:
        """Hold homed partitions in buffers with ``tensors[i]``, their stored data, which the
        owner still has in memory (its write may be in flight): no read."""
        parts = self._lookup(param_ids)
        wanted = [(p, t) for p, t in zip(parts, tensors) if p.state is PartitionState.ON_NVME]
        if any(p.home is None for p, _ in wanted):
            raise SwapStateError("fill() is for partitions stored with store_at")
        buffers = self._acquire([p for p, _ in wanted], "fill") if wanted else []
        for (p, t), buf in zip(wanted, buffers):
            p.buffer, p.state, p.on_nvme = buf, PartitionState.AVAILABLE, True
            p.tensor().copy_(t.reshape(-1))

    def settle(self, param_ids: Iterable[ParamId]) -> None:
        """Complete the reads in flight of these partitions (their owner is about to rewrite
        their homes)."""
        reading = [p for p in self._lookup(param_ids) if p.state is PartitionState.READING]
        if reading:
            self._complete(reading)

    def _complete(self, parts: List[Partition]) -> None:
        """Complete the I/O in flight of ``parts``: every op when there is one read queue (as
        :meth:`synchronize`), else only the queues holding their reads and, if one is being
        written, the writes (see the note)."""
        if self._read_ring.size == 1:  # (the ring grows at first use: its length says nothing here)
            self.synchronize()
            return
        try:
            for queue in {id(p.queue): p.queue for p in parts if p.state is PartitionState.READING}.values():
                queue.drain()
        except BaseException as exc:
            # As with one queue, a failure completes every read in flight (a failed prefetch
            # leaves its partition on NVMe now, not at some later, unrelated call).
            try:
                self._read_ring.drain()
            except BaseException as other:  # noqa: BLE001 - noted on the first error
                add_note(exc, f"also: {other!r}")
            raise
        finally:
            if any(p.state is PartitionState.WRITING for p in parts):
                self._writes.drain()

    def release(self, param_ids: Iterable[ParamId]) -> None:
        """Give the buffers of swapped-in partitions back without writing them.

        Only partitions whose swap file holds their current data may be released;
        changes made to a swapped-in tensor are therefore lost (use :meth:`swap_out`
        to keep them), and a partition that was never written out is refused.
        """
        parts = self._lookup(param_ids)
        if any(p.state is PartitionState.READING for p in parts):
            self._read_ring.drain()
        for p in parts:
            if p.state is PartitionState.WRITING:
                p.keep_after_write = False
            elif p.state is PartitionState.AVAILABLE:
                if not p.on_nvme:
                    raise SwapStateError(
                        f"partition {p.param_id!r} holds data that is not on NVMe yet; swap_out it instead"
                    )
                self._evict(p)

    def release_or_write(self, param_ids: Iterable[ParamId]) -> None:
        """:meth:`release` the partitions whose swap file is current; write out (async) those
        holding data that is not on NVMe yet (a write that failed keeps its data in the buffer:
        this is its retry)."""
        parts = self._lookup(param_ids)
        if any(p.state is PartitionState.READING for p in parts):
            self._read_ring.drain()
        unsaved = [p.param_id for p in parts if p.state is PartitionState.AVAILABLE and not p.on_nvme]
        self.release([p.param_id for p in parts if p.param_id not in set(unsaved)])
        if unsaved:
            self.swap_out(unsaved, async_op=True)

    def discard_unsaved(self) -> List[ParamId]:
        """Complete the writes in flight, then drop the data of every partition whose write
        failed (kept in its buffer for a retry); returns their ids. Their swap files are stale
        or half written: the caller must write each of them again before reading it."""
        try:
            self._writes.drain()
        except OSError:
            pass
        lost = [p for p in self._parts.values() if p.state is PartitionState.AVAILABLE and not p.on_nvme]
        for p in lost:
            self._evict(p)
        return [p.param_id for p in lost]

    # -- internals ---------------------------------------------------------------------------
    def _swapped_entries(self) -> List[Partition]:
        return [p for p in self._parts.values() if p.cpu_tensor is None]

    def _forget_entries(self) -> None:
        self._parts.clear()
        self._by_file.clear()

    def _lookup(self, param_ids: Iterable[ParamId]) -> List[Partition]:
        self._check_open()
        if isinstance(param_ids, (str, int)):
            raise TypeError("pass a list of partition ids")
        try:
            return [self._parts[i] for i in param_ids]
        except KeyError as exc:
            raise KeyError(f"partition id {exc.args[0]!r} is not registered") from None

    def _buffer_nbytes(self) -> Optional[int]:
        """The bytes of the largest partition a buffer (packed: a span) may hold."""
        if self._pool is not None:
            return self._buffer_bytes
        if self.buffer_size is not None:
            return self.buffer_size * self._itemsize()
        return None

    def _make_pool(self, buffer_size: int):
        self._buffer_bytes = buffer_size * self._itemsize()
        return super()._make_pool(buffer_size)

    def _acquire(self, parts: List[Partition], what: str, spare: bool = True,
                 sizes: Optional[List[int]] = None) -> List[PoolBuffer]:
        count = len(parts)
        holder = f"partition {parts[0].param_id!r}" if count == 1 else f"{what} of {count} partitions"
        buffers = self._take_buffers(
            sizes or [p.span_bytes() for p in parts], holder,
            hint="release() partitions that are no longer needed, or raise buffer_count", spare=spare,
        )
        for p, b in zip(parts, buffers):
            b.holder = f"partition {p.param_id!r}"
        return buffers

    def _leading_that_fit(self, parts: List[Partition]) -> int:
        """How many of ``parts``, from the first, the pool can hold now outside its spare region."""
        needing = [i for i, p in enumerate(parts) if p.state is PartitionState.ON_NVME]
        placed = self._ensure_pool().fits([parts[i].span_bytes() for i in needing], spare=False)
        return needing[placed] if placed < len(needing) else len(parts)

    def _submit_write(self, p: Partition) -> None:
        self._check_space()
        path = self.swap_dir.create(p.file_name)
        data = p.tensor()
        if self._checksums is not None:
            self._checksums.record(path, 0, data)
        p.state, p.keep_after_write = PartitionState.WRITING, False
        self._writes.submit(IoKind.WRITE, data, path, 0, self._on_write(p))

    def _on_write(self, p: Partition):
        def on_done(error: Optional[BaseException]) -> None:
            if error is not None:  # the data is still in the buffer: keep it there
                p.state, p.on_nvme = PartitionState.AVAILABLE, False
                return
            p.on_nvme = True
            if p.keep_after_write:
                p.state = PartitionState.AVAILABLE
            else:
                self._drop_buffer(p)
                p.state = PartitionState.ON_NVME
            p.keep_after_write = False

        return on_done

    def _on_read(self, p: Partition, path: str, offset: int, data: torch.Tensor):
        # p holds its buffer from now to on_done; a homed read also covers bytes of its neighbours
        # (whole pages): the checksums verified are the recorded regions inside the read.
        def on_done(error: Optional[BaseException]) -> None:
            if self._settle_read(p, error, path, data, f"partition {p.param_id!r}", offset):
                p.state, p.on_nvme = PartitionState.AVAILABLE, True

        return on_done

    def _stored_path(self, p: Partition) -> str:
        return self.swap_dir.file(p.file_name) if p.home is None else p.home.path

    def _check_stored_size(self, p: Partition) -> None:
        if p.home is None:
            self._check_file_size(p.file_name, f"partition {p.param_id!r}", p.nbytes)
        else:
            p.check_home_size()

    def _unhome(self, p: Partition) -> None:
        if self._checksums is not None:
            self._checksums.forget_region(p.home.path, p.home.offset, p.nbytes)
        p.home = None
        self._nvme_bytes += p.nbytes
