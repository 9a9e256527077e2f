"""SwapperBase: what the parameter and optimizer swappers share.

Two I/O queues (one handle for reads, one for writes: see _io_queue.py), the
swap directory, a pool of the subclass's kind made at first use (_pool_kind.py), the
free-space check before writes, and a lifetime: ``synchronize`` / ``cleanup`` / ``with``.

A subclass keeps one *entry* per thing it swaps (a partition, a sub-group),
each with ``file_name``, ``nbytes`` (its swap file's size), ``state`` (a member
of the subclass's ``_State`` enum, which has ``ON_NVME``) and ``buffer`` (its
pool buffer or ``None``), and provides :meth:`_swapped_entries`,
:meth:`_forget_entries` and :attr:`nvme_bytes`.
"""
from __future__ import annotations

import abc
import contextlib
import math
from typing import Iterable, List, Optional

import torch

from nvmeio import AioSettings, new_handle
from nvmeio.striping import stripe_unit

from ._buffer_pool import PoolBuffer, StagingPool
from .checksum import checksum_table
from ._errors import PoolExhaustedError, SwapCorruptionError, SwapFileTruncatedError, SwapStateError, add_note
from ._io_queue import IoBytes, IoKind, IoQueue, ReadRing
from ._pool_kind import PoolKind, WholeBuffers
from ._swap_dir import SwapDirectory


