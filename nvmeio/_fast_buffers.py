"""IOBuffers: one aio_handle and its locked I/O buffers, lent to one fast file at a time;
the base of :class:`nvmeio.FastIO` (_fast_io.py), kept apart so that the readers and
writers that borrow the buffers do not import the class that makes them.

Settings mirror DeepSpeed's ``checkpoint.writer`` section: ``buffer_size``
is ``io_buffer_size`` (bytes per buffer), ``double_buffer`` is
``io_buffer_double`` (copy into one buffer while the other is on its way to
the disk).
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import Optional

from ._handle import aio_handle

__all__ = ["IOBuffers", "FastIOStats", "DEFAULT_BUFFER_SIZE"]

DEFAULT_BUFFER_SIZE = 64 << 20  # DeepSpeed's io_buffer_size default (64e6), rounded to MiB
_ALIGN = 4096


@dataclasses.dataclass
class FastIOStats:
    """What the files of one FastIO moved (``show_statistics`` prints it)."""

    files_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    files_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_copied: int = 0      # moved file to file (copy_from)
    copy_seconds: float = 0.0
    bytes_linked: int = 0      # made part of a file by a hard link, not moved at all

    def summary(self) -> str:
        def size(n: int) -> str:
            for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
                if n >= scale:
                    return f"{n / scale:.2f} {unit}"
            return f"{n} bytes"

        def rate(n: int, s: float) -> str:
            return f"{n / s / (1 << 30):.2f} GiB/s" if s > 0 and n else "-"
        return (f"wrote {self.files_written} files, {size(self.bytes_written)} "
                f"({rate(self.bytes_written, self.write_seconds)}); read {self.files_read} files, "
                f"{size(self.bytes_read)} ({rate(self.bytes_read, self.read_seconds)}); "
                f"copied {size(self.bytes_copied)} file to file "
                f"({rate(self.bytes_copied, self.copy_seconds)}); linked {size(self.bytes_linked)}")


class IOBuffers:
    """An aio_handle plus one or two locked buffers of ``buffer_size`` bytes.

    Args:
        buffer_size: bytes per I/O buffer (rounded up to 4096); each buffer is
            written or read as one op of the handle.
        double_buffer: two buffers (the next one fills while the last one is
            written) instead of one.
        handle: an aio_handle to use (kept open on close); by default one with
            ``block_size=1 MiB, queue_depth=32, intra_op_parallelism=4``.
        buffers: the caller's buffers (one or two 1-D uint8 host tensors of one size),
            used as they are instead of locked ones made here, and never freed here
            (``buffer_size`` and ``double_buffer`` then follow from them).

    One file at a time: opening a second file while one is open raises.
    """

    def __init__(self, buffer_size: int = DEFAULT_BUFFER_SIZE, double_buffer: bool = True,
                 handle: Optional[aio_handle] = None, buffers: Optional[list] = None):
        self._own_buffers = buffers is None
        if buffers is not None:
            if not 1 <= len(buffers) <= 2 or len({b.numel() for b in buffers}) != 1:
                raise ValueError("buffers must be one or two tensors of the same size")
            buffer_size, double_buffer = buffers[0].numel(), len(buffers) == 2
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
            raise ValueError(f"buffer_size must be a positive number of bytes, got {buffer_size!r}")
        self.buffer_size = buffer_size if buffers is not None else -(-buffer_size // _ALIGN) * _ALIGN
        self.double_buffer = bool(double_buffer)
        self._own_handle = handle is None
        self.handle = handle if handle is not None else aio_handle(
            block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
        self._buffers: list = list(buffers) if buffers is not None else []
        self._user: Optional[object] = None
        self._lock = threading.Lock()
        self.stats = FastIOStats()
        self.closed = False

    @property
    def buffers_made(self) -> bool:
        """Whether the locked buffers exist already (made at first use)."""
        return bool(self._buffers)

    def buffers(self) -> list:
        """The locked buffers (uint8 tensors), allocated on first use."""
        if not self._buffers:
            import torch

            with warnings.catch_warnings():
                # Locking may fail (memlock limit): the buffers are still
                # page-aligned; speed is lower, results are the same.
                warnings.simplefilter("ignore", RuntimeWarning)
                for _ in range(2 if self.double_buffer else 1):
                    self._buffers.append(self.handle.new_cpu_locked_tensor(
                        self.buffer_size, torch.empty(0, dtype=torch.uint8)))
        return self._buffers

    def acquire(self, user: object) -> None:
        with self._lock:
            if self.closed:
                raise ValueError(f"this {type(self).__name__} is closed")
            current = self._user() if self._user is not None else None
            if current is not None:
                raise RuntimeError(f"this {type(self).__name__} already serves {current!r}; it lends its "
                                   "buffers to one open file at a time (close that one first)")
            self._user = weakref.ref(user)  # no cycle: a dropped file is collected at once

    def release(self, user: object) -> None:
        with self._lock:
            if self._user is not None and self._user() in (user, None):
                self._user = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._own_buffers:
            for b in self._buffers:
                self.handle.free_cpu_locked_tensor(b)
        self._buffers.clear()
        if self._own_handle:
            self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(buffer_size={self.buffer_size}, double_buffer={self.double_buffer})"
