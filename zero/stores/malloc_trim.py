"""Give freed heap pages back to the operating system.

Tensors of a few MiB come from glibc's heap (its mmap threshold rises to 32 MiB
after the first large free), and a tensor freed below a live allocation leaves
a hole that the next tensor of the same size does not fit (torch asks for
64-byte alignment, a few bytes more than the hole). Building or loading a
model one module at a time would so keep every module's freed memory in the
process, counted in its RSS, although nothing uses it. ``malloc_trim`` returns
those pages.
"""
from __future__ import annotations


def return_freed_heap() -> None:
    """``malloc_trim(0)`` where the C library is glibc; nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


class FreedBytes:
    """Counts bytes freed and trims the heap each time ``every`` bytes have been freed."""

    def __init__(self, every: int = 32 << 20):
        self.every = every
        self.pending = 0

    def add(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            self.pending = 0
            return_freed_heap()
