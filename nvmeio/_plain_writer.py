"""PlainFileWriter: the FastFileWriter interface on ordinary buffered file I/O.

For ``checkpoint.writer.type: python`` (DeepSpeed's PyFileWriter) and for
file systems where direct I/O is unwanted: the same atomic replacement
(see [Note: atomic replacement of a file] in file_ops), the same
``copy_from``, without an aio_handle or locked buffers.
"""
from __future__ import annotations

import io
import os
import time
import warnings
from typing import Optional

from .atomic_file import TempFile, fsync_file, is_device_node
from ._fast_buffers import FastIOStats
from .file_ops import copy_range, temp_beside

__all__ = ["PlainFileWriter"]


class PlainFileWriter(io.RawIOBase):
    """Writes ``path`` front to back with ``os.write``; fsync and rename at ``close()``."""

    def __init__(self, path, *, atomic: bool = True, stats: Optional[FastIOStats] = None):
        super().__init__()
        self.name = os.fspath(path)
        self.atomic = bool(atomic)
        self.stats = stats if stats is not None else FastIOStats()
        self._tmp: Optional[TempFile] = None
        if self.atomic:
            self._tmp, self._fd, _ = temp_beside(self.name, direct=False)
        else:
            is_device_node(self.name)  # refuses a FIFO or socket (its open would block)
            self._fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600)
        self._pos = 0
        self._done = False
        self._start = time.perf_counter()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def write(self, data) -> int:
        self._check_open()
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.write(self._fd, view)
                self._pos += n
                view = view[n:]
        except BaseException:
            self.abort()
            raise
        return len(memoryview(data).cast("B"))

    def copy_from(self, source, length: int, offset: int = 0, via: str = "kernel") -> None:
        """Appends ``length`` bytes of ``source`` (path or fd) from ``offset`` (copy_file_range;
        ``via`` is accepted for the FastFileWriter interface: this writer has no buffers)."""
        self._check_open()
        t0 = time.perf_counter()
        own = not isinstance(source, int)
        try:
            src = os.open(source, os.O_RDONLY | os.O_CLOEXEC) if own else source
            try:
                copy_range(src, self._fd, length, offset, self._pos)
            finally:
                if own:
                    os.close(src)
            self._pos += length
            os.lseek(self._fd, self._pos, os.SEEK_SET)
        except BaseException:
            self.abort()
            raise
        self.stats.bytes_copied += length
        self.stats.copy_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.closed:
            return
        if not self._done:
            try:
                fsync_file(self._fd)
                os.close(self._fd)
                self._fd = -1
                if self._tmp is not None:
                    self._tmp.publish()
                    self._tmp.close()
                    self._tmp = None
            except BaseException:
                self.abort()
                raise
            self.stats.files_written += 1
            self.stats.bytes_written += self._pos
            self.stats.write_seconds += time.perf_counter() - self._start
            self._done = True
        super().close()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp is not None:
            self._tmp.close()  # an unpublished temporary vanishes
            self._tmp = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            super().close()
        else:
            self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            warnings.warn(f"PlainFileWriter({self.name!r}) was not closed: its bytes were discarded",
                          ResourceWarning, stacklevel=2)
            self.abort()

    def _check_open(self) -> None:
        if self.closed or self._done:
            raise ValueError("I/O operation on a closed PlainFileWriter")
