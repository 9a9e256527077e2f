"""StripedPageReader: a :class:`~nvmeio.StripedFile` read through the page cache.

The striped counterpart of ``open(path, "rb", buffering=0)``: for small scattered reads of
many files (a checkpoint's shards read range by range), where setting up locked buffers per
file would cost more than the reads. Each read is cut at stripe units and served by one
``pread`` per piece from the part that holds it (striping.py [Note: striping]).
"""
from __future__ import annotations

import io
import os

from .file_ops import seek_position
from .striping import StripedFile

__all__ = ["StripedPageReader"]


class StripedPageReader(io.RawIOBase):
    """Reads the logical bytes of ``f``; ``size`` is its logical size. A read stops at the
    first piece a part cannot serve (a part cut short), as a plain file's read stops at its end."""

    def __init__(self, f: StripedFile):
        super().__init__()
        self.name = f.parts[0]
        self._f = f
        self._fds = []
        try:
            for part in f.parts:
                self._fds.append(os.open(part, os.O_RDONLY | os.O_CLOEXEC))
        except BaseException:
            self.close()
            raise
        self.size = f.size_from_parts([os.fstat(fd).st_size for fd in self._fds])
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = seek_position(self._pos, self.size, offset, whence)
        return self._pos

    def readinto(self, buffer) -> int:
        if self.closed:
            raise ValueError("I/O operation on a closed StripedPageReader")
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        done = 0
        for piece in self._f.pieces(self._pos, n):
            got = os.preadv(self._fds[piece.part], [view[piece.start:piece.start + piece.length]], piece.file_offset)
            done += got
            if got < piece.length:
                break
        self._pos += done
        return done

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        super().close()
