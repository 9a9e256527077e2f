"""The file checks of ops that do not go through the native core's submission.

Device ops (CUDA tensors, staged or through cuFile) run later on a background
thread; :func:`prepare_target` makes at submission the checks the native core
would make (missing file, directory, short file, permissions) so that they
fail at once, as host ops do, and returns what undoes a failed write.
:func:`compare_with_file` is ``validate=True`` for them.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from typing import Any, Callable

from .errors import ValidationError, make_error

__all__ = ["prepare_target", "compare_with_file"]


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
    elif write:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            try:
                st = os.stat(target)
            except OSError as e:
                fail(e.errno, f"open for writing failed: {e.strerror}")
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
    if stat.S_ISDIR(st.st_mode):
        fail(errno.EISDIR, f"open for {'writing' if write else 'reading'} failed: Is a directory")
    if not write and stat.S_ISREG(st.st_mode) and nbytes and file_offset + nbytes > st.st_size:
        fail(errno.ENODATA, f"short read: the file holds {st.st_size} bytes, but reading {nbytes} "
                            f"bytes at offset {file_offset} needs {file_offset + nbytes}")
    return _nothing


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
