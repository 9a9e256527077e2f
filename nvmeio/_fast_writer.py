"""FastFileWriter: a file-like object that writes at disk speed (FastPersist-class).

    with nvmeio.FastFileWriter("model.pt") as f:
        torch.save(state_dict, f)

Bytes written are copied into a locked, page-aligned buffer; each full
buffer goes to the file as one O_DIRECT write of an aio_handle while the next
one fills (double buffering); the last, partial buffer's unaligned tail is
written byte-exact. Atomic by default (see [Note: atomic replacement of a
file] in file_ops): nothing appears under ``path`` until ``close()`` has
written and fsynced every byte; a writer left by an exception (the ``with``
block raised) or dropped without ``close()`` removes its temporary file and
leaves whatever was under ``path`` untouched. A device node is written in
place and a FIFO or socket refused (see [Note: device nodes are written in
place] in atomic_file).
"""
from __future__ import annotations

import ctypes
import io
import os
import stat
import time
import warnings
from typing import Optional

from . import _native
from .atomic_file import TempFile, fsync_file, is_device_node
from ._fast_buffers import DEFAULT_BUFFER_SIZE, IOBuffers
from .file_ops import copy_range, open_direct, preallocate, temp_beside
from .striping import StripedFile

__all__ = ["FastFileWriter"]


