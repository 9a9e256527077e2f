"""Checks of a directory before any I/O: exists, writable, O_DIRECT, free space.

Used by nvme_tune (refuse a bad --nvme_dir before anything starts) and by
nvmeio_report (``--dir``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["DirCheck", "check_dir", "fs_type"]


@dataclass
class DirCheck:
    path: str
    usable: bool                # exists, is a directory, a file can be created in it
    problem: Optional[str]      # why not usable (None when usable)
    direct_io: Optional[bool]   # O_DIRECT accepted (None when not usable)
    direct_error: Optional[str]  # why O_DIRECT was refused
    fstype: str
    free_bytes: Optional[int]


def fs_type(path: str) -> str:
    """The file system type of the mount that holds ``path`` (from mountinfo)."""
    real = os.path.realpath(path)
    best, best_type = "", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, best_type = mount, right.split()[0]
    except OSError:
        pass
    return best_type


def _probe_name(path: str, what: str) -> str:
    return os.path.join(path, f".nvmeio-probe-{what}-{os.getpid()}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_dir(path: str) -> DirCheck:
    """Probes ``path``: creates (and removes) two small files, one with O_DIRECT.

    The O_DIRECT probe is a real aligned write, since some file systems accept
    the open flag but refuse the I/O. A refused open may still have created
    the file (ramfs does), so the probe file is removed either way.
    """
    fstype = fs_type(path) if os.path.exists(path) else "?"
    if not os.path.exists(path):
        return DirCheck(path, False, "does not exist", None, None, fstype, None)
    if not os.path.isdir(path):
        return DirCheck(path, False, "is not a directory", None, None, fstype, None)
    plain = _probe_name(path, "w")
    try:
        fd = os.open(plain, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except OSError as e:
        return DirCheck(path, False, f"is not writable ({e.strerror})", None, None, fstype, None)
    finally:
        _unlink_quietly(plain)
    st = os.statvfs(path)
    # ramfs (and some FUSE file systems) report no size at all: free space unknown.
    free = st.f_bavail * st.f_frsize if st.f_blocks else None
    direct, why = _probe_direct(path)
    return DirCheck(path, True, None, direct, why, fstype, free)


def _probe_direct(path: str) -> tuple[bool, Optional[str]]:
    import mmap

    probe = _probe_name(path, "d")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as e:
        _unlink_quietly(probe)
        if e.errno == errno.EINVAL:
            return False, "the file system refuses O_DIRECT (EINVAL on open)"
        return False, f"O_DIRECT open failed: {e.strerror}"
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
        try:
            os.write(fd, buf)
        except OSError as e:
            return False, f"O_DIRECT write failed: {e.strerror}"
        finally:
            buf.close()
        return True, None
    finally:
        os.close(fd)
        _unlink_quietly(probe)
