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

[Note: device nodes are written in place]
A rename over a block or character device node would put a regular file
where the device was (``h.write(t, "/dev/loop0")`` left /dev/loop0 a regular
file). A device node is therefore written through, in place, as DeepSpeed
does (open and write: no temporary file, no rename, no truncation), and so
without the atomicity: a failed write leaves the device partly written. A
FIFO or socket has no offsets to write at and is no file to replace:
refused. A symlink is never written through (a link planted at a
checkpoint's ``latest`` must not aim a write at a disk): one to a device,
FIFO or socket is refused, naming what to write instead; any other is
replaced, as a regular file is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import Iterator, Optional

from . import _native
from .errors import make_error

__all__ = ["TempFile", "DeviceFile", "create_temp_beside", "create_exclusive", "open_for_replacing",
           "is_device_node", "replacing", "write_atomically", "fsync_file", "fsync_directory",
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


class DeviceFile(TempFile):
    """A block or character device node opened for writing in place (see [Note: device
    nodes are written in place]): ``publish()`` only syncs it."""

    @classmethod
    def open(cls, target: str, readable: bool = True) -> "DeviceFile":
        # O_NONBLOCK: a FIFO put at the name since it was looked at must not block the open.
        fd = os.open(target, (os.O_RDWR if readable else os.O_WRONLY) | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISBLK(mode) or stat.S_ISCHR(mode)):
            os.close(fd)
            raise make_error(errno.EAGAIN, "open for writing failed: it was replaced by "
                             f"{_native.file_kind(mode)} while being opened", target, 0, 0)
        os.set_blocking(fd, True)
        return cls(fd, target, None)

    @property
    def io_path(self) -> str:
        return f"/proc/self/fd/{self.fd}" if _HAVE_PROC_FD else self.target

    def publish(self, durable: bool = True) -> None:
        if self.published:
            raise ValueError(f"{self.target!r}: this device was already published")
        if durable:
            fsync_file(self.fd)
        self.published = True


def is_device_node(target: "str | os.PathLike[str]", length: int = 0) -> bool:
    """True when ``target`` is a block or character device node, which a whole-file write
    writes in place; False for a regular file, a missing one or a symlink to either, which
    it replaces. A FIFO, a socket, or a symlink to one or to a device is refused
    (AioError naming the file type; ``length`` is the write's). See [Note: device nodes
    are written in place]."""
    target = _checked_path(target)
    try:
        st = os.lstat(target)
    except OSError:
        return False  # missing, or unreachable: creating the temporary file says why
    if stat.S_ISLNK(st.st_mode):
        try:
            mode = os.stat(target).st_mode
        except OSError:
            return False
        device = stat.S_ISBLK(mode) or stat.S_ISCHR(mode)
        if device or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            real = os.path.realpath(target)
            raise make_error(errno.ELOOP, f"open for writing refused: it is a symbolic link to "
                             f"{_native.file_kind(mode)} ({real!r}); a write neither goes "
                             "through a symlink nor replaces one to a device, FIFO or socket"
                             + (f": name {real!r} itself" if device else ""), target, 0, length)
        return False
    _native.refuse_without_offsets(st.st_mode, os.fsencode(target), 0, length, "open for writing")
    return stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode)


def _checked_path(target: "str | bytes | os.PathLike") -> str:
    # A bytes path becomes the str os.fsdecode gives (a name that is not UTF-8 keeps its
    # bytes as surrogate escapes), so that names built from it are all of one type.
    target = os.fsdecode(target)
    if "\0" in target:
        raise ValueError(f"path contains a NUL byte: {target!r}")
    return target


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
    target = _checked_path(target)
    directory = os.path.dirname(target) or "."
    access = os.O_RDWR if readable else os.O_WRONLY
    if _HAVE_PROC_FD and hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(directory, os.O_TMPFILE | access | os.O_CLOEXEC, mode)
            return TempFile(fd, target, None)
        except OSError as e:
            if e.errno not in _NO_TMPFILE or not os.path.isdir(directory):
                raise
    while True:
        name = _random_name(target)
        try:
            return TempFile(create_exclusive(name, mode, access), target, name)
        except FileExistsError:
            continue


def create_exclusive(path: "str | os.PathLike[str]", mode: int = 0o600, access: int = os.O_WRONLY) -> int:
    """A new file at ``path``, created exclusively (an existing file or a symlink there is
    refused with FileExistsError, never followed), permissions exactly ``mode`` whatever the
    umask; returns its descriptor. The one way nvmeio, the swappers and zero create a file."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | access | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_replacing(target: "str | os.PathLike[str]", mode: int = 0o600,
                       readable: bool = True) -> TempFile:
    """What a whole-file write of ``target`` goes into: a new temporary file to publish
    over it (:func:`create_temp_beside`) or, for a device node, the device itself
    (:class:`DeviceFile`, written in place). A FIFO, a socket or a symlink to one or to a
    device is refused (see :func:`is_device_node`)."""
    if is_device_node(target):
        return DeviceFile.open(os.fspath(target), readable)
    return create_temp_beside(target, mode, readable)


@contextlib.contextmanager
def replacing(target: "str | os.PathLike[str]", mode: int = 0o600,
              durable: bool = True) -> Iterator[TempFile]:
    """Yields a TempFile; when the block ends normally it replaces ``target``,
    when it raises, ``target`` is left as it was and no temporary file remains.
    A device node is written in place instead (see [Note: device nodes are
    written in place]); a FIFO or socket is refused."""
    tmp = open_for_replacing(target, mode)
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


def fsync_file(fd: int) -> None:
    """``os.fsync``, except where the file cannot be synced at all (EINVAL: a character
    device, a /proc or /sys file): its bytes went through when ``write`` returned."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def fsync_directory(directory: "str | os.PathLike[str]") -> None:
    """Makes the directory's entries (a rename, a new name) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # <linux/fs.h>
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
