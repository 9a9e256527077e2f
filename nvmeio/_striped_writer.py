"""StripedFileWriter: one of several writers of one file, each writing its own stripes.

[Note: parallel writers of one file]
FastPersist writes one checkpoint file from several data-parallel ranks at
once. DeepSpeed's ``FastFileWriter`` splits only the tensor bytes, and only
when a modified ``torch.save`` hands it the list of storages
(``save_torch_storage_object_list``): each writer then takes a contiguous share
of their total, and its launcher gives every writer a file of its own
(``<path>-<rank>.<writers>``). With a stock ``torch.save`` every writer gets
the whole serialized stream through ``write()``, and the total size is known
only at the end.

Here every writer serializes the same object, so each sees the same byte
stream, and the stream is cut into stripes of ``stripe_bytes`` (a multiple of
4096): stripe ``k`` belongs to writer ``k % writers``. A writer copies only its
own stripes into its locked buffers and writes each at its offset in the one
shared file; the bytes of the others it only counts. Nothing needs the total
size in advance, memory stays bounded by the buffers, and every writer's
writes start on a stripe boundary. The union of the stripes is the whole
stream, so the file is byte-identical to a plain ``torch.save`` once every
writer has closed.

Writers never truncate at open (one could cut what another already wrote):
the file is opened without ``O_TRUNC`` and each writer, knowing the total at
``close()``, sets the file's size to it (cutting the tail of an older, longer
file; an extension by zeros is overwritten by the writer owning those bytes).
So the writers may open, write and close in any order, but the file is whole
only after all of them closed: the caller synchronises (a barrier) before
reading it. All writers must be given the same ``writers`` and
``stripe_bytes`` and write the same bytes; nothing here can check that.
"""
from __future__ import annotations

import ctypes
import os
import stat
import time
import warnings

from . import _native
from ._fast_buffers import IOBuffers
from ._fast_writer import _byte_view, submit_buffer
from .atomic_file import fsync_file, is_device_node
from .file_ops import open_direct

__all__ = ["StripedFileWriter", "DEFAULT_STRIPE_BYTES"]

DEFAULT_STRIPE_BYTES = 16 << 20


class StripedFileWriter:
    """Writer ``rank`` of ``writers`` of ``path``: writes the stripes it owns of the byte
    stream it is given (see [Note: parallel writers of one file]), through ``io``'s handle
    and buffers, which it borrows until ``close()`` or ``abort()``."""

    def __init__(self, path, io: IOBuffers, writers: int, rank: int, stripe_bytes: int = DEFAULT_STRIPE_BYTES):
        if not 0 <= rank < writers:
            raise ValueError(f"rank must be in [0, {writers}), got {rank}")
        if stripe_bytes <= 0 or stripe_bytes % 4096:
            raise ValueError(f"stripe_bytes must be a positive multiple of 4096, got {stripe_bytes}")
        self.name = os.fspath(path)
        self.writers, self.rank, self.stripe_bytes = writers, rank, stripe_bytes
        self._io = io
        self._fd = -1
        self._done = False
        io.acquire(self)
        try:
            self._bufs = io.buffers()
            is_device_node(self.name)  # refuses a FIFO or socket (its open would block)
            self._fd, self.direct = open_direct(self.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW)
        except BaseException:
            self._finish()
            raise
        self._size = io.buffer_size
        self._ptrs = [b.data_ptr() for b in self._bufs]
        self._pos = 0          # bytes of the stream seen (this writer's or not)
        self._cur = 0          # the buffer being filled
        self._fill = 0         # bytes in it
        self._base = 0         # file offset of its first byte
        self._pending = False  # the other buffer is on its way to the file
        self.bytes_written = 0  # bytes of the file this writer wrote
        self._start = time.perf_counter()

    @property
    def closed(self) -> bool:
        return self._done

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        if self._done:
            raise ValueError("I/O operation on a closed writer")
        view = _byte_view(data)
        n = len(view)
        if n == 0:
            return 0
        src = _native.buffer_address(view, False)[0]
        done = 0
        try:
            while done < n:
                stripe, within = divmod(self._pos, self.stripe_bytes)
                k = min(n - done, self.stripe_bytes - within)
                if stripe % self.writers == self.rank:
                    self._copy(src + done, k, stripe_end=within + k == self.stripe_bytes)
                else:
                    self._pos += k
                done += k
        except BaseException:
            self.abort()
            raise
        return n

    def _copy(self, src: int, length: int, stripe_end: bool) -> None:
        """``length`` bytes of this writer's stripe at stream position ``self._pos``."""
        done = 0
        while done < length:
            if self._fill == 0:
                self._base = self._pos
            k = min(self._size - self._fill, length - done)
            ctypes.memmove(self._ptrs[self._cur] + self._fill, src + done, k)
            self._fill += k
            self._pos += k
            done += k
            if self._fill == self._size:
                self._submit()
        if stripe_end and self._fill:  # the next bytes this writer owns are a stripe further on
            self._submit()

    def _submit(self, last: bool = False) -> None:
        self.bytes_written += submit_buffer(self, last)

    def close(self) -> None:
        """Writes the rest, sets the file's size to the whole stream's and fsyncs; idempotent."""
        if self._done:
            return
        try:
            if self._fill:
                self._submit(last=True)
            if self._pending:
                self._io.handle.wait()
                self._pending = False
            if stat.S_ISREG(os.fstat(self._fd).st_mode):
                os.ftruncate(self._fd, self._pos)
            fsync_file(self._fd)
        except BaseException:
            self.abort()
            raise
        stats = self._io.stats
        stats.files_written += 1
        stats.bytes_written += self.bytes_written
        stats.write_seconds += time.perf_counter() - self._start
        self._finish()

    def abort(self) -> None:
        """Stops writing: waits for what is in flight and closes the file, which stays as it
        is (the other writers may still be writing it)."""
        if self._done:
            return
        try:
            if self._pending:
                try:
                    self._io.handle.wait()
                except Exception:  # noqa: BLE001 - the write is abandoned anyway
                    pass
                self._pending = False
        finally:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self._io.release(self)

    def __del__(self) -> None:
        if not self._done and getattr(self, "_io", None) is not None:
            warnings.warn(f"StripedFileWriter({self.name!r}) was not closed: its last bytes were not "
                          "written (call close())", ResourceWarning, stacklevel=2)
            self.abort()

    def __repr__(self) -> str:
        return f"StripedFileWriter({self.name!r}, writer {self.rank} of {self.writers})"
