"""FastIO: one aio_handle and its locked I/O buffers, lent to one fast file at a time.

    with nvmeio.FastIO() as io:                      # 2 x 64 MiB locked buffers
        with io.writer("model.pt") as f:
            torch.save(state, f)                     # at disk speed, atomic
        with io.reader("model.pt") as f:
            state = torch.load(f, weights_only=True)

A writer or reader made on its own (``FastFileWriter(path)``) makes a private
FastIO and closes it with the file. Saving many files (a checkpoint's shards)
through one FastIO sets the handle and the buffers up once.

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

from .aio_handle import aio_handle

__all__ = ["FastIO", "FastIOStats", "DEFAULT_BUFFER_SIZE"]

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


class FastIO:
    """An aio_handle plus one or two locked buffers of ``buffer_size`` bytes.

    Args:
        buffer_size: bytes per I/O buffer (rounded up to 4096); each buffer is
            written or read as one op of the handle.
        double_buffer: two buffers (the next one fills while the last one is
            written) instead of one.
        handle: an aio_handle to use (kept open on close); by default one with
            ``block_size=1 MiB, queue_depth=32, intra_op_parallelism=4``.

    One file at a time: opening a second file while one is open raises.
    """

    def __init__(self, buffer_size: int = DEFAULT_BUFFER_SIZE, double_buffer: bool = True,
                 handle: Optional[aio_handle] = None):
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
            raise ValueError(f"buffer_size must be a positive number of bytes, got {buffer_size!r}")
        self.buffer_size = -(-buffer_size // _ALIGN) * _ALIGN
        self.double_buffer = bool(double_buffer)
        self._own_handle = handle is None
        self.handle = handle if handle is not None else aio_handle(
            block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
        self._buffers: list = []
        self._user: Optional[object] = None
        self._lock = threading.Lock()
        self.stats = FastIOStats()
        self.closed = False

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
                raise ValueError("this FastIO is closed")
            current = self._user() if self._user is not None else None
            if current is not None:
                raise RuntimeError(f"this FastIO already serves {current!r}; it lends its "
                                   "buffers to one open file at a time (close that one first)")
            self._user = weakref.ref(user)  # no cycle: a dropped file is collected at once

    def release(self, user: object) -> None:
        with self._lock:
            if self._user is not None and self._user() in (user, None):
                self._user = None

    def writer(self, path, atomic: bool = True):
        """A :class:`~nvmeio.FastFileWriter` of ``path`` on this FastIO."""
        from .fast_writer import FastFileWriter

        return FastFileWriter(path, atomic=atomic, io=self)

    def reader(self, path):
        """A :class:`~nvmeio.FastFileReader` of ``path`` on this FastIO."""
        from .fast_reader import FastFileReader

        return FastFileReader(path, io=self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for b in self._buffers:
            self.handle.free_cpu_locked_tensor(b)
        self._buffers.clear()
        if self._own_handle:
            self.handle.close()

    def __enter__(self) -> "FastIO":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FastIO(buffer_size={self.buffer_size}, double_buffer={self.double_buffer})"
