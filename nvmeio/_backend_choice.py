"""What ``backend="auto"`` means: the fastest backend, measured, not assumed.

[Note: how auto is decided]
Once per process, on first use, each available backend moves a typical mix
through a small file: one 8 MiB op each way plus 64 ops of 64 KiB, from a
locked buffer, 5 rounds with the backends alternating so that disk noise
hits all alike. The probe is short and the disk noisy (a loaded machine
once made psync look fastest), so the order io_uring, aio, psync is kept
unless a later backend's median time is at least MARGIN (15%) better: psync
cannot queue requests and wins only where queues do not work. The probe runs in
``$NVMEIO_PROBE_DIR`` (default: the system temp directory); put that on the
NVMe for a choice that reflects it, or name the backend with
``NVMEIO_BACKEND`` or ``nvme_tune``'s ``"backend"``. A probe that cannot run
(no writable directory) falls back to the first available backend in
io_uring, aio, psync order.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
import warnings

from . import _native
from . import env
from ._process import native_handle

__all__ = ["available_backends", "fastest_backend", "measure_backends", "resolve_backend"]

_chosen: str | None = None
_SMALL = 64 * 1024
_BIG = 8 << 20
MARGIN = 0.15


@functools.lru_cache(maxsize=None)
def _probed_backends() -> tuple[str, ...]:
    # Probing sets up and tears down a ring and an AIO context (~30 ms); what
    # the kernel allows does not change while the process runs.
    return tuple(_native.available_backends())


def available_backends() -> list[str]:
    """Backends this build has and this kernel allows (io_uring, aio, psync order)."""
    return list(_probed_backends())


def resolve_backend(backend: str) -> str:
    """The backend a handle asked for ``backend`` uses; ValueError if it is not here."""
    if backend == "auto":
        return fastest_backend()
    available = available_backends()
    if backend not in available:
        raise ValueError(f"backend {backend!r} is not available here; available backends: "
                         f"{', '.join(available)}")
    return backend


def _one_round(backend: str, path: str, buf) -> float:
    # The native handle directly (an aio_handle would resolve "auto" through this module).
    h = native_handle(block_size=1 << 20, queue_depth=32, single_submit=False,
                       overlap_events=False, intra_op_parallelism=1, backend=backend,
                       direct_io=env.get("NVMEIO_DIRECT_IO"))
    ptr = buf.ptr
    start = time.perf_counter()
    for write in (True, False):
        h.submit(write, ptr, _BIG, path, 0)
        h.wait()
    for write in (True, False):
        for i in range(64):
            h.submit(write, ptr + i * _SMALL, _SMALL, path, i * _SMALL)
        h.wait()
    elapsed = time.perf_counter() - start
    h.close()
    return elapsed


def measure_backends(directory: str | None = None, rounds: int = 5) -> dict[str, float]:
    """Median seconds of the probe mix per available backend."""
    backends = available_backends()
    directory = directory or env.get("NVMEIO_PROBE_DIR") or tempfile.gettempdir()
    buf = _native.LockedBuffer(_BIG, True)
    times: dict[str, list[float]] = {b: [] for b in backends}
    # Created exclusively with a random name, then reached only through its
    # descriptor: nothing planted in a shared directory can redirect the probe.
    fd, name = tempfile.mkstemp(prefix=".nvmeio-probe-", dir=directory)
    path = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else name
    try:
        for r in range(rounds):
            for b in (backends if r % 2 == 0 else backends[::-1]):
                times[b].append(_one_round(b, path, buf))
    finally:
        os.close(fd)
        os.unlink(name)
    return {b: statistics.median(t) for b, t in times.items()}


def pick(times: dict[str, float]) -> str:
    """The first backend in preference order unless a later one is clearly faster."""
    order = list(times)  # available_backends() order: io_uring, aio, psync
    chosen = order[0]
    for b in order[1:]:
        if times[b] < times[chosen] * (1 - MARGIN):
            chosen = b
    return chosen


def fastest_backend() -> str:
    """The backend ``"auto"`` resolves to in this process (see the note)."""
    global _chosen
    if _chosen is None:
        forced = env.get("NVMEIO_BACKEND")
        available = available_backends()
        if forced:
            if forced not in available:
                raise ValueError(f"NVMEIO_BACKEND={forced!r} is not available here; available "
                                 f"backends: {', '.join(available)}")
            _chosen = forced
        elif len(available) == 1:
            _chosen = available[0]
        else:
            try:
                _chosen = pick(measure_backends())
            except OSError as e:
                warnings.warn(f"nvmeio: could not measure the backends ({e}); using "
                              f"{available[0]!r}", RuntimeWarning, stacklevel=2)
                _chosen = available[0]
    return _chosen
