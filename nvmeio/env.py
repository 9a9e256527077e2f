"""The one reader of ``NVMEIO_*`` environment variables.

Every variable read from the environment goes through these functions, so
each variable has one spelling convention:

- a flag accepts ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case,
  surrounding spaces ignored); anything else is an error that names the
  variable, never a silent default;
- an integer is a decimal number with a minimum;
- a variable set to the empty string counts as unset.

The variables: ``NVMEIO_BACKEND`` (what ``backend="auto"`` means),
``NVMEIO_PROBE_DIR`` (where "auto" measures), ``NVMEIO_DIRECT_IO`` (flag,
default on), ``NVMEIO_MLOCK`` (flag, default on),
``NVMEIO_STAGING_CHUNK_BYTES`` and ``NVMEIO_STAGING_CHUNKS`` (CUDA staging),
``NVMEIO_FAULTS`` (fault injection, see faults.py), ``NVMEIO_JOB_ID`` (the swap
directory's job id, zero/engine/build.py), ``NVMEIO_MALLOC_TUNING`` (flag, default
on: glibc malloc settings for CPU training, zero/stores/malloc_settings.py);
and DeepSpeed's ``DEEPSPEED_TIMEOUT`` (minutes the process group zero makes
waits for a rank, zero/runtime/comm.py).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["env_flag", "env_int", "env_str"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_str(name: str) -> Optional[str]:
    """The variable's value, or None when it is unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable; ValueError for a value that is not one of the spellings above."""
    raw = env_str(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of "
                     f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def env_int(name: str, default: int, minimum: int) -> int:
    """An integer variable of at least ``minimum``; ValueError otherwise."""
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value
