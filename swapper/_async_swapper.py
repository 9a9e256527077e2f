"""AsyncTensorSwapper: many caller tensors to and from their swap files, through pool buffers.

[Note: the caller's tensor is free at once, the pool buffer when the write is done]
``swap_out`` copies each tensor into pool buffers and submits the writes from
there, so it returns with every source tensor already safe to reuse or free,
the data race on the source that DeepSpeed leaves to its users cannot happen.
The price is one host copy; the gain is that callers need no pinned memory of
their own. Small tensors are packed into one buffer (each piece starting on a
4096-byte boundary), a tensor larger than a buffer is split into buffer-sized
pieces written at their file offsets. When the pool runs dry mid-call, the
swapper completes its writes in flight (which returns their buffers) and goes
on; it raises only when the buffers are held by someone else. Each tensor's
:class:`SwapOutTicket` turns ``WRITTEN`` once all its pieces are on disk.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from nvmeio import AioSettings, new_handle

from ._buffer_pool import PinnedBufferPool, PoolBuffer, byte_view
from .host_memory import align_up
from .checksum import ChecksumAlgorithm, ChecksumTable, checksum_table
from ._errors import PoolExhaustedError, SwapFileTruncatedError
from ._io_queue import IoKind, IoQueue
from ._swap_dir import SwapDirectory


class WriteState(enum.Enum):
    """Where one tensor given to :meth:`AsyncTensorSwapper.swap_out` stands.

    In every state the caller's source tensor is already free to reuse.
    """

    IN_FLIGHT = "in_flight"
    """Copied into pool buffers, writes submitted; holds its share of those buffers."""
    WRITTEN = "written"
    """On disk; holds no memory."""
    FAILED = "failed"
    """A write of its batch failed (``ticket.error``); holds no memory; the file is undefined."""


@dataclass(eq=False)
class SwapOutTicket:
    name: str
    path: str
    offset: int
    nbytes: int
    state: WriteState = WriteState.IN_FLIGHT
    error: Optional[BaseException] = None
    _pending: int = field(default=0, repr=False)
    _submitted: bool = field(default=False, repr=False)

    @property
    def done(self) -> bool:
        return self.state is not WriteState.IN_FLIGHT

    def _piece_done(self, error: Optional[BaseException]) -> None:
        self._pending -= 1
        if error is not None:
            self.state, self.error = WriteState.FAILED, error
        elif self._pending == 0 and self._submitted and self.state is WriteState.IN_FLIGHT:
            self.state = WriteState.WRITTEN


@dataclass(eq=False)
class _Slot:
    """A pool buffer being filled; released once retired and all its writes are done."""

    buffer: PoolBuffer
    fill: int = 0
    pending: int = 0
    retired: bool = False


class AsyncTensorSwapper:
    """Writes tensors to files of ``swap_dir`` asynchronously through ``pool``; reads them back.

    ``writes``/``reads`` are the queues to submit on (a swapper that owns this one
    shares its own); by default each gets a fresh handle from ``aio_config``, which
    :meth:`close` closes (the swap directory and the pool are the caller's).
    Not thread-safe: one thread drives a swapper.
    """

    def __init__(
        self,
        swap_dir: SwapDirectory,
        pool: PinnedBufferPool,
        aio_config: Union[AioSettings, dict, None] = None,
        *,
        checksum: Union[str, ChecksumAlgorithm, ChecksumTable, None] = None,
        writes: Optional[IoQueue] = None,
        reads: Optional[IoQueue] = None,
        holder: str = "AsyncTensorSwapper",
    ):
        self.swap_dir = swap_dir
        self.pool = pool
        self.checksums = checksum_table(checksum)
        self._owned: List[IoQueue] = []  # the queues made here, closed by close()
        try:
            self._writes = writes if writes is not None else self._own(IoQueue(new_handle(aio_config)))
            self._reads = reads if reads is not None else self._own(IoQueue(new_handle(aio_config)))
        except BaseException:
            self.close()
            raise
        self._holder = holder
        self._current: Optional[_Slot] = None

    def _own(self, queue: IoQueue) -> IoQueue:
        self._owned.append(queue)
        return queue

    def close(self) -> None:
        """Complete the writes in flight, then end the threads and kernel AIO contexts of the
        handles this swapper made (shared queues are left to their owner). Idempotent."""
        owned, self._owned = self._owned, []
        try:
            if owned:
                self.synchronize()
        finally:
            for queue in owned:
                queue.close()

    @property
    def in_flight(self) -> int:
        """Write ops submitted and not yet completed."""
        return len(self._writes)

    # -- writes ------------------------------------------------------------------------------
    def swap_out(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        offsets: Optional[Sequence[int]] = None,
    ) -> List[SwapOutTicket]:
        """Write ``tensors[i]`` to file ``names[i]`` at byte ``offsets[i]`` (default 0).

        Returns when every tensor has been copied into pool buffers (so all of
        them may be reused at once), with one ticket per tensor; call
        :meth:`synchronize` to wait until they are all ``WRITTEN``. The free space
        the new bytes need is checked before anything is written.
        """
        offsets = [0] * len(tensors) if offsets is None else list(offsets)
        if not (len(tensors) == len(names) == len(offsets)):
            raise ValueError(f"swap_out got {len(tensors)} tensors, {len(names)} names, {len(offsets)} offsets")
        sources = [byte_view(t.detach().contiguous()) for t in tensors]
        ends = {}
        for name, src, off in zip(names, sources, offsets):
            ends[name] = max(ends.get(name, 0), off + src.numel())
        needed = sum(max(0, end - self.swap_dir.size(name)) for name, end in ends.items())
        self.swap_dir.check_free_space(needed, f"{len(tensors)} tensors")

        tickets = [
            SwapOutTicket(name, self.swap_dir.create(name), off, src.numel())
            for name, src, off in zip(names, sources, offsets)
        ]
        try:
            for ticket, src in zip(tickets, sources):
                self._write_one(ticket, src)
        except BaseException as exc:
            for ticket in tickets:
                if ticket.state is WriteState.IN_FLIGHT and ticket._pending == 0:
                    ticket.state, ticket.error = WriteState.FAILED, exc
            raise
        finally:
            self._retire_current()
        return tickets

    def _write_one(self, ticket: SwapOutTicket, src: torch.Tensor) -> None:
        done = 0
        while done < ticket.nbytes:
            piece = min(ticket.nbytes - done, self.pool.buffer_nbytes)
            slot = self._slot_with_room(piece)
            dst = slot.buffer.bytes()[slot.fill : slot.fill + piece]
            dst.copy_(src[done : done + piece])
            if self.checksums is not None:
                self.checksums.record(ticket.path, ticket.offset + done, dst)
            slot.fill = align_up(slot.fill + piece)
            slot.pending += 1
            ticket._pending += 1
            self._writes.submit(
                IoKind.WRITE, dst, ticket.path, ticket.offset + done, self._on_piece_written(ticket, slot)
            )
            done += piece
        ticket._submitted = True
        if ticket._pending == 0 and ticket.state is WriteState.IN_FLIGHT:
            ticket.state = WriteState.WRITTEN

    def _on_piece_written(self, ticket: SwapOutTicket, slot: _Slot):
        def on_done(error: Optional[BaseException]) -> None:
            slot.pending -= 1
            ticket._piece_done(error)
            self._maybe_release(slot)

        return on_done

    def _slot_with_room(self, nbytes: int) -> _Slot:
        current = self._current
        if current is not None and current.buffer.nbytes - current.fill >= nbytes:
            return current
        self._retire_current()
        self._current = _Slot(self._acquire_buffer())
        return self._current

    def _retire_current(self) -> None:
        if self._current is not None:
            self._current.retired = True
            self._maybe_release(self._current)
            self._current = None

    def _maybe_release(self, slot: _Slot) -> None:
        if slot.retired and slot.pending == 0:
            self.pool.release([slot.buffer])

    def _acquire_buffer(self) -> PoolBuffer:
        try:
            return self.pool.acquire(1, holder=self._holder)[0]
        except PoolExhaustedError:
            if not len(self._writes):
                raise
        self._writes.drain()  # returns the buffers of completed writes
        return self.pool.acquire(1, holder=self._holder)[0]

    def synchronize(self) -> None:
        """Wait for every write in flight; afterwards every ticket is ``WRITTEN`` or ``FAILED``."""
        self._writes.drain()

    # -- reads -------------------------------------------------------------------------------
    def swap_in(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        offsets: Optional[Sequence[int]] = None,
    ) -> None:
        """Fill each contiguous CPU tensor from file ``names[i]`` at ``offsets[i]``; blocking.

        Reads go through pool buffers (so the destinations need not be pinned);
        with checksums on, every recorded region inside a read is verified before
        its bytes are copied out.
        """
        offsets = [0] * len(tensors) if offsets is None else list(offsets)
        if not (len(tensors) == len(names) == len(offsets)):
            raise ValueError(f"swap_in got {len(tensors)} tensors, {len(names)} names, {len(offsets)} offsets")
        pieces = []
        for t, name, off in zip(tensors, names, offsets):
            if not t.is_contiguous():
                raise ValueError("swap_in needs contiguous destination tensors")
            dst = byte_view(t.detach())
            path = self.swap_dir.file(name)
            size = self.swap_dir.size(name)
            if size < off + dst.numel():
                raise SwapFileTruncatedError(
                    f"swap file {path} is {size} bytes, but {dst.numel()} bytes are to be read at "
                    f"offset {off}: it was truncated or never written",
                    path,
                )
            for start in range(0, dst.numel(), self.pool.buffer_nbytes):
                pieces.append((dst[start : start + self.pool.buffer_nbytes], path, off + start))

        batch: List[tuple] = []  # (destination, buffer view, path, file offset)
        held: List[PoolBuffer] = []
        fill = 0
        try:
            for dst, path, off in pieces:
                if not held or held[-1].nbytes - fill < dst.numel():
                    buf = self._try_acquire()
                    if buf is None:
                        full_batch, full_held, batch, held = batch, held, [], []
                        self._finish_reads(full_batch, full_held)
                        buf = self._try_acquire(must=True)
                    held.append(buf)
                    fill = 0
                view = held[-1].bytes()[fill : fill + dst.numel()]
                self._reads.submit(IoKind.READ, view, path, off, lambda error: None)
                batch.append((dst, view, path, off))
                fill = align_up(fill + dst.numel())
            last_batch, last_held, batch, held = batch, held, [], []
            self._finish_reads(last_batch, last_held)
        finally:
            if held:
                self._reads_abandon(held)

    def _try_acquire(self, must: bool = False) -> Optional[PoolBuffer]:
        try:
            return self.pool.acquire(1, holder=self._holder)[0]
        except PoolExhaustedError:
            if not must:
                return None
            if not len(self._writes):
                raise
        self._writes.drain()
        return self.pool.acquire(1, holder=self._holder)[0]

    def _finish_reads(self, batch: List[tuple], held: List[PoolBuffer]) -> None:
        try:
            self._reads.drain()
            for dst, view, path, off in batch:
                if self.checksums is not None:
                    self.checksums.verify(path, off, view)
                dst.copy_(view)
        finally:
            self.pool.release(held)

    def _reads_abandon(self, held: List[PoolBuffer]) -> None:
        try:
            self._reads.drain()
        finally:
            self.pool.release(held)
