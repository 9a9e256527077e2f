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
from typing import Callable, Dict, Optional, Set, Tuple, Union

from nvmeio import StripedFile
from nvmeio.atomic_file import create_exclusive
from nvmeio.striping import stripe_unit as _stripe_unit

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
DEFAULT_STRIPE_UNIT = _stripe_unit(1 << 20)  # of the default block size (nvmeio.AioSettings)


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


def nvme_paths(nvme_path) -> Tuple[str, ...]:
    """``nvme_path`` (one directory, or a list of them: one per drive) as absolute paths;
    refuses an empty list and a directory named twice."""
    if isinstance(nvme_path, (list, tuple)):
        given = list(nvme_path)
        if not given:
            raise ValueError("nvme_path is an empty list; give one directory per drive")
    else:
        given = [nvme_path]
    paths = tuple(os.path.abspath(os.fspath(p)) for p in given)
    for i, p in enumerate(paths):
        for q in paths[:i]:
            if p == q or (os.path.isdir(p) and os.path.isdir(q) and os.path.samefile(p, q)):
                raise ValueError(f"nvme_path names the directory {p} twice ({q}); give each drive once")
    return paths


def _release_claims(claims) -> None:
    for claim in claims:
        _release_claim(*claim)


class SwapDirectory:
    """The directory of one swapper: ``<nvme_path>/<job_id>/rank<rank>/<name>/``.

    ``nvme_path`` may be a list of directories, one per drive: the swapper then has one such
    directory on each, every swap file is striped over them in units of ``stripe_unit`` bytes
    (:class:`nvmeio.StripedFile`, nvmeio/striping.py [Note: striping]), and :meth:`file` names
    a striped file instead of a path. Ownership, stale directories and the free-space check
    hold per drive, and an error names the drive. ``free_space_fn(directory) -> bytes``
    replaces ``statvfs`` for the free-space check (tests, quotas the file system does not
    report).
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
        stripe_unit: int = DEFAULT_STRIPE_UNIT,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self.nvme_paths = nvme_paths(nvme_path)
        self.nvme_path = self.nvme_paths[0]
        for i, path in enumerate(self.nvme_paths):
            if not os.path.isdir(path):
                drive = f" (drive {i + 1} of {len(self.nvme_paths)})" if len(self.nvme_paths) > 1 else ""
                raise FileNotFoundError(f"nvme_path {path}{drive} is not an existing directory")
        self.job_id = _check_component(job_id, "job_id")
        self.rank = rank
        self.name = _check_component(name, "name")
        self.stripe_unit = StripedFile(("unit check",), stripe_unit).unit
        self.job_dirs = tuple(os.path.join(p, self.job_id) for p in self.nvme_paths)
        self.rank_dirs = tuple(os.path.join(d, f"rank{rank}") for d in self.job_dirs)
        self.paths = tuple(os.path.join(d, self.name) for d in self.rank_dirs)
        self.job_dir, self.rank_dir, self.path = self.job_dirs[0], self.rank_dirs[0], self.paths[0]
        self._free_space_fn = free_space_fn or disk_free_bytes
        self._created: Set[str] = set()
        claimed = []
        try:
            for job_dir, rank_dir, path in zip(self.job_dirs, self.rank_dirs, self.paths):
                os.makedirs(job_dir, mode=0o700, exist_ok=True)
                _check_private_dir(job_dir)
                with _LOCK:
                    self._claim(rank_dir, path, remove_stale)
                claimed.append((rank_dir, job_dir, self.name, path))
        except BaseException:
            for claim in claimed:
                _release_claim(*claim)
            raise
        self._finalizer = weakref.finalize(self, _release_claims, claimed)

    def __repr__(self) -> str:
        if len(self.paths) > 1:
            return f"SwapDirectory({list(self.paths)!r})"
        return f"SwapDirectory({self.path!r})"

    @property
    def striped(self) -> bool:
        """Whether the swap files are striped over several drives."""
        return len(self.paths) > 1

    # -- ownership ---------------------------------------------------------------------------
    def _claim(self, rank_dir: str, path: str, remove_stale: bool) -> None:
        names = _CLAIMS.get(rank_dir)
        if names is None:
            try:
                os.mkdir(rank_dir, 0o700)
            except FileExistsError:
                self._handle_existing(rank_dir, rank_dir, remove_stale)
                os.mkdir(rank_dir, 0o700)
            os.mkdir(os.path.join(rank_dir, _owner_marker()), 0o700)
            names = _CLAIMS[rank_dir] = set()
        elif self.name in names:
            raise SwapDirectoryInUseError(
                f"swap directory {path} is already used by another swapper in this process; "
                f"give each swapper of a rank its own name"
            )
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            self._handle_existing(rank_dir, path, remove_stale)
            os.mkdir(path, 0o700)
        names.add(self.name)

    def _handle_existing(self, rank_dir: str, path: str, remove_stale: bool) -> None:
        owners = [o for o in map(_parse_owner, os.listdir(rank_dir)) if o is not None]
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
    def file(self, file_name: str) -> Union[str, StripedFile]:
        """Absolute path of ``file_name`` inside this directory; with several drives, the
        striped file of its parts (one in each drive's directory)."""
        self._check_open()
        file_name = _check_component(file_name, "swap file name")
        if not self.striped:
            return os.path.join(self.path, file_name)
        return StripedFile(tuple(os.path.join(p, file_name) for p in self.paths), self.stripe_unit)

    def _parts(self, file_name: str) -> Tuple[str, ...]:
        f = self.file(file_name)
        return f.parts if isinstance(f, StripedFile) else (f,)

    def create(self, file_name: str) -> Union[str, StripedFile]:
        """Create ``file_name`` (each of its parts) empty with mode 0600 unless it exists;
        return its path (:meth:`file`)."""
        f = self.file(file_name)
        if file_name in self._created:
            return f
        for path in self._parts(file_name):
            try:
                os.close(create_exclusive(path))
            except FileExistsError:
                if os.path.islink(path):
                    raise FileExistsError(f"swap file {path} is a symbolic link; refusing to write through it")
                os.chmod(path, 0o600)
        self._created.add(file_name)
        return f

    def track(self, file_name: str) -> Union[str, StripedFile]:
        """Count ``file_name``, made by other means (a hard link, a rename), as this swapper's:
        removed at cleanup. Its mode is left as it is (a link shares it with another name)."""
        f = self.file(file_name)
        self._created.add(file_name)
        return f

    def untrack(self, file_name: str) -> None:
        """Stop counting ``file_name`` (renamed away: nothing is left to remove)."""
        self._created.discard(file_name)

    def size(self, file_name: str) -> int:
        """Current size of ``file_name`` in bytes (striped: its logical size); 0 if it does not exist."""
        f = self.file(file_name)
        if isinstance(f, StripedFile):
            return f.size()
        try:
            return os.stat(f).st_size
        except FileNotFoundError:
            return 0

    def remove(self, file_name: str) -> None:
        self._created.discard(file_name)
        for path in self._parts(file_name):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def free_bytes(self) -> int:
        """Free bytes under the (first) drive."""
        return int(self._free_space_fn(self.nvme_path))

    def check_free_space(self, needed_bytes: int, what: str) -> None:
        """Raise :class:`InsufficientSwapSpaceError` if fewer than ``needed_bytes`` are free;
        striped, each drive must hold its share (rounded up by one stripe unit), and the error
        names the drive that cannot."""
        if needed_bytes <= 0:
            return
        n = len(self.nvme_paths)
        share = needed_bytes if n == 1 else min(needed_bytes, -(-needed_bytes // n) + self.stripe_unit)
        for i, drive in enumerate(self.nvme_paths):
            free = int(self._free_space_fn(drive))
            if share > free:
                where = f"{drive}" if n == 1 else (f"{drive} (drive {i + 1} of {n}: its share of the "
                                                   f"{needed_bytes} bytes striped over {n} drives)")
                raise InsufficientSwapSpaceError(
                    f"{what} need {share} more bytes ({format_bytes(share)}) under "
                    f"{where}, but only {free} bytes ({format_bytes(free)}) are free"
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
