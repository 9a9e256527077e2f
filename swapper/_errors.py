"""Exceptions raised by the swapper layer.

Every error names the numbers and the file involved, so that a failed run says
what to change (buffer_count, buffer_size, free space, a stale directory)
instead of asserting.
"""
from __future__ import annotations

import errno as _errno
from typing import Optional


class SwapError(Exception):
    """Base class of every error raised by :mod:`swapper`."""


class _OSErrorWithMessage(SwapError, OSError):
    """An ``OSError`` whose ``str()`` is its whole message (``errno`` and ``filename`` set too)."""

    errno_code = _errno.EIO

    def __init__(self, message: str, filename: Optional[str] = None):
        super().__init__(self.errno_code, message)
        self.message = message
        self.filename = filename

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.filename))


class PoolExhaustedError(SwapError, RuntimeError):
    """More pool buffers were asked for than are (or ever can be) free."""


class BufferTooSmallError(SwapError, ValueError):
    """A tensor does not fit the pool's ``buffer_size``."""


class InsufficientHostMemoryError(SwapError, MemoryError):
    """The pool would not fit in available RAM or under RLIMIT_MEMLOCK."""


class InsufficientSwapSpaceError(_OSErrorWithMessage):
    """The file system under ``nvme_path`` has less free space than the swap files need."""

    errno_code = _errno.ENOSPC


class SwapDirectoryInUseError(_OSErrorWithMessage, FileExistsError):
    """The swap directory belongs to a process that is still running."""

    errno_code = _errno.EEXIST


class StaleSwapDirectoryError(_OSErrorWithMessage, FileExistsError):
    """The swap directory was left behind by a job that is no longer running."""

    errno_code = _errno.EEXIST


class SwapCorruptionError(_OSErrorWithMessage):
    """A swap file no longer holds the bytes that were written to it."""


class SwapFileTruncatedError(SwapCorruptionError):
    """A swap file is shorter than the data that was written to it."""


class SwapStateError(SwapError, RuntimeError):
    """An operation does not fit the current state of a partition or sub-group."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678) where the interpreter supports it."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
