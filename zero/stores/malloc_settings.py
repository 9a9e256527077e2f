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
second thread waits for. While an engine trains on the CPU (:func:`hold`),
freed memory stays in the process for the next tensor: one arena for every
thread (the window's k threads run one at a time, so they never contend for
it), a fixed mmap threshold at glibc's largest (32 MiB: only larger tensors
are mmaps of their own), and no automatic trimming. The engine still gives
freed pages back at its own points (``malloc_trim.return_freed_heap``: after
a window, after the build), so the resident size stays that of the largest
iteration; once the last such engine is destroyed (:func:`let_go`), trimming
is back at glibc's defaults and the freed heap goes back to the system. The
same window went from 14.1 s to 10.0 s with its model in memory, the
micro-batch loop from 10.3 s to 8.5 s.

[Note: the heap between steps]
Kept in the process, freed memory does not stay the size of an iteration's
working set: a freed tensor leaves a hole the next one of its size does not
quite fit (stores/malloc_trim.py), so each iteration touches some pages it
had not, and the resident size grows step after step. The LoRA stand-in with
its base int8 (a fresh dequantized tensor per frozen unit and fetch) grew by
0.38 GiB an iteration, 1.2 -> 4.8 GiB in ten. So at the end of each step
(:func:`step_ended`) the anonymous resident size is compared with the one at
the end of the first step after the last trim, the iteration's working set,
and the heap is trimmed once it has grown past it by a quarter (at least
256 MiB): the pages an iteration reuses stay, the resident size stays
bounded, and a trim is rare (``train_batch`` trims after every window).

The settings are the process's, and glibc's only: ``NVMEIO_MALLOC_TUNING=0``
leaves malloc as it is; another C library is left alone.
"""
from __future__ import annotations

import ctypes
import logging

from nvmeio import env
from swapper.host_memory import status_bytes

from .malloc_trim import return_freed_heap

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, (1 << 31) - 1),
            (_M_TOP_PAD, 256 << 20))

# While no engine trains: glibc's defaults for trimming (128 KiB each), so a process that trained
# and goes on to other work gives its freed heap back as before.
RELAXED = ((_M_TRIM_THRESHOLD, 128 << 10), (_M_TOP_PAD, 128 << 10))

_holders = 0  # CPU-training engines alive
_working_set = None  # anonymous resident bytes at the end of the first step after the last trim
GROWTH_BYTES = 256 << 20
log = logging.getLogger(__name__)


def _mallopt():
    if not env.get("NVMEIO_MALLOC_TUNING"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: another libc's mallopt takes other numbers
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def _apply(settings) -> bool:
    mallopt = _mallopt()
    if mallopt is None:
        return False
    failed = [name for name, value in settings if mallopt(name, value) != 1]
    if failed:
        log.debug("mallopt refused %s", failed)
    return True


def hold() -> bool:
    """A CPU-training engine starts: :data:`SETTINGS` in effect until its :func:`let_go` (see the
    note); False where they are not (opted out, not glibc), and then no ``let_go``."""
    global _holders
    if not _apply(SETTINGS):
        return False
    _holders += 1
    return True


def let_go() -> None:
    """A :func:`hold`'s engine is gone: after the last, trimming is back on and the freed heap
    goes back to the system at once."""
    global _holders
    _holders -= 1
    if _holders == 0:
        _apply(RELAXED)
        return_freed_heap()


def step_ended() -> None:
    """A step of a CPU-training engine ended: trim the heap where it has outgrown an iteration's
    working set (see [Note: the heap between steps])."""
    global _working_set
    if _holders == 0:
        return
    now = status_bytes("RssAnon")
    if _working_set is None or now is None:
        _working_set = now
    elif now > _working_set + max(GROWTH_BYTES, _working_set // 4):
        return_freed_heap()
        _working_set = None
