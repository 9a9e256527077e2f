"""glibc malloc settings for training whose compute runs on the CPU.

[Note: fresh pages on every allocation]
With compute on the CPU, every gradient and activation is a host tensor of a
few MiB to a few tens of MiB, allocated and freed many times an iteration (a
window of k micro-batches keeps k gradients of a unit at once, each made on a
thread of its own). glibc's defaults give such tensors fresh pages each time:
above its dynamic mmap threshold a tensor is an mmap of its own, and each
thread's arena is trimmed as soon as its top chunk is free, so the next
tensor faults its pages in again and the kernel zeroes every one of them. On
the 2-CPU benchmark machine that was a quarter of the CPU time of an I/O-bound
iteration (311M GPT, batch 1 x 8 tokens: 5.7 million page faults in three
k = 16 windows), and a core zeroing pages is a core the matrix products'
second thread waits for. :func:`tune_for_cpu_training` keeps freed memory in
the process for the next tensor: one arena for every thread (the window's k
threads run one at a time, so they never contend for it), a fixed mmap
threshold at glibc's largest (32 MiB: only larger tensors are mmaps of their
own), and no automatic trimming. The engine still gives freed pages back at
its own points (``malloc_trim.return_freed_heap``: after a window, after the
build), so the resident size stays that of the largest iteration. The same
window went from 14.1 s to 10.0 s with its model in memory, the micro-batch
loop from 10.3 s to 8.5 s.

The settings are the process's, and glibc's only: ``NVMEIO_MALLOC_TUNING=0``
leaves malloc as it is; another C library is left alone.
"""
from __future__ import annotations

import ctypes
import logging

from nvmeio.env import env_flag

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, (1 << 31) - 1),
            (_M_TOP_PAD, 256 << 20))

_applied = False
log = logging.getLogger(__name__)


def tune_for_cpu_training() -> bool:
    """Apply :data:`SETTINGS` once per process (see the note); whether they are in effect."""
    global _applied
    if _applied:
        return True
    if not env_flag("NVMEIO_MALLOC_TUNING", True):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt takes other numbers
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    failed = [name for name, value in SETTINGS if mallopt(name, value) != 1]
    if failed:
        log.debug("mallopt refused %s", failed)
    _applied = True
    return True
