"""Exceptions of nvmeio: every I/O failure is an ``OSError`` subclass.

An :class:`AioError` carries ``errno``, ``filename`` (the path), ``offset``
and ``length`` of the failed range. Each is also an instance of the builtin
subclass for its errno, so ``except FileNotFoundError`` works as usual::

    try:
        h.sync_pread(t, "/missing/dir/x.bin")
    except FileNotFoundError as e:
        print(e.filename, e.offset, e.length)
"""

from __future__ import annotations

import errno as _errno
from functools import lru_cache

__all__ = ["AioError", "ShortReadError", "ValidationError", "make_error"]


class AioError(OSError):
    """A failed nvmeio operation: errno, path, file offset and length."""

    offset: int
    length: int

    def __str__(self) -> str:
        where = f"{self.filename!r}" if self.filename is not None else "<no path>"
        return (f"[Errno {self.errno}] {self.strerror}: {where} "
                f"(offset {self.offset}, length {self.length})")


class ShortReadError(AioError):
    """The file holds fewer bytes than the read asked for.

    A short read is always an error: nvmeio never hands back zero-filled data.
    """


class ValidationError(AioError):
    """``validate=True`` found the file and the buffer differ."""


@lru_cache(maxsize=None)
def _class_for(err: int) -> type:
    if err == _errno.ENODATA:
        return ShortReadError
    builtin = type(OSError(err, ""))  # OSError maps errno to its subclass
    if builtin is OSError:
        return AioError
    return type(f"Aio{builtin.__name__}", (AioError, builtin), {"__module__": __name__})


def make_error(err: int, message: str, path: str | None, offset: int, length: int) -> AioError:
    """Builds the exception for one failed op (called by the native core)."""
    exc = _class_for(err)(err, message, path)
    exc.offset = offset
    exc.length = length
    return exc
