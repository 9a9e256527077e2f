"""Fault injection: make nvmeio's native core fail the way disks and kernels do.

For tests of nvmeio and of the layers above it (swapper, engine). Compiled
in and off unless armed; armed, a plan reaches the requests of every handle
in the process::

    from nvmeio import faults

    with faults.inject(fail_nth=3, errno="ENOSPC", path_contains="optimizer", op="write") as fired:
        ...                      # the 3rd write request on a path containing "optimizer" fails
    assert fired()["failed"] == 1

or, for a whole process, the environment (read at the first native handle or
the first ``arm``/``inject``, whichever comes first, _process.py; a
RuntimeWarning says it is on)::

    NVMEIO_FAULTS="fail_nth=3,errno=ENOSPC,path_contains=optimizer,op=write" python train.py

Requests are counted in the order the worker threads issue them, among those
that match ``path_contains`` and ``op``. A request is one ``block_size``
engine request or one byte-exact pread/pwrite the core makes itself
(unaligned heads and tails, buffered files).

Plan fields (all optional):
    fail_nth, fail_count=1, errno="EIO": matching requests fail_nth ..
        fail_nth+fail_count-1 fail with errno (fail_count <= 0: every one from
        fail_nth on). The op they belong to raises an AioError from wait().
    short_nth, short_bytes=None: that matching request reports a short
        transfer of short_bytes (None: half the request); the core must
        finish it byte-exact.
    delay_us: every matching request completes this much later.
    submit_refusals, submit_errno="EAGAIN": the next N submission calls
        (io_submit, io_uring_enter, psync's queue) fail with submit_errno (-1:
        all of them). EAGAIN is backed off and retried (with nothing in flight
        the core gives up after 1 s and fails the requests); another errno
        fails the request (aio, psync) or breaks the engine (io_uring).
    engine_failure_nth, engine_failure_errno="EIO": the Nth completion wait
        (io_getevents / io_uring_enter) fails, as when the engine breaks: the
        core fails every op in flight on that worker and makes a new engine.
    engine_create_failures: the next N engines fail to start (with
        engine_failure_errno): a new handle raises; a worker replacing a
        broken engine fails every later op at once, naming both causes.
    path_contains: only requests on paths containing this string count.
    op: "read", "write" or None (both).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Iterator, Optional, Union

from . import _native
from . import env

__all__ = ["FaultPlan", "inject", "arm", "disarm", "fired", "plan_from_text", "ENV_VAR"]

ENV_VAR = "NVMEIO_FAULTS"
_OPS = {None: 0, "read": 1, "write": 2}


@dataclass(frozen=True)
class FaultPlan:
    fail_nth: int = 0
    fail_count: int = 1
    errno: Union[int, str] = "EIO"
    short_nth: int = 0
    short_bytes: Optional[int] = None
    delay_us: int = 0
    submit_refusals: int = 0
    submit_errno: Union[int, str] = "EAGAIN"
    engine_failure_nth: int = 0
    engine_failure_errno: Union[int, str] = "EIO"
    engine_create_failures: int = 0
    path_contains: str = ""
    op: Optional[str] = None

    def __post_init__(self) -> None:
        for f in ("fail_nth", "fail_count", "short_nth", "delay_us", "submit_refusals",
                  "engine_failure_nth", "engine_create_failures"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"fault plan: {f} must be an int, got {value!r}")
        for f in ("fail_nth", "short_nth", "delay_us", "engine_failure_nth",
                  "engine_create_failures"):
            if getattr(self, f) < 0:
                raise ValueError(f"fault plan: {f} must be >= 0, got {getattr(self, f)!r}")
        if self.op not in _OPS:
            raise ValueError(f"fault plan: op must be 'read', 'write' or None, got {self.op!r}")
        _errno_value("errno", self.errno)
        _errno_value("submit_errno", self.submit_errno)
        _errno_value("engine_failure_errno", self.engine_failure_errno)
        if "\0" in self.path_contains:
            raise ValueError("fault plan: path_contains must not contain a NUL byte")

    def _arm(self) -> None:
        _native.faults.arm(
            fail_nth=self.fail_nth, fail_count=self.fail_count,
            fail_errno=_errno_value("errno", self.errno), short_nth=self.short_nth,
            short_bytes=-1 if self.short_bytes is None else self.short_bytes,
            delay_us=self.delay_us, submit_refusals=self.submit_refusals,
            submit_errno=_errno_value("submit_errno", self.submit_errno),
            engine_failure_nth=self.engine_failure_nth,
            engine_failure_errno=_errno_value("engine_failure_errno", self.engine_failure_errno),
            engine_create_failures=self.engine_create_failures,
            path_contains=os.fsencode(self.path_contains), direction=_OPS[self.op])


def _errno_value(name: str, value: Union[int, str]) -> int:
    if isinstance(value, str):
        code = getattr(_errno, value.upper(), None)
        if not isinstance(code, int):
            raise ValueError(f"fault plan: {name} {value!r} is not an errno name (e.g. 'EIO', "
                             "'ENOSPC')")
        return code
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 4096:
        raise ValueError(f"fault plan: {name} must be an errno name or a positive errno number, "
                         f"got {value!r}")
    return value


_armed: Optional[FaultPlan] = None


def arm(plan: Optional[FaultPlan] = None, **kwargs) -> FaultPlan:
    """Arms ``plan`` (or ``FaultPlan(**kwargs)``) for the whole process; counts start at 0."""
    global _armed
    arm_from_env()
    plan = plan if plan is not None else FaultPlan(**kwargs)
    plan._arm()
    _armed = plan
    return plan


def disarm() -> None:
    """Turns injection off; ``fired()`` still reports what the last plan did."""
    global _armed
    _native.faults.disarm()
    _armed = None


def fired() -> dict:
    """What the armed (or last) plan has done: requests seen, failed, shortened,
    delayed, submit_refusals, engine_failures, engine_create_failures."""
    return dict(_native.faults.fired())


@contextlib.contextmanager
def inject(plan: Optional[FaultPlan] = None, **kwargs) -> Iterator:
    """Arms a plan for the block; yields ``fired`` (call it to read the counts).

    Refuses to nest: a plan is process-wide, and two would silently mix.
    """
    arm_from_env()
    if _armed is not None:
        raise RuntimeError(f"faults are already being injected ({_armed}); one plan at a time")
    arm(plan, **kwargs)
    try:
        yield fired
    finally:
        disarm()


def plan_from_text(text: str) -> FaultPlan:
    """``"fail_nth=3,errno=ENOSPC,op=write"`` -> FaultPlan (the NVMEIO_FAULTS syntax)."""
    names = {f.name: f for f in fields(FaultPlan)}
    kwargs: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise ValueError(f"{ENV_VAR}: {item!r} is not key=value with a key among "
                             f"{', '.join(names)}")
        value = value.strip()
        if key in ("path_contains", "op"):
            kwargs[key] = value
        elif key in ("errno", "submit_errno", "engine_failure_errno"):
            kwargs[key] = int(value) if value.isdigit() else value
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {key} must be an int, got {value!r}") from None
    return FaultPlan(**kwargs)


_env_read = False  # NVMEIO_FAULTS has been read (and armed, if set)


def arm_from_env() -> Optional[FaultPlan]:
    """Arms the plan in NVMEIO_FAULTS, if set, the first time it is called in the process
    (_process.py [Note: nothing happens on import]); a plan that does not parse raises, and
    is read again at the next call."""
    global _env_read
    if _env_read:
        return None
    text = (env.get(ENV_VAR) or "").strip()
    if not text:
        _env_read = True
        return None
    plan = plan_from_text(text)
    _env_read = True
    plan = arm(plan)
    shown = {k: v for k, v in asdict(plan).items() if v != getattr(FaultPlan, k)}
    warnings.warn(f"nvmeio: fault injection is ON ({ENV_VAR}={text!r}: {shown})", RuntimeWarning,
                  stacklevel=2)
    return plan
