"""What the process needs once before nvmeio's first native handle.

[Note: nothing happens on import]
``import nvmeio`` changes nothing in the process: a library imported for one
helper (``did_you_mean``, ``AioSettings``) must not raise the open-file limit
or arm fault injection behind its importer's back, and an import never fails
for a setting that no call uses. Both happen at the first use of the native
I/O core instead, once per process: every native handle (``aio_handle``,
``gds_handle``, the probe behind ``backend="auto"``, a CUDA staging engine)
is made by :func:`native_handle`, which calls :func:`prepare` first.

- The soft ``RLIMIT_NOFILE`` is raised to the hard one: each op in flight holds
  its file open, and thousands of small async ops (one file per tensor)
  exceed the usual soft limit of 1024.
- ``NVMEIO_FAULTS`` is read and armed (faults.py): a RuntimeWarning says so,
  and a plan that does not parse fails the first handle (and every later one),
  naming the variable. The first ``faults.arm()`` or ``faults.inject()``
  reads it too, so that a plan from the environment and one armed by a test
  still meet as they did when the environment's was armed at import.
"""

from __future__ import annotations

import resource
import threading

from . import _native, faults

_lock = threading.RLock()
_prepared = False


def native_handle(**settings) -> "_native.Handle":
    """A native handle of ``settings`` (see native/handle.h), the process prepared first."""
    prepare()
    return _native.Handle(**settings)


def prepare() -> None:
    """Raises the open-file limit and arms ``NVMEIO_FAULTS``, once (see the note). A plan that
    does not parse raises here, and again at the next call."""
    global _prepared
    if _prepared:
        return
    with _lock:
        if _prepared:
            return
        raise_open_file_limit()
        faults.arm_from_env()
        _prepared = True


def raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
