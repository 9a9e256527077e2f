"""FastFileReader: a seekable, read-only file-like object that reads at disk speed.

    with nvmeio.FastFileReader("model.pt") as f:
        state_dict = torch.load(f, weights_only=True)

[Note: two ways a read is served]
``torch.load`` (like most readers of container formats) mixes many small
reads at scattered offsets (zip headers) with large ones (tensor data).
Reads are served from a window of the file held in a locked buffer; a miss
loads a small window (256 KiB: a scattered header needs no more), and a miss
at the end of the previous window (reading front to back) loads a whole
buffer and, with two buffers, starts reading the next one ahead, so the copy
out of one buffer overlaps the disk filling the other. A large read
(``direct_min`` bytes or more) into memory that sits on the same 4 KiB phase
as the file goes straight from the file into the caller's memory as one op,
without a copy; into other memory (torch's fresh storages, 64-byte aligned),
the window path measured twice as fast as the handle's bounce buffers.
The destination of a large read is populated (MADV_POPULATE_WRITE) chunk by
chunk before the copy: one syscall instead of a page fault per 4 KiB, which
measured markedly cheaper for filling fresh memory.
"""
from __future__ import annotations

import ctypes
import errno
import io
import os
import stat
import time
from typing import Iterator, Optional

from . import _native
from ._fast_buffers import DEFAULT_BUFFER_SIZE, IOBuffers
from .file_ops import open_direct, populate, seek_position
from .striping import StripedFile, check_parts_readable

__all__ = ["FastFileReader"]

_ALIGN = 4096
_SMALL_WINDOW = 256 << 10


def _check_regular(mode: int, name: str) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", name)
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "FastFileReader reads regular files only", name)


