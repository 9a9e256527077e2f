"""What this process holds that an I/O library could leak.

Open file descriptors, threads, locked memory (VmLck) and kernel AIO
contexts (each maps an ``[aio]`` ring into the process; counting them here,
not in the system-wide ``fs.aio-nr``, keeps other processes out of the
figure). Used by the tests and by the reliability report (``bench/reliability/``): take a
``snapshot()`` before, another after, and ``grown(before, after)`` names what
was not given back.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass

__all__ = ["Resources", "snapshot", "grown", "grown_since"]


@dataclass(frozen=True)
class Resources:
    fds: int
    threads: int
    vmlck_kib: int
    aio_contexts: int


def _vmlck_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def _aio_contexts() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/[aio] (deleted)"))


def snapshot() -> Resources:
    return Resources(fds=len(os.listdir("/proc/self/fd")) - 1,  # less listdir's own
                     threads=len(os.listdir("/proc/self/task")),
                     vmlck_kib=_vmlck_kib(), aio_contexts=_aio_contexts())


def grown(before: Resources, after: Resources) -> dict:
    """The resources that grew from ``before`` to ``after``, by how much ({} when none did)."""
    b, a = asdict(before), asdict(after)
    return {k: a[k] - b[k] for k in a if a[k] > b[k]}


def grown_since(before: Resources, settle_s: float = 2.0) -> dict:
    """:func:`grown` from ``before`` to now, after a garbage collection (finalizers give their
    resources back). A thread joined a moment ago may still be listed under /proc/self/task: the
    kernel wakes the joiner before it unlists the exiting thread, and on a busy machine that
    thread can wait for a core in between. So while threads are all that grew, this looks again
    for up to ``settle_s`` seconds; a thread left running stays listed."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    while True:
        now = grown(before, snapshot())
        if set(now) != {"threads"} or time.monotonic() >= deadline:
            return now
        time.sleep(0.01)
