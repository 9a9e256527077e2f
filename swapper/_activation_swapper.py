"""ActivationSwapper: byte blobs appended to one swap file per window, read back ahead of use.

[Note: one file per window, read back in the caller's order]
Tensors saved for backward during one accumulation window are written one after
the other into the window's file, each at a 4096-byte boundary, through
:class:`AsyncTensorSwapper`'s pool buffers: the caller's bytes are free as soon
as :meth:`ActivationSwapper.write` returns, and each piece's checksum is recorded
as for every other swap file. The caller knows the order the blobs come back in
(backward runs the forward's units in reverse) and asks for each one early with
:meth:`read_ahead`: the read lands O_DIRECT in a page-aligned tensor of the
blob's own, which :meth:`read` hands out once it is complete and verified (a
blob not asked for early is read there and then). :meth:`end_window` completes
every I/O in flight and removes the file, so nothing of a window outlives it.
Not thread-safe: the caller serialises its calls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from nvmeio import AioSettings, huge_page_tensor, new_handle
from nvmeio.striping import stripe_unit

from ._async_swapper import AsyncTensorSwapper, SwapOutTicket, WriteState
from ._buffer_pool import PinnedBufferPool, byte_view
from .host_memory import align_up
from .checksum import ChecksumAlgorithm, checksum_table
from ._errors import SwapStateError
from ._io_queue import IoBytes, IoKind, IoQueue, ReadRing
from ._swap_dir import FreeSpaceFn, SwapDirectory

BUFFER_COUNT = 4  # pool buffers the writes are staged in (a blob larger than one is split)
BUFFER_BYTES = 8 << 20
READ_QUEUES = 2  # a read waited for completes its own batch, not every read ahead


@dataclass(eq=False)
class Blob:
    """One written blob: where it lies in its window's file, and its read once asked for."""

    window: int
    offset: int
    nbytes: int
    ticket: SwapOutTicket
    data: Optional[torch.Tensor] = None  # the read's page-aligned destination (uint8)
    queue: Optional[IoQueue] = None  # where that read is in flight; None once complete
    error: Optional[BaseException] = None


class ActivationSwapper:
    """Blobs of bytes to ``<nvme_path>/<job_id>/rank<rank>/<name>/window<n>`` and back."""

    BUFFER_COUNT = BUFFER_COUNT  # its staging memory: BUFFER_COUNT x BUFFER_BYTES, locked when pinned
    BUFFER_BYTES = BUFFER_BYTES

    def __init__(
        self,
        nvme_path,
        aio_config: Union[AioSettings, dict, None] = None,
        *,
        job_id: str = "default",
        rank: int = 0,
        name: str = "activations",
        checksum: Union[str, ChecksumAlgorithm, None] = None,
        pin_memory: bool = False,
        remove_stale: bool = False,
        free_space_fn: Optional[FreeSpaceFn] = None,
    ):
        self.io_bytes = IoBytes()
        self.checksums = checksum_table(checksum)
        with contextlib.ExitStack() as undo:  # a step that fails gives back the ones before it
            self.swap_dir = SwapDirectory(nvme_path, job_id, rank, name, free_space_fn=free_space_fn,
                                          remove_stale=remove_stale,
                                          stripe_unit=stripe_unit(AioSettings.coerce(aio_config).block_size))
            undo.callback(self.swap_dir.cleanup)
            self._writes = IoQueue(new_handle(aio_config), self.io_bytes)
            undo.callback(self._writes.close)
            first = IoQueue(new_handle(aio_config), self.io_bytes)
            undo.callback(first.close)
            self._reads = ReadRing(first, lambda: IoQueue(new_handle(aio_config), self.io_bytes), READ_QUEUES)
            undo.callback(self._reads.close_extra)
            self.pool = PinnedBufferPool(BUFFER_COUNT, BUFFER_BYTES, torch.uint8, pin_memory=pin_memory,
                                         handle=first.handle)
            undo.callback(self.pool.close)
            self._out = AsyncTensorSwapper(self.swap_dir, self.pool, checksum=self.checksums, writes=self._writes,
                                           reads=first, holder="ActivationSwapper")
            undo.pop_all()
        self._first_read_queue = first
        self._window = 0
        self._file: Optional[str] = None
        self._end = 0
        self._closed = False

    @property
    def file_name(self) -> Optional[str]:
        """The current window's swap file (None before its first write)."""
        return self._file

    def write(self, data: torch.Tensor) -> Blob:
        """Append ``data`` (contiguous, on the CPU) to the window's file; free to reuse on return."""
        self._check_open()
        if self._file is None:
            self._file = f"window{self._window}"
        raw = byte_view(data.detach())
        offset = self._end
        (ticket,) = self._out.swap_out([raw], [self._file], [offset])
        self._end = align_up(offset + raw.numel())
        return Blob(self._window, offset, raw.numel(), ticket)

    def read_ahead(self, blob: Blob) -> None:
        """Start reading ``blob`` into a page-aligned tensor of its own (no-op if already started)."""
        self._check_blob(blob)
        if blob.data is not None:
            return
        if not blob.ticket.done:
            self._out.synchronize()  # the read must see the whole write
        if blob.ticket.state is WriteState.FAILED:
            raise blob.ticket.error
        blob.data = huge_page_tensor(blob.nbytes)
        queue = self._reads.next_queue()

        def on_done(error: Optional[BaseException]) -> None:
            blob.queue, blob.error = None, error

        blob.queue = queue
        queue.submit(IoKind.READ, blob.data, self.swap_dir.file(self._file), blob.offset, on_done)

    def read(self, blob: Blob) -> torch.Tensor:
        """``blob``'s bytes (uint8, page-aligned), checked against the checksums of its write."""
        self.read_ahead(blob)
        if blob.queue is not None:
            blob.queue.drain()  # its batch only; an error of the batch is raised for each blob of it
        if blob.error is not None:
            raise blob.error
        if self.checksums is not None:
            self.checksums.verify(self.swap_dir.file(self._file), blob.offset, blob.data)
        data, blob.data = blob.data, None
        return data

    def forget(self, blob: Blob) -> None:
        """``blob`` will not be read: drop its destination (a read in flight keeps it until done)."""
        blob.data = None

    def end_window(self) -> None:
        """Complete every read and write in flight, then remove the window's file; the next
        write starts a new one. An I/O error is raised once the file is gone."""
        self._check_open()
        with contextlib.ExitStack() as steps:  # every step runs, last registered first
            steps.callback(self._new_window)
            steps.callback(self._out.synchronize)
            self._reads.drain()

    def _new_window(self) -> None:
        if self._file is not None:
            if self.checksums is not None:
                self.checksums.forget(self.swap_dir.file(self._file))
            self.swap_dir.remove(self._file)
        self._file, self._end = None, 0
        self._window += 1

    def close(self) -> None:
        """End the window, then free the pool, the handles and the swap directory. Idempotent."""
        if self._closed:
            return
        with contextlib.ExitStack() as steps:  # every step runs; the first error is raised after
            steps.callback(self.swap_dir.cleanup)
            steps.callback(self._writes.close)
            steps.callback(self._first_read_queue.close)
            steps.callback(self._reads.close_extra)
            steps.callback(self.pool.close)
            steps.callback(setattr, self, "_closed", True)
            self.end_window()

    cleanup = close

    def _check_open(self) -> None:
        if self._closed:
            raise SwapStateError("the activation swapper was closed")

    def _check_blob(self, blob: Blob) -> None:
        self._check_open()
        if blob.window != self._window:
            raise SwapStateError(f"blob of window {blob.window} asked for in window {self._window}: its file "
                                 f"was removed when that window ended")
