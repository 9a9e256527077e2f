"""What this process holds that an I/O library could leak.

Open file descriptors, threads, locked memory (VmLck) and kernel AIO
contexts (each maps an ``[aio]`` ring into the process; counting them here,
not in the system-wide ``fs.aio-nr``, keeps other processes out of the
figure). Used by the tests and by the reliability report (``bench/reliability/``): take a
``snapshot()`` before, another after, and ``grown(before, after)`` names what
was not given back.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

__all__ = ["Resources", "snapshot", "grown"]


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