def _byte_view(data) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class FastFileWriter(io.RawIOBase):
    """Writes ``path`` sequentially through an aio_handle.

    Args:
        path: the file to write (its directory must exist).
        atomic: write a temporary file and rename it over ``path`` at
            ``close()`` (default); False writes ``path`` in place (truncated).
        io: a :class:`~nvmeio.FastIO` to borrow the handle and buffers from;
            by default a private one with ``buffer_size`` / ``double_buffer``.

    ``write``, ``tell``, ``flush``, ``fileno``, ``close`` and the context
    manager behave as for a file opened "wb"; ``seek`` only to the current
    position (the file is written front to back). ``flush()`` does not force a
    partial buffer out (that would break the alignment of what follows): the
    bytes are durable once ``close()`` returns. New files are created 0600.
    """

    def __init__(self, path, *, atomic: bool = True, io: Optional[IOBuffers] = None,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, double_buffer: bool = True):
        super().__init__()
        self.name = os.fspath(path)
        self.atomic = bool(atomic)
        self._own_io = io is None
        self._io = io if io is not None else IOBuffers(buffer_size, double_buffer)
        self._fd = -1
        self._copy_fd = -1
        self._tmp: Optional[TempFile] = None
        self._done = False
        try:
            self._io.acquire(self)
            self._bufs = self._io.buffers()
            if self.atomic:
                self._tmp, self._fd, self.direct = temp_beside(self.name)
            else:
                is_device_node(self.name)  # refuses a FIFO or socket (its open would block)
                self._fd, self.direct = open_direct(
                    self.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
        except BaseException:
            self._finish()
            raise
        self._size = self._io.buffer_size
        self._ptrs = [b.data_ptr() for b in self._bufs]
        self._cur = 0          # the buffer being filled
        self._fill = 0         # bytes in it
        self._base = 0         # file offset of its first byte
        self._pending = False  # one buffer is on its way to the file
        self._reserved = 0     # bytes allocated up front by reserve()
        self._start = time.perf_counter()

    # -- file protocol ---------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    def tell(self) -> int:
        self._check_open()
        return self._base + self._fill

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        here = self.tell()
        target = {os.SEEK_SET: offset, os.SEEK_CUR: here + offset}.get(whence)
        if target != here:
            raise io.UnsupportedOperation(
                "FastFileWriter writes front to back: it can seek only to its current position "
                f"({here}), not to {offset} (whence {whence})")
        return here

    def write(self, data) -> int:
        self._check_open()
        view = _byte_view(data)
        n = len(view)
        if n == 0:
            return 0
        src = _native.buffer_address(view, False)[0]
        done = 0
        try:
            while done < n:
                k = min(self._size - self._fill, n - done)
                ctypes.memmove(self._ptrs[self._cur] + self._fill, src + done, k)
                self._fill += k
                done += k
                if self._fill == self._size:
                    self._submit()
        except BaseException:
            self.abort()
            raise
        return n

    def reserve(self, nbytes: int) -> None:
        """The file will hold ``nbytes`` in all: allocate them now, in one call. Direct writes
        into allocated blocks run in parallel, and one allocation of a whole checkpoint shard
        measured ~1.5x faster to fill than one per buffer (ext4); a full disk raises here,
        before a byte is written. What is reserved and not written is cut off at close."""
        self._check_open()
        if nbytes > self.tell() and stat.S_ISREG(os.fstat(self._fd).st_mode):
            preallocate(self._fd, 0, nbytes, self.name)
            self._reserved = max(self._reserved, nbytes)

    def copy_from(self, source, length: int, offset: int = 0, via: str = "buffers") -> None:
        """Appends ``length`` bytes of file ``source`` (a path, an open fd left open, or a
        :class:`~nvmeio.striping.StripedFile`, always read through the buffers) starting at
        ``offset``, never through Python objects.

        ``via="buffers"`` (default): read O_DIRECT into this writer's locked buffers
        and written O_DIRECT from them, the read of one buffer overlapping the write
        of the other (see [Note: copying through the buffers]). ``via="kernel"``:
        ``copy_file_range`` (a reflink where the file system shares blocks, else a
        page-cache copy inside the kernel; ``file_ops.copy_range`` falls back to
        pread/pwrite where the call is refused).
        """
        self._check_open()
        if length < 0 or offset < 0:
            raise ValueError(f"length and offset must be non-negative, got {length}, {offset}")
        if via not in ("buffers", "kernel"):
            raise ValueError(f"via must be 'buffers' or 'kernel', got {via!r}")
        t0 = time.perf_counter()
        own = not isinstance(source, (int, StripedFile))
        src = -1
        try:
            if self._fill:
                self._submit(last=True)  # what was written before lands first
            elif self._pending:
                self._io.handle.wait()
                self._pending = False
            if isinstance(source, StripedFile):  # read piece by piece through the handle (striping.py)
                self._copy_through_buffers(source, length, offset)
            elif via == "kernel":
                if self._copy_fd < 0:
                    # The O_DIRECT descriptor would need aligned copies: a buffered one of the same file.
                    self._copy_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY | os.O_CLOEXEC)
                src = os.open(source, os.O_RDONLY | os.O_CLOEXEC) if own else source
                copy_range(src, self._copy_fd, length, offset, self._base)
            else:
                src = open_direct(os.fspath(source), os.O_RDONLY)[0] if own else source
                self._copy_through_buffers(src, length, offset)
        except BaseException:
            self.abort()
            raise
        finally:
            if own and src >= 0:
                os.close(src)
        self._base += length
        self._io.stats.bytes_copied += length
        self._io.stats.copy_seconds += time.perf_counter() - t0

    def _copy_through_buffers(self, src: int, length: int, offset: int) -> None:
        """[Note: copying through the buffers]
        On file systems without shared blocks (ext4), ``copy_file_range`` copies
        through the page cache and the data must then be fsynced. Reading the
        source O_DIRECT into the locked buffers while the previous buffer is
        written O_DIRECT keeps both directions of the disk busy without the page
        cache, and measured faster (bench/checkpoint_io.py, bench/RESULTS.md)."""
        handle, bufs, size = self._io.handle, self._bufs, self._size
        if length == 0:
            return
        handle.sync_pread(bufs[0][:min(size, length)], src, offset)
        cur, done = 0, 0
        while done < length:
            k = min(size, length - done)
            preallocate(self._fd, self._base + done, k, self.name)
            handle.async_pwrite(bufs[cur][:k], self._fd, self._base + done)
            nxt = done + k
            if nxt < length and len(bufs) > 1:
                handle.async_pread(bufs[cur ^ 1][:min(size, length - nxt)], src, offset + nxt)
            handle.wait()
            if nxt < length:
                if len(bufs) > 1:
                    cur ^= 1
                else:
                    handle.sync_pread(bufs[0][:min(size, length - nxt)], src, offset + nxt)
            done = nxt

    def close(self) -> None:
        """Writes the rest, fsyncs and (atomic) renames over ``path``; idempotent."""
        if self.closed:
            return
        if self._done:  # aborted
            super().close()
            return
        try:
            if self._fill:
                self._submit(last=True)
            if self._pending:
                self._io.handle.wait()
                self._pending = False
            if self._reserved > self._base:
                os.ftruncate(self._fd, self._base)
            fsync_file(self._fd)
            self._close_fds()
            if self._tmp is not None:
                self._tmp.publish()  # fsync, rename (or link) over the target, fsync the directory
                self._tmp.close()
                self._tmp = None
        except BaseException:
            self.abort()
            raise
        stats = self._io.stats
        stats.files_written += 1
        stats.bytes_written += self._base
        stats.write_seconds += time.perf_counter() - self._start
        self._finish()
        super().close()

    def abort(self) -> None:
        """Drops what was written: the temporary file is removed (``path`` is
        untouched); with ``atomic=False`` the partly written file stays."""
        if self._done:
            return
        try:
            if self._pending:
                try:
                    self._io.handle.wait()
                except Exception:  # noqa: BLE001 - the file is discarded anyway
                    pass
                self._pending = False
        finally:
            self._close_fds()
            if self._tmp is not None:
                self._tmp.close()  # an unpublished temporary vanishes
                self._tmp = None
            self._finish()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            super().close()
        else:
            self.close()

    def __del__(self) -> None:
        if not self._done and getattr(self, "_io", None) is not None:
            warnings.warn(f"FastFileWriter({self.name!r}) was not closed: its bytes were "
                          "discarded (call close(), or use it in a with block)", ResourceWarning,
                          stacklevel=2)
            self.abort()

    def __repr__(self) -> str:
        return f"FastFileWriter({self.name!r}, atomic={self.atomic})"

    # -- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed or self._done:
            raise ValueError("I/O operation on a closed FastFileWriter")

    def _submit(self, last: bool = False) -> None:
        """Sends the current buffer to the file and switches to the other one."""
        self._base += submit_buffer(self, last)

    def _close_fds(self) -> None:
        for attr in ("_copy_fd", "_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)

    def _finish(self) -> None:
        self._done = True
        io_ = getattr(self, "_io", None)
        if io_ is not None:
            io_.release(self)
            if self._own_io:
                io_.close()


def submit_buffer(writer, last: bool) -> int:
    """A double-buffered writer's current buffer (``_bufs[_cur][:_fill]``) written at ``_base``
    of ``_fd`` through ``_io.handle``, after the other buffer's write is done; switches buffers
    (a single buffer, or ``last``: waits for this write too). Returns the bytes submitted."""
    handle = writer._io.handle
    if writer._pending:  # the other buffer's write must be done before it is refilled
        handle.wait()
        writer._pending = False
    nbytes = writer._fill
    preallocate(writer._fd, writer._base, nbytes, writer.name)
    handle.async_pwrite(writer._bufs[writer._cur][:nbytes], writer._fd, writer._base)
    writer._pending = True
    writer._fill = 0
    if len(writer._bufs) == 1 or last:
        handle.wait()
        writer._pending = False
    else:
        writer._cur ^= 1
    return nbytes
