"""Where swap files live: ``<nvme_path>/<job_id>/rank<r>/<name>/``, owned by one process.

[Note: a directory left by a dead job is reported, never reused or deleted]
Swap files are raw tensor bytes without a header; a directory that outlived
its job (killed by the OOM killer, a node failure, ``kill -9``) holds files
that look valid and are not. DeepSpeed named files by Python ``id()`` and
reused directories silently, so stale state piled up across runs. Here each
rank directory carries an owner marker, an empty directory named
``.owner@<host>@<pid>`` (a directory, so that no file is opened for it), made
when the rank directory is created. Opening a rank directory that exists
already is allowed only from the process that owns it (a parameter swapper
and an optimizer swapper of one rank share it, each under its own ``name``).
A live owner, an owner on another host (a shared mount: its processes
cannot be checked from here) or no marker at all gives
:class:`SwapDirectoryInUseError`, and the directory is never deleted: only an
owner proven dead (a process of this host that is gone) gives
:class:`StaleSwapDirectoryError` naming the owner and what the directory
holds, and ``remove_stale=True`` deletes such a directory, with a warning, and
starts afresh. Files are created empty with mode 0600 (and directories 0700)
before nvmeio first writes them, so no other user can read training state
whatever the umask. :meth:`SwapDirectory.cleanup` (also run at garbage
collection and at a clean interpreter exit) removes the files, then the rank
and job directories once nothing else of this job is left in them.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import warnings
import weakref
from typing import Callable, Dict, Optional, Set, Tuple

from nvmeio.atomic_file import create_exclusive

from ._errors import (
    InsufficientSwapSpaceError,
    StaleSwapDirectoryError,
    SwapDirectoryInUseError,
    SwapStateError,
)
from .host_memory import format_bytes

FreeSpaceFn = Callable[[str], int]

_OWNER_PREFIX = ".owner@"
_LOCK = threading.Lock()
_CLAIMS: Dict[str, Set[str]] = {}  # rank directory -> names claimed in this process


def disk_free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _check_component(value: str, what: str) -> str:
    value = str(value)
    if not value or value in (".", "..") or "/" in value or "\0" in value or (os.altsep and os.altsep in value):
        raise ValueError(f"{what} must be a plain directory name, got {value!r}")
    return value


def _check_private_dir(path: str) -> None:
    """``path`` must be a real directory of this user: a symlink or another user's directory planted
    at the job's name in a shared nvme_path would let its owner read or swap our files."""
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        raise FileExistsError(f"swap directory {path} is not a directory (a symbolic link?); refusing to use it")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"swap directory {path} belongs to uid {st.st_uid}, not this user "
                              f"(uid {os.geteuid()}); use another job_id or nvme_path")


def _owner_marker() -> str:
    return f"{_OWNER_PREFIX}{socket.gethostname()}@{os.getpid()}"


def _parse_owner(entry: str) -> Optional[Tuple[str, int]]:
    if not entry.startswith(_OWNER_PREFIX):
        return None
    host, _, pid = entry[len(_OWNER_PREFIX) :].rpartition("@")
    return (host, int(pid)) if pid.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _contents(path: str) -> Tuple[int, int]:
    files = size = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            files += 1
            try:
                size += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return files, size


def _release_claim(rank_dir: str, job_dir: str, name: str, path: str) -> None:
    """Remove one swapper's directory; the rank and job directories go with the last one."""
    shutil.rmtree(path, ignore_errors=True)
    with _LOCK:
        names = _CLAIMS.get(rank_dir)
        if names is None:
            return
        names.discard(name)
        if names:
            return
        del _CLAIMS[rank_dir]
        for d in (os.path.join(rank_dir, _owner_marker()), rank_dir, job_dir):
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: other ranks or other jobs still use it


