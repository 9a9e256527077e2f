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
handle, so that waiting for a read never waits for a write.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .errors import add_note

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


class IoQueue:
    """Submits reads or writes on one handle and completes them in batches."""

    def __init__(self, handle):
        self.handle = handle
        self._ops: List[IoOp] = []

    def __len__(self) -> int:
        return len(self._ops)

    def submit(self, kind: IoKind, buffer: torch.Tensor, path: str, offset: int, on_done: OnDone) -> None:
        """Start one op. ``buffer`` must stay untouched (writes) or unread (reads) until :meth:`drain`."""
        op = IoOp(kind, buffer, path, offset, on_done)
        try:
            if kind is IoKind.READ:
                self.handle.async_pread(buffer, path, offset)
            else:
                self.handle.async_pwrite(buffer, path, offset)
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
