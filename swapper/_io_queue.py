"""Operations in flight on one ``aio_handle``, and what to do when they finish.

[Note: a batch completes together, and fails together]
``aio_handle.wait()`` completes every op submitted since the last wait and
raises the first error without saying which other ops failed. So an
:class:`IoQueue` treats a batch as one unit: after ``wait()`` it runs each op's
``on_done(error)`` callback, with ``error`` the exception if the batch failed
(for every op of the batch, conservatively) and ``None`` otherwise. Callbacks
return buffers to the pool and move partitions to their next state; a failed
read leaves the partition on NVMe, a failed write keeps the data in its
buffer, so a retry is always possible and nothing is ever taken for written
that might not be. Errors raised by callbacks (checksum mismatches) are
collected and raised after every callback has run, so no buffer is leaked.
Swappers keep one queue for reads and one for writes, each with its own
handle, so that waiting for a read never waits for a write; the parameter
swapper spreads its writes over a :class:`WriteRing` of queues, so that a full
pool waits for its oldest writes only.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch

from ._errors import add_note

OnDone = Callable[[Optional[BaseException]], None]


class IoKind(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(eq=False)
class IoOp:
    kind: IoKind
    buffer: torch.Tensor  # kept referenced until the op completes
    path: str
    offset: int
    on_done: OnDone

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class IoBytes:
    """Bytes a swapper's queues submitted to read and to write (what a benchmark or a test
    counts per iteration; the swapper's own count, not the process's)."""

    read: int = 0
    written: int = 0


class IoQueue:
    """Submits reads or writes on one handle and completes them in batches; ``counts`` (shared
    by a swapper's queues) adds up the bytes submitted."""

    def __init__(self, handle, counts: Optional[IoBytes] = None,
                 on_batch: Optional[Callable[[List[IoOp]], ContextManager]] = None):
        self.handle = handle
        self.counts = counts if counts is not None else IoBytes()
        # ``on_batch(ops)``: a context the callbacks of a batch that completed without error run in
        # (a swapper's checksums hash the batch's reads at once: checksum.py)
        self.on_batch = on_batch
        self._ops: List[IoOp] = []

    def __len__(self) -> int:
        return len(self._ops)

    def submit(self, kind: IoKind, buffer: torch.Tensor, path: str, offset: int, on_done: OnDone) -> None:
        """Start one op. ``buffer`` must stay untouched (writes) or unread (reads) until :meth:`drain`."""
        op = IoOp(kind, buffer, path, offset, on_done)
        try:
            if kind is IoKind.READ:
                self.handle.async_pread(buffer, path, offset)
                self.counts.read += op.nbytes
            else:
                self.handle.async_pwrite(buffer, path, offset)
                self.counts.written += op.nbytes
        except BaseException as exc:
            op.on_done(exc)
            raise
        self._ops.append(op)

    def drain(self) -> int:
        """Wait for every op in flight, run their callbacks, raise the first error.

        Returns the number of ops completed.
        """
        if not self._ops:
            return 0
        ops, self._ops = self._ops, []
        error: Optional[BaseException] = None
        try:
            self.handle.wait()
        except BaseException as exc:  # noqa: BLE001 - every op must see it
            error = exc
        callback_errors: List[BaseException] = []
        try:
            context = self.on_batch(ops) if error is None and self.on_batch is not None else contextlib.nullcontext()
        except BaseException as exc:  # noqa: BLE001 - the callbacks run (and release) regardless
            callback_errors.append(exc)
            context = contextlib.nullcontext()
        with context:
            for op in ops:
                try:
                    op.on_done(error)
                except BaseException as exc:  # noqa: BLE001 - raised below
                    callback_errors.append(exc)
        if error is not None:
            for extra in callback_errors:
                add_note(error, f"also: {extra!r}")
            raise error
        if callback_errors:
            first = callback_errors[0]
            for extra in callback_errors[1:]:
                add_note(first, f"also: {extra!r}")
            raise first
        return len(ops)

    drain_some = drain  # (see WriteRing)

    def landed(self) -> bool:
        """Whether every op in flight has finished, so :meth:`drain` would not block."""
        return not self._ops or self.handle.pending() == 0

    def close(self) -> None:
        self.handle.close()


class WriteRing:
    """Writes spread over up to ``size`` queues (each its own handle), so that freeing a
    buffer waits for the oldest batch of writes only, not for every write in flight.

    Quacks like an :class:`IoQueue` (``submit``, ``drain``, ``len``); :meth:`drain_some`
    completes the queue whose first pending write is the oldest. Queues beyond the first
    are made at first need with ``make_queue``.
    """

    def __init__(self, first: IoQueue, make_queue: Callable[[], IoQueue], size: int):
        self.queues: List[IoQueue] = [first]
        self._make_queue = make_queue
        self._size = size
        self._since: dict = {}  # id(queue) -> sequence number of its oldest pending write
        self._seq = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def submit(self, kind: IoKind, buffer: torch.Tensor, path: str, offset: int, on_done: OnDone) -> None:
        queue = next((q for q in self.queues if not len(q)), None)
        if queue is None and len(self.queues) < self._size:
            queue = self._make_queue()
            self.queues.append(queue)
        if queue is None:  # all busy: the one that has been busy the shortest
            queue = max(self.queues, key=lambda q: self._since[id(q)])
        if not len(queue):
            self._seq += 1
            self._since[id(queue)] = self._seq
        queue.submit(kind, buffer, path, offset, on_done)

    def drain_some(self) -> int:
        """Complete the queue holding the oldest pending write. A failure completes every
        write in flight before it is raised, as with one queue: no failed write is left to
        surface later, at an unrelated call (a retry)."""
        busy = [q for q in self.queues if len(q)]
        if not busy:
            return 0
        try:
            return min(busy, key=lambda q: self._since[id(q)]).drain()
        except BaseException as exc:
            try:
                self.drain()
            except BaseException as other:  # noqa: BLE001 - noted on the first error
                if other is not exc:
                    add_note(exc, f"also: {other!r}")
            raise

    def drain(self) -> int:
        return _drain_all(self.queues)

    def close(self) -> None:
        for queue in self.queues:
            queue.handle.close()


class ReadRing:
    """Reads spread over up to ``size`` queues (each its own handle), one batch of reads per
    queue, so that a fetch waits for its own batch only, not for every read in flight (a
    prefetch of later units). Queues beyond the first are made at first need with
    ``make_queue``; ``size`` 1 is one queue, where completing any read completes them all."""

    def __init__(self, first: IoQueue, make_queue: Callable[[], IoQueue], size: int):
        self.queues: List[IoQueue] = [first]
        self.size = size
        self._make_queue = make_queue
        self._next = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def next_queue(self) -> IoQueue:
        """The queue for the next batch of reads: an idle one, else the next in turn."""
        for queue in self.queues:
            if not len(queue):
                return queue
        if len(self.queues) < self.size:
            self.queues.append(self._make_queue())
            return self.queues[-1]
        self._next = (self._next + 1) % len(self.queues)
        return self.queues[self._next]

    def drain(self) -> int:
        return _drain_all(self.queues)

    def close_extra(self) -> None:
        """Close the queues made beyond the first (the first belongs to whoever gave it)."""
        for queue in self.queues[1:]:
            queue.handle.close()


def _drain_all(queues: List[IoQueue]) -> int:
    """Complete every queue's ops; the first error is raised once all are done."""
    done, error = 0, None
    for queue in queues:
        try:
            done += queue.drain()
        except BaseException as exc:  # noqa: BLE001 - every queue is drained, the first error raised
            error = error or exc
    if error is not None:
        raise error
    return done