class SwapDirectory:
    """The directory of one swapper: ``<nvme_path>/<job_id>/rank<rank>/<name>/``.

    ``free_space_fn(nvme_path) -> bytes`` replaces ``statvfs`` for the free-space
    check (tests, quotas the file system does not report).
    """

    def __init__(
        self,
        nvme_path,
        job_id: str = "default",
        rank: int = 0,
        name: str = "swap",
        *,
        free_space_fn: Optional[FreeSpaceFn] = None,
        remove_stale: bool = False,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self.nvme_path = os.path.abspath(os.fspath(nvme_path))
        if not os.path.isdir(self.nvme_path):
            raise FileNotFoundError(f"nvme_path {self.nvme_path} is not an existing directory")
        self.job_id = _check_component(job_id, "job_id")
        self.rank = rank
        self.name = _check_component(name, "name")
        self.job_dir = os.path.join(self.nvme_path, self.job_id)
        self.rank_dir = os.path.join(self.job_dir, f"rank{rank}")
        self.path = os.path.join(self.rank_dir, self.name)
        self._free_space_fn = free_space_fn or disk_free_bytes
        self._created: Set[str] = set()
        os.makedirs(self.job_dir, mode=0o700, exist_ok=True)
        _check_private_dir(self.job_dir)
        with _LOCK:
            self._claim(remove_stale)
        self._finalizer = weakref.finalize(self, _release_claim, self.rank_dir, self.job_dir, self.name, self.path)

    def __repr__(self) -> str:
        return f"SwapDirectory({self.path!r})"

    # -- ownership ---------------------------------------------------------------------------
    def _claim(self, remove_stale: bool) -> None:
        names = _CLAIMS.get(self.rank_dir)
        if names is None:
            try:
                os.mkdir(self.rank_dir, 0o700)
            except FileExistsError:
                self._handle_existing(self.rank_dir, remove_stale)
                os.mkdir(self.rank_dir, 0o700)
            os.mkdir(os.path.join(self.rank_dir, _owner_marker()), 0o700)
            names = _CLAIMS[self.rank_dir] = set()
        elif self.name in names:
            raise SwapDirectoryInUseError(
                f"swap directory {self.path} is already used by another swapper in this process; "
                f"give each swapper of a rank its own name"
            )
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            self._handle_existing(self.path, remove_stale)
            os.mkdir(self.path, 0o700)
        names.add(self.name)

    def _handle_existing(self, path: str, remove_stale: bool) -> None:
        owners = [o for o in map(_parse_owner, os.listdir(self.rank_dir)) if o is not None]
        host = socket.gethostname()
        for owner_host, pid in owners:
            if owner_host == host and pid != os.getpid() and _pid_alive(pid):
                raise SwapDirectoryInUseError(
                    f"swap directory {path} is in use by process {pid} on this host (job_id="
                    f"{self.job_id!r}, rank {self.rank}); use another job_id or nvme_path"
                )
        files, size = _contents(path)
        # Deleted only when its owner is proven dead: a process of this host that is gone (or
        # this very process, whose swappers no longer claim it).
        proven_dead = bool(owners) and all(h == host for h, _ in owners)
        if any(o == (host, os.getpid()) for o in owners):
            who = "this process (an earlier swapper that was not cleaned up, or a reused pid)"
        elif owners:
            owner_host, pid = next(((h, p) for h, p in owners if h != host), owners[0])
            who = (
                f"process {pid} on host {owner_host}, which is no longer running"
                if owner_host == host
                else f"process {pid} on host {owner_host}, which cannot be checked from {host}"
            )
        else:
            who = "an unknown owner (no owner marker)"
        holds = f"it holds {files} files ({format_bytes(size)})"
        if not proven_dead:
            raise SwapDirectoryInUseError(
                f"swap directory {path} already exists, left by {who}; {holds}. That job may still be "
                f"running (a shared nvme_path), so it is never deleted automatically: if no job uses "
                f"it, remove it (rm -r {path}); to run jobs side by side on one nvme_path, give each "
                f"its own job_id (now {self.job_id!r})"
            )
        message = (
            f"swap directory {path} already exists, left by {who}; {holds}. It is neither reused nor "
            f"deleted automatically: remove it (rm -r {path}) or pass remove_stale=True"
        )
        if not remove_stale:
            raise StaleSwapDirectoryError(message)
        warnings.warn(f"removing stale {message.split('. It is')[0]}", stacklevel=4)
        shutil.rmtree(path)

    # -- files -------------------------------------------------------------------------------
    def file(self, file_name: str) -> str:
        """Absolute path of ``file_name`` inside this directory."""
        self._check_open()
        return os.path.join(self.path, _check_component(file_name, "swap file name"))

    def create(self, file_name: str) -> str:
        """Create ``file_name`` empty with mode 0600 unless it exists; return its path."""
        path = self.file(file_name)
        if file_name in self._created:
            return path
        try:
            os.close(create_exclusive(path))
        except FileExistsError:
            if os.path.islink(path):
                raise FileExistsError(f"swap file {path} is a symbolic link; refusing to write through it")
            os.chmod(path, 0o600)
        self._created.add(file_name)
        return path

    def track(self, file_name: str) -> str:
        """Count ``file_name``, made by other means (a hard link, a rename), as this swapper's:
        removed at cleanup. Its mode is left as it is (a link shares it with another name)."""
        path = self.file(file_name)
        self._created.add(file_name)
        return path

    def untrack(self, file_name: str) -> None:
        """Stop counting ``file_name`` (renamed away: nothing is left to remove)."""
        self._created.discard(file_name)

    def size(self, file_name: str) -> int:
        """Current size of ``file_name`` in bytes; 0 if it does not exist."""
        try:
            return os.stat(self.file(file_name)).st_size
        except FileNotFoundError:
            return 0

    def remove(self, file_name: str) -> None:
        self._created.discard(file_name)
        try:
            os.unlink(self.file(file_name))
        except FileNotFoundError:
            pass

    def free_bytes(self) -> int:
        return int(self._free_space_fn(self.nvme_path))

    def check_free_space(self, needed_bytes: int, what: str) -> None:
        """Raise :class:`InsufficientSwapSpaceError` if fewer than ``needed_bytes`` are free."""
        if needed_bytes <= 0:
            return
        free = self.free_bytes()
        if needed_bytes > free:
            raise InsufficientSwapSpaceError(
                f"{what} need {needed_bytes} more bytes ({format_bytes(needed_bytes)}) under "
                f"{self.nvme_path}, but only {free} bytes ({format_bytes(free)}) are free"
            )

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise SwapStateError(f"swap directory {self.path} was cleaned up")

    def cleanup(self) -> None:
        """Remove every file of this swapper, then the rank and job directories if empty."""
        self._created.clear()
        self._finalizer()