class SwapperBase(abc.ABC):
    """Queues, pool, swap directory and lifetime of a swapper. Not thread-safe."""

    _State: type  # the subclass's state enum
    _entry_noun: str  # what the entries are, in the plural, for error messages
    buffer_count: int

    def __init__(
        self,
        nvme_path,
        config: AioSettings,
        dtype: torch.dtype,
        *,
        job_id,
        rank,
        name,
        checksum,
        pin_memory,
        free_space_fn,
        remove_stale,
        pool_kind: PoolKind = WholeBuffers(),
    ):
        self.dtype = dtype
        self.pool_kind = pool_kind
        self.pin_memory = pin_memory
        self.aio_config = config  # for a handle of its own where one is needed (_staged_state.py)
        self._checksums = checksum_table(checksum)
        self.io_bytes = IoBytes()  # what this swapper's queues moved (tests and benchmarks read it)
        self._pool: Optional[StagingPool] = None
        self._space_checked = 0
        self._closed = False
        # A directory that cannot be claimed (in use, stale) must not leave the handles' threads
        # and kernel AIO contexts to garbage collection.
        with contextlib.ExitStack() as undo:
            self._reads = self._new_queue()
            undo.callback(self._reads.close)
            self._writes = IoQueue(new_handle(config), self.io_bytes)
            undo.callback(self._writes.close)
            self._read_ring = ReadRing(self._reads, self._new_queue, 1)  # see _spread_reads
            self.swap_dir = SwapDirectory(
                nvme_path, job_id, rank, name, free_space_fn=free_space_fn, remove_stale=remove_stale,
                stripe_unit=stripe_unit(AioSettings.coerce(config).block_size),
            )
            undo.pop_all()

    # -- what a subclass provides -------------------------------------------------------------
    @abc.abstractmethod
    def _swapped_entries(self) -> Iterable:
        """The entries that live on NVMe (have a swap file, may hold a pool buffer)."""
        ...

    @abc.abstractmethod
    def _forget_entries(self) -> None:
        """Drop every entry's record (at cleanup, once their buffers are back)."""
        ...

    @property
    @abc.abstractmethod
    def nvme_bytes(self) -> int:
        """Bytes the swapped entries take on disk."""
        ...

    # -- shared API ---------------------------------------------------------------------------
    @property
    def checksum(self):
        """The :class:`ChecksumAlgorithm` verifying every swap-in, or None when off."""
        return self._checksums.algorithm if self._checksums is not None else None

    @property
    def pool(self) -> Optional[StagingPool]:
        """The buffer pool; ``None`` until first needed when it is sized from the entries."""
        return self._pool

    def _new_queue(self) -> IoQueue:
        """A read queue: a batch that lands is hashed at once (checksum.py, [Note: a landed batch
        of reads is hashed at once])."""
        return IoQueue(new_handle(self.aio_config), self.io_bytes, self._reads_landed)

    def _reads_landed(self, ops):
        if self._checksums is None:
            return contextlib.nullcontext()
        return self._checksums.hashed_ahead([(op.path, op.offset, op.buffer) for op in ops
                                             if op.kind is IoKind.READ and op.buffer.device.type == "cpu"])

    def _spread_reads(self, queues: int) -> None:
        """Reads over up to ``queues`` queues, each its own handle (made at first need), so that
        waiting for one read need not wait for the others (_io_queue.py ReadRing)."""
        self._read_ring = ReadRing(self._reads, self._new_queue, queues)

    def synchronize(self) -> None:
        """Complete every read and write in flight; raise the first error after all are done."""
        try:
            self._read_ring.drain()
        finally:
            self._writes.drain()

    def flush_writes(self) -> None:
        """Complete every write in flight, the reads going on; raise the first write's error."""
        self._writes.drain()

    def cleanup(self) -> None:
        """Finish I/O, free the pool, delete every swap file and the swap directory.

        Every step runs even when one before it raised (a write that failed, a buffer still
        held); an error is raised once all of them have run."""
        if self._closed:
            return
        self._closed = True
        with contextlib.ExitStack() as steps:  # the steps run last registered first
            for queue in (self._reads, self._writes):  # worker threads and kernel AIO contexts, now
                steps.callback(queue.close)
            steps.callback(self._read_ring.close_extra)
            steps.callback(self.swap_dir.cleanup)
            steps.callback(self._free_pool)
            self.synchronize()

    def _free_pool(self) -> None:
        """Give every entry's buffer back, forget the entries, free the pool's memory."""
        for entry in self._swapped_entries():
            self._drop_buffer(entry)
        self._forget_entries()
        if self._pool is not None:
            self._pool.close()

    def check_free_space(self, own_bytes: Optional[int] = None) -> None:
        """Raise :class:`InsufficientSwapSpaceError` now if the file system cannot hold the swap
        files of every entry registered so far (the first write checks this anyway; a caller
        that is about to hand over data it cannot get back asks first). ``own_bytes``: where
        some entries will be stored in another owner's file (a parameter homed in the
        optimizer's master, ``store_at``), the bytes of the files this swapper writes itself;
        the writes then check no more than that until more is registered."""
        self._check_open()
        if own_bytes is None:
            self._check_space()
            return
        self.swap_dir.check_free_space(own_bytes, f"{self._entry_noun} in files of their own")
        self._space_checked = max(self._space_checked, self.nvme_bytes)

    close = cleanup

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SwapStateError("the swapper was cleaned up")

    def _itemsize(self) -> int:
        return self.dtype.itemsize

    def _make_pool(self, buffer_size: int) -> StagingPool:
        return self.pool_kind.make(self.buffer_count, buffer_size, self.dtype, pin_memory=self.pin_memory,
                                   handle=self._reads.handle)

    def _ensure_pool(self) -> StagingPool:
        """The pool; made at first use with buffers that hold the largest entry."""
        if self._pool is None:
            largest = max((e.nbytes for e in self._swapped_entries()), default=0)
            self._pool = self._make_pool(max(1, math.ceil(largest / self._itemsize())))
        return self._pool

    def _take_buffers(self, sizes: List[int], holder: str, hint: Optional[str] = None,
                      spare: bool = True) -> List[PoolBuffer]:
        """Pool buffers for requests of ``sizes`` bytes (in the pool's spare region too when
        ``spare``); when they do not fit, completes the writes in flight (which return theirs)
        and tries again. ``hint`` is noted on a final PoolExhaustedError."""
        pool = self._ensure_pool()
        try:
            while True:
                try:
                    return pool.take(sizes, holder=holder, spare=spare)
                except PoolExhaustedError:
                    if not len(self._writes):
                        raise
                self._writes.drain_some()  # the oldest writes (all, with one write queue)
        except PoolExhaustedError as exc:
            if hint is not None:
                add_note(exc, hint)
            raise

    def _drop_buffer(self, entry) -> None:
        if entry.buffer is not None:
            self._pool.release([entry.buffer])
            entry.buffer = None

    def _evict(self, entry) -> None:
        """Give ``entry``'s buffer back unwritten: its data is the one in its swap file."""
        self._drop_buffer(entry)
        entry.state = self._State.ON_NVME

    def _check_space(self) -> None:
        """Refuse, before writing, when the file system cannot hold every swap file in full."""
        total = self.nvme_bytes
        if total <= self._space_checked:
            return
        entries = list(self._swapped_entries())
        names = [n for e in entries for n in getattr(e, "file_names", (e.file_name,))]
        on_disk = sum(self.swap_dir.size(n) for n in names)
        self.swap_dir.check_free_space(total - on_disk, f"{len(entries)} {self._entry_noun}")
        self._space_checked = total

    def _check_file_size(self, file_name: str, holder: str, expected: int, at_least: bool = False) -> None:
        size = self.swap_dir.size(file_name)
        if size < expected:
            path = self.swap_dir.file(file_name)
            raise SwapFileTruncatedError(
                f"swap file {path} of {holder} is {size} bytes, expected {'at least ' if at_least else ''}"
                f"{expected}: it was truncated behind the swapper's back",
                path,
            )

    def _settle_read(self, entry, error: Optional[BaseException], path: str, data: torch.Tensor,
                     holder: str = "", offset: int = 0) -> bool:
        """On completion of ``entry``'s read into ``data``: True if the data is good. A failed
        read (False) or a checksum mismatch (raised, naming ``holder``) evicts the entry; the
        caller sets the state of a good one. ``offset``: where in the file ``data`` was read from."""
        if error is None and self._checksums is not None:
            try:
                self._checksums.verify(path, offset, data)
            except SwapCorruptionError as exc:
                self._evict(entry)
                if holder:
                    exc.message = f"{holder}: {exc.message}"
                raise
            except BaseException:
                self._evict(entry)
                raise
        if error is not None:
            self._evict(entry)
            return False
        return True
