"""Replace a file atomically through a temporary file nobody else can touch.

    from nvmeio.atomic_file import write_atomically, replacing

    write_atomically(os.path.join(save_dir, "latest"), tag.encode())   # small files

    with replacing(path) as tmp:          # anything that writes through a descriptor or path
        os.write(tmp.fd, data)            # or: handle.pwrite(buf, tmp.io_path)
    # here `path` holds the new bytes (and is durable); on an exception it is untouched

[Note: why the temporary file is anonymous]
A predictable temporary name in a shared directory is an invitation: a
symlink planted there makes a plain ``open(tmp, "w")`` overwrite the link's
target. So the temporary file is created with ``O_TMPFILE`` where the file
system allows it (ext4, XFS, btrfs, tmpfs): it has no name at all until
``publish()`` links it into place, so nothing can be planted at it, and a
process killed at any point (SIGTERM, SIGKILL, a crash) leaves nothing
behind. Elsewhere it gets a random name, created ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (an existing file or symlink there is refused, never followed)
and removed on failure (a process killed before that leaves it behind: only
the nameless form is proof against SIGKILL). Either way the new file is 0600
and the final step is a ``rename`` over the target, atomic on POSIX file
systems.

``io_path`` names the open temporary file for APIs that take a path
(``/proc/self/fd/N``: a magic link to this very file, which nothing can
redirect).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from typing import Iterator, Optional

__all__ = ["TempFile", "create_temp_beside", "replacing", "write_atomically", "fsync_directory",
           "exchange"]

_HAVE_PROC_FD = os.path.isdir("/proc/self/fd")
# File systems without O_TMPFILE answer with one of these.
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT)


class TempFile:
    """A new, open file in the directory of ``target``, to be published over it."""

    def __init__(self, fd: int, target: str, name: Optional[str]) -> None:
        self.fd = fd
        self.target = target
        self.name = name      # the random name, or None while anonymous (O_TMPFILE)
        self.published = False

    @property
    def io_path(self) -> str:
        """A path that opens this very file (for APIs that take a path)."""
        if _HAVE_PROC_FD:
            return f"/proc/self/fd/{self.fd}"
        assert self.name is not None  # no /proc: only named temporaries are made
        return self.name

    def publish(self, durable: bool = True) -> None:
        """Puts the file in place of ``target`` (atomically replacing what was
        there); ``durable``: data, then the directory entry, reach the disk first."""
        if self.published:
            raise ValueError(f"{self.target!r}: this temporary file was already published")
        if durable:
            os.fsync(self.fd)
        if self.name is None:
            self._link_anonymous()
        else:
            os.replace(self.name, self.target)
            self.name = None
        self.published = True
        if durable:
            fsync_directory(os.path.dirname(self.target) or ".")

    def _link(self, name: str) -> None:
        # linkat(AT_SYMLINK_FOLLOW) of the /proc/self/fd magic link gives the
        # nameless file a name (open(2), O_TMPFILE). Python calls plain link(2)
        # unless a directory fd is passed, hence the fd of /proc/self/fd.
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(str(self.fd), name, src_dir_fd=proc, follow_symlinks=True)
        finally:
            os.close(proc)

    def _link_anonymous(self) -> None:
        try:
            # A new target gets its name in one step: nothing can be left behind.
            self._link(self.target)
            return
        except FileExistsError:
            pass
        # An existing target: a fresh random name (link never follows or
        # replaces what is there), then the atomic rename over the target.
        while True:
            name = _random_name(self.target)
            try:
                self._link(name)
                break
            except FileExistsError:
                continue
        try:
            os.replace(name, self.target)
        except BaseException:
            _unlink_quietly(name)
            raise

    def close(self) -> None:
        """Closes the descriptor; an unpublished named temporary is removed."""
        if self.name is not None and not self.published:
            _unlink_quietly(self.name)
            self.name = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "TempFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _random_name(target: str) -> str:
    head, tail = os.path.split(target)
    return os.path.join(head, f".{tail}.{secrets.token_hex(8)}.tmp")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create_temp_beside(target: "str | os.PathLike[str]", mode: int = 0o600,
                       readable: bool = True) -> TempFile:
    """Creates a new empty file in ``target``'s directory, exclusively and
    without following any symlink (see [Note: why the temporary file is anonymous]).

    ``readable``: opened read-write (else write-only). Raises the OSError of
    the directory (FileNotFoundError, PermissionError, ...) naming it.
    """
    target = os.fspath(target)
    if "\0" in target:
        raise ValueError(f"path contains a NUL byte: {target!r}")
    directory = os.path.dirname(target) or "."
    access = os.O_RDWR if readable else os.O_WRONLY
    if _HAVE_PROC_FD and hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(directory, os.O_TMPFILE | access | os.O_CLOEXEC, mode)
            return TempFile(fd, target, None)
        except OSError as e:
            if e.errno not in _NO_TMPFILE or not os.path.isdir(directory):
                raise
    flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | access | os.O_CLOEXEC
    while True:
        name = _random_name(target)
        try:
            return TempFile(os.open(name, flags, mode), target, name)
        except FileExistsError:
            continue


@contextlib.contextmanager
def replacing(target: "str | os.PathLike[str]", mode: int = 0o600,
              durable: bool = True) -> Iterator[TempFile]:
    """Yields a TempFile; when the block ends normally it replaces ``target``,
    when it raises, ``target`` is left as it was and no temporary file remains."""
    tmp = create_temp_beside(target, mode)
    try:
        yield tmp
        if not tmp.published:
            tmp.publish(durable)
    finally:
        tmp.close()


def write_atomically(target: "str | os.PathLike[str]", data: bytes, mode: int = 0o600,
                     durable: bool = True) -> None:
    """Replaces ``target`` with ``data``: readers see the old file or the new, never a part."""
    with replacing(target, mode, durable) as tmp:
        view = memoryview(data)
        while view:
            view = view[os.write(tmp.fd, view):]


def fsync_directory(directory: "str | os.PathLike[str]") -> None:
    """Makes the directory's entries (a rename, a new name) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: "str | os.PathLike[str]", b: "str | os.PathLike[str]") -> bool:
    """Swaps the names ``a`` and ``b`` (files or directories) in one atomic step:
    ``renameat2(RENAME_EXCHANGE)``, Linux 3.15+. At every instant both names
    exist. Returns False, changing nothing, where the kernel, the C library or
    the file system cannot do it (NFS, old kernels)."""
    import ctypes

    a, b = os.fsencode(a), os.fsencode(b)
    if b"\0" in a or b"\0" in b:
        raise ValueError(f"path contains a NUL byte: {a!r} / {b!r}")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fsdecode(a), None, os.fsdecode(b))
