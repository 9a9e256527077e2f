"""How much host memory a pinned pool may take: free RAM and RLIMIT_MEMLOCK.

[Note: why the pool checks memory before it allocates]
DeepSpeed sized its locked swap buffers without looking at the machine, and
users met the result as a host OOM kill or an mlock failure deep inside the
first swap. Locked pages cannot be reclaimed, so a pool larger than the RAM the
kernel can give back (``MemAvailable``, which counts reclaimable page cache,
unlike ``MemFree``) or larger than the process may lock (``RLIMIT_MEMLOCK``,
ignored by the kernel when the process holds ``CAP_IPC_LOCK``) is refused up
front with both numbers in the message. The facts come from ``/proc``, which
is system information, not tensor data; where ``/proc`` is missing the check
falls back to ``sysconf`` and to the rlimit alone.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Optional

__all__ = ["HostMemory", "format_bytes", "PAGE_BYTES", "align_up", "status_bytes"]

_CAP_IPC_LOCK = 14
PAGE_BYTES = 4096  # the page; every pool buffer and span starts on one (O_DIRECT)


def align_up(n: int, alignment: int = PAGE_BYTES) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (whole pages by default)."""
    return (n + alignment - 1) // alignment * alignment


def format_bytes(n: int) -> str:
    """``n`` bytes as a short human-readable string (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def _proc_fields(path: str) -> dict:
    fields = {}
    try:
        with open(path, "r", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key.strip()] = rest.strip()
    except OSError:
        pass
    return fields


def status_bytes(field: str) -> Optional[int]:
    """A ``/proc/self/status`` size in bytes (``RssAnon``, ``VmLck``, ...); None where there is none."""
    value = _proc_fields("/proc/self/status").get(field)
    return int(value.split()[0]) * 1024 if value else None


@dataclass(frozen=True)
class HostMemory:
    """A snapshot of what this process may still allocate and lock.

    ``available_bytes``: RAM the kernel can hand out (MemAvailable).
    ``memlock_limit_bytes``: RLIMIT_MEMLOCK soft limit, ``None`` when unlimited
    or when the process has CAP_IPC_LOCK (the limit does not apply then).
    ``locked_bytes``: memory this process has locked already (VmLck).
    """

    available_bytes: int
    memlock_limit_bytes: Optional[int]
    locked_bytes: int

    @classmethod
    def probe(cls) -> "HostMemory":
        meminfo = _proc_fields("/proc/meminfo")
        if "MemAvailable" in meminfo:
            available = int(meminfo["MemAvailable"].split()[0]) * 1024
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        status = _proc_fields("/proc/self/status")
        locked = int(status["VmLck"].split()[0]) * 1024 if "VmLck" in status else 0
        has_cap = "CapEff" in status and bool(int(status["CapEff"], 16) >> _CAP_IPC_LOCK & 1)
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = None if (soft == resource.RLIM_INFINITY or has_cap) else int(soft)
        return cls(available_bytes=available, memlock_limit_bytes=limit, locked_bytes=locked)

    def refusal(self, nbytes: int, what: str, pin_memory: bool) -> Optional[str]:
        """Why ``nbytes`` for ``what`` cannot be allocated, or ``None`` if it can."""
        if nbytes > self.available_bytes:
            return (
                f"{what} needs {nbytes} bytes ({format_bytes(nbytes)}) of host memory, but only "
                f"{self.available_bytes} bytes ({format_bytes(self.available_bytes)}) are available; "
                f"lower buffer_count or buffer_size"
            )
        if pin_memory and self.memlock_limit_bytes is not None:
            room = self.memlock_limit_bytes - self.locked_bytes
            if nbytes > room:
                return (
                    f"{what} needs {nbytes} bytes ({format_bytes(nbytes)}) of locked memory, but "
                    f"RLIMIT_MEMLOCK allows {self.memlock_limit_bytes} bytes "
                    f"({format_bytes(self.memlock_limit_bytes)}) and {self.locked_bytes} bytes are "
                    f"locked already; raise the limit (ulimit -l), lower buffer_count or "
                    f"buffer_size, or pass pin_memory=False"
                )
        return None
