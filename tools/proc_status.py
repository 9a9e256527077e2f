"""The benchmarks' view of their own process: ``/proc/self/status`` fields in bytes."""
from __future__ import annotations


def status_bytes(key: str) -> int:
    """``/proc/self/status``'s ``key`` (VmHWM, RssAnon, ...) in bytes; 0 where it is absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