class FastFileReader(io.RawIOBase):
    """Reads ``path`` through an aio_handle (O_DIRECT where the file system allows).

    Args:
        path: the file to read, or a :class:`~nvmeio.StripedFile` (its logical bytes, every
            read cut into one op per stripe unit by the handle; no ``fileno``).
        io: a :class:`~nvmeio.FastIO` to borrow the handle and buffers from;
            by default a private one with ``buffer_size`` / ``double_buffer``.
        direct_min: reads of at least this many bytes go straight into the
            caller's buffer (see [Note: two ways a read is served]).

    ``read``, ``readinto``, ``readall``, ``seek``, ``tell``, ``fileno`` and
    ``close`` behave as for a file opened "rb".
    """

    def __init__(self, path, *, io: Optional[IOBuffers] = None,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, double_buffer: bool = True,
                 direct_min: int = 1 << 20):
        super().__init__()
        striped = isinstance(path, StripedFile)
        self.name = path.parts[0] if striped else os.fspath(path)
        self.direct_min = direct_min
        self._own_io = io is None
        self._io = io if io is not None else IOBuffers(buffer_size, double_buffer)
        self._fd = -1
        self._done = False
        try:
            self._io.acquire(self)
            if striped:
                for part in path.parts:
                    _check_regular(os.stat(part).st_mode, part)
                self.size = path.size()
                check_parts_readable(path, 0, self.size)  # a missing or short part, named before any read
                self._src, self.direct = path, True
            else:
                self._fd, self.direct = open_direct(self.name, os.O_RDONLY)
                st = os.fstat(self._fd)
                _check_regular(st.st_mode, self.name)
                self.size, self._src = st.st_size, self._fd
            self._bufs = self._io.buffers()
        except BaseException:
            self._finish()
            raise
        self._ptrs = [b.data_ptr() for b in self._bufs]
        self._pos = 0
        self._win = (0, 0, 0)         # (buffer index, file start, length)
        self._ahead: Optional[tuple] = None  # the same, being read ahead
        self._read = 0
        self._start = time.perf_counter()

    # -- file protocol ---------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._check_open()
        if self._fd < 0:
            raise io.UnsupportedOperation(f"{self.name} is striped over several files: it has no one descriptor")
        return self._fd

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._check_open()
        self._pos = seek_position(self._pos, self.size, offset, whence)
        return self._pos

    def readinto(self, buffer) -> int:
        self._check_open()
        view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        dst = _native.buffer_address(view, True)[0]
        done = 0
        while done < n:
            p = self._pos + done
            index, start, length = self._win
            if start <= p < start + length:
                k = min(n - done, start + length - p)
                if n >= self.direct_min:
                    populate(dst + done, k)
                ctypes.memmove(dst + done, self._ptrs[index] + (p - start), k)
                done += k
            elif n - done >= self.direct_min and (dst + done - p) % _ALIGN == 0:
                self._settle_ahead()
                self._io.handle.sync_pread(view[done:n], self._src, p)
                done = n
            else:
                self._load_window(p)
        self._pos += n
        self._read += n
        return n

    def views(self, offset: int, length: int) -> Iterator[memoryview]:
        """The bytes ``[offset, offset + length)`` as memoryviews of the locked buffers, in
        order, without a copy (to hash or scan a file at disk speed): each view is valid
        until the next one is asked for, while the disk fills the other buffer. The read
        position is left at ``offset + length``; a range past the end raises EOFError."""
        self._check_open()
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be non-negative, got {offset}, {length}")
        if offset + length > self.size:
            raise EOFError(f"{self.name}: bytes [{offset}, {offset + length}) pass its end ({self.size} bytes)")
        self._settle_ahead()
        self._win = (0, 0, 0)  # the buffers are reused below
        handle, bufs, size = self._io.handle, self._bufs, self._io.buffer_size
        pos, end = offset - offset % _ALIGN, offset + length
        cur, pending = 0, False
        try:
            if pos < end:
                handle.sync_pread(bufs[0][:min(size, self.size - pos)], self._src, pos)
            while pos < end:
                n = min(size, self.size - pos)
                nxt = pos + n
                if nxt < end and len(bufs) > 1:
                    handle.async_pread(bufs[cur ^ 1][:min(size, self.size - nxt)], self._src, nxt)
                    pending = True
                lo, hi = max(offset, pos) - pos, min(end, nxt) - pos
                yield memoryview(bufs[cur].numpy())[lo:hi]
                if pending:
                    handle.wait()
                    pending = False
                    cur ^= 1
                elif nxt < end:
                    handle.sync_pread(bufs[0][:min(size, self.size - nxt)], self._src, nxt)
                pos = nxt
        finally:
            if pending:
                handle.wait()
        self._pos = end
        self._read += length

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        n = self.readinto(out)
        return bytes(out[:n])

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._settle_ahead()
        finally:
            if not self._done:
                stats = self._io.stats
                stats.files_read += 1
                stats.bytes_read += self._read
                stats.read_seconds += time.perf_counter() - self._start
            self._finish()
            super().close()

    def __del__(self) -> None:
        if not self._done and getattr(self, "_io", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return f"FastFileReader({self.name!r})"

    # -- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed or self._done:
            raise ValueError("I/O operation on a closed FastFileReader")

    def _settle_ahead(self) -> Optional[tuple]:
        """Waits for a read-ahead in flight; returns its window."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._io.handle.wait()
        return ahead

    def _load_window(self, p: int) -> None:
        start = p - p % _ALIGN
        _, wstart, wlength = self._win
        sequential = wlength > 0 and p == wstart + wlength
        ahead = self._settle_ahead()
        if ahead is not None and ahead[1] == start:
            self._win = ahead
        else:
            index = 0  # nothing is in flight now: either buffer is free
            want = self._io.buffer_size if sequential else min(_SMALL_WINDOW, self._io.buffer_size)
            length = min(want, self.size - start)
            self._io.handle.sync_pread(self._bufs[index][:length], self._src, start)
            self._win = (index, start, length)
            if not sequential:
                return
        index, wstart, wlength = self._win
        nxt = wstart + wlength
        if len(self._bufs) > 1 and nxt < self.size:
            length = min(self._io.buffer_size, self.size - nxt)
            other = index ^ 1
            self._io.handle.async_pread(self._bufs[other][:length], self._src, nxt)
            self._ahead = (other, nxt, length)

    def _finish(self) -> None:
        self._done = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        io_ = getattr(self, "_io", None)
        if io_ is not None:
            io_.release(self)
            if self._own_io:
                io_.close()
