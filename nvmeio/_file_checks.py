"""The file checks of ops that do not go through the native core's submission.

Device ops (CUDA tensors, staged or through cuFile) run later on a background
thread; :func:`prepare_target` makes at submission the checks the native core
would make (missing file, directory, FIFO or socket, short file, permissions)
so that they fail at once, as host ops do, and returns what undoes a failed
write. :func:`compare_with_file` is ``validate=True`` for them;
:func:`whole_file_size` is what ``read()`` checks the buffer against.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from typing import Any, Callable

from . import _native
from .atomic_file import create_exclusive
from .errors import ValidationError, make_error

__all__ = ["prepare_target", "compare_with_file", "whole_file_size"]


def whole_file_size(path: str, nbytes: int) -> int:
    """The size ``read()`` checks a buffer of ``nbytes`` against: a regular file's or a
    block device's. A FIFO or socket is refused as any op on it is (AioError, ESPIPE);
    what has no size to check is a ValueError saying so: a character device, and a file
    of /proc, /sys or another pseudo file system (it reports 0 whatever it holds)."""
    st = os.stat(path)
    _native.refuse_without_offsets(st.st_mode, os.fsencode(path), 0, nbytes, "open for reading")
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    if stat.S_ISCHR(st.st_mode):
        raise ValueError(f"read: {path!r} is a character device, which has no size to check the "
                         f"buffer's {nbytes} bytes against; use pread to read {nbytes} bytes from it")
    if stat.S_ISREG(st.st_mode) and _reports_no_size(st, path):
        raise ValueError(f"read: {path!r} reports a size of 0 bytes, as files of /proc, /sys and "
                         "other pseudo file systems do whatever they hold, so there is no size to "
                         f"check the buffer's {nbytes} bytes against; use pread to read {nbytes} "
                         "bytes from it")
    return st.st_size


def compare_with_file(path: str, file_offset: int, nbytes: int, fetch: Callable[[int, int], Any],
                      piece_bytes: int) -> None:
    """Raises ValidationError unless the file range equals the buffer.

    ``fetch(buffer_offset, n)`` returns the buffer's bytes there (anything
    ``bytes()`` accepts); the file is read through the page cache, piece by
    piece, so neither side is ever copied whole.
    """
    with open(path, "rb") as f:
        f.seek(file_offset)
        done = 0
        while done < nbytes:
            n = min(piece_bytes, nbytes - done)
            actual = f.read(n)
            expected = bytes(fetch(done, n))
            if actual != expected:
                at = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b),
                          len(actual))
                exc = ValidationError(errno.EIO, "validation failed: file and buffer differ at "
                                      f"byte {done + at}", path)
                exc.offset, exc.length = file_offset, nbytes
                raise exc
            done += n


def prepare_target(write: bool, target: "str | int", file_offset: int,
                   nbytes: int) -> Callable[[], None]:
    """Checks the file of a device op before it is queued, and returns what
    undoes a failed write: a file this call created (0600, as the native core
    creates files) is removed, an existing file that grew gets its old size back.

    Raises what the native core raises at submission: AioError subclasses
    (FileNotFoundError, IsADirectoryError, ShortReadError, ...) with path,
    offset and length.
    """
    where = f"<fd {target}>" if isinstance(target, int) else target

    def fail(err: int, what: str) -> None:
        raise make_error(err, what, where, file_offset, nbytes)

    if isinstance(target, int):
        try:
            st = os.fstat(target)
        except OSError as e:
            fail(e.errno, f"fstat failed: {e.strerror}")
        _native.refuse_without_offsets(st.st_mode, os.fsencode(where), file_offset, nbytes,
                                       "writing" if write else "reading")
    elif write:
        try:
            fd = create_exclusive(target)
        except FileExistsError:
            try:
                st = os.stat(target)
            except OSError as e:
                fail(e.errno, f"open for writing failed: {e.strerror}")
            _native.refuse_without_offsets(st.st_mode, os.fsencode(where), file_offset, nbytes,
                                           "open for writing")
            if stat.S_ISDIR(st.st_mode):
                fail(errno.EISDIR, "open for writing failed: Is a directory")
            if not os.access(target, os.W_OK):
                fail(errno.EACCES, "open for writing failed: Permission denied")
            if stat.S_ISREG(st.st_mode):
                return functools.partial(_restore_size, target, st.st_size)
            return _nothing
        except OSError as e:
            parent = os.path.dirname(os.path.abspath(target))
            if e.errno == errno.ENOENT and not os.path.isdir(parent):
                fail(e.errno, f"open for writing failed: directory '{parent}' does not exist")
            fail(e.errno, f"open for writing failed: {e.strerror}")
        os.close(fd)
        return functools.partial(_remove, target)
    else:
        try:
            st = os.stat(target)
        except OSError as e:
            fail(e.errno, f"open for reading failed: {e.strerror}")
        _native.refuse_without_offsets(st.st_mode, os.fsencode(where), file_offset, nbytes, "open for reading")
    if stat.S_ISDIR(st.st_mode):
        fail(errno.EISDIR, f"open for {'writing' if write else 'reading'} failed: Is a directory")
    if (not write and stat.S_ISREG(st.st_mode) and nbytes and file_offset + nbytes > st.st_size
            and not _reports_no_size(st, target)):
        fail(errno.ENODATA, f"short read: the file holds {st.st_size} bytes, but reading {nbytes} "
                            f"bytes at offset {file_offset} needs {file_offset + nbytes}")
    return _nothing


def _reports_no_size(st: os.stat_result, target: "str | int") -> bool:
    """A file of /proc, /sys and the like: its reported size is 0 whatever it holds."""
    return st.st_size == 0 and _native.in_pseudo_file_system(
        os.fsencode(f"/proc/self/fd/{target}" if isinstance(target, int) else target))


def _nothing() -> None:
    pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _restore_size(path: str, size: int) -> None:
    try:
        if os.stat(path).st_size > size:
            os.truncate(path, size)
    except OSError:
        pass
