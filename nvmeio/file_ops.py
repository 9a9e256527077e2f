"""Small file-system steps shared by the fast files: exclusive temporary files,
preallocation, durable renames, in-kernel copies.

[Note: atomic replacement of a file]
A file is written as a temporary file in the target's own directory
(nvmeio.atomic_file: nameless where the file system allows O_TMPFILE, else a
random name created O_EXCL|O_NOFOLLOW; either way nothing planted there is
opened or followed; mode 0600). Only once every byte is written and fsynced
is it put in place of the target, and the directory fsynced, so that a crash
at any moment leaves either the old file or the complete new one under the
target's name, and no temporary behind. A device node is written in place
instead, and a FIFO or socket refused (see [Note: device nodes are written in
place] there).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Tuple

from .atomic_file import TempFile, open_for_replacing

__all__ = ["temp_beside", "open_direct", "preallocate", "populate", "copy_range", "seek_position"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_populate_works = True


def seek_position(position: int, size: int, offset: int, whence: int) -> int:
    """Where ``seek(offset, whence)`` puts a reader at ``position`` in ``size`` bytes (as a file's)."""
    base = {os.SEEK_SET: 0, os.SEEK_CUR: position, os.SEEK_END: size}.get(whence)
    if base is None:
        raise ValueError(f"invalid whence {whence!r}")
    if base + offset < 0:
        raise ValueError(f"negative seek position {base + offset}")
    return base + offset


def open_direct(path: str, flags: int, mode: int = 0o600) -> Tuple[int, bool]:
    """Opens with O_DIRECT when the file system allows it; returns (fd, direct)."""
    flags |= os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT, mode), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(path, flags, mode), False


def temp_beside(path: str, direct: bool = True) -> Tuple[TempFile, int, bool]:
    """An exclusive temporary file for replacing ``path`` (nvmeio.atomic_file: anonymous where
    the file system allows, never through a planted symlink, 0600), and a descriptor to write
    it through, O_DIRECT when ``direct`` and allowed; returns (TempFile, fd, direct).
    ``TempFile.publish()`` puts it in place; ``TempFile.close()`` alone discards it. For a
    device node, the device itself (atomic_file.DeviceFile: written in place)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"directory {directory!r} does not exist", path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", path)
    tmp = open_for_replacing(path, readable=False)
    if not direct:
        return tmp, os.dup(tmp.fd), False
    try:
        # The same (possibly nameless) file again, through its /proc/self/fd magic link, direct.
        fd, direct = open_direct(tmp.io_path, os.O_WRONLY)
    except BaseException:
        tmp.close()
        raise
    return tmp, fd, direct


def preallocate(fd: int, offset: int, length: int, name: str) -> None:
    """Allocates ``[offset, offset + length)`` of the file before it is written.

    Direct writes that extend a file run one at a time on ext4/XFS; into
    allocated blocks they run in parallel. A full disk is an error here,
    before any byte of the range is written. File systems without fallocate
    are written as they are.
    """
    if length <= 0:
        return
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        # ENODEV: a character device, which has no blocks to allocate.
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
            return
        raise OSError(err, f"cannot allocate {length} bytes at offset {offset}: "
                           f"{os.strerror(err)}", name)


def populate(ptr: int, length: int) -> None:
    """Faults in the whole pages of ``[ptr, ptr + length)`` for writing, in one
    syscall (cheaper than a fault per page); a no-op where the kernel lacks it."""
    global _populate_works
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + length) // _PAGE * _PAGE
    if _populate_works and end > start and _libc.madvise(start, end - start, _MADV_POPULATE_WRITE):
        _populate_works = ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS)


def copy_range(src_fd: int, dst_fd: int, length: int, src_offset: int = 0,
               dst_offset: int = 0) -> None:
    """Copies ``length`` bytes between two files inside the kernel.

    ``os.copy_file_range`` shares the blocks (a reflink) on file systems that
    can (XFS, Btrfs), copies them in the kernel elsewhere; where the call is
    missing or refused between these files (EXDEV on old kernels, ENOSYS,
    EOPNOTSUPP) the bytes go through ``os.pread``/``os.pwrite`` in 8 MiB
    pieces instead. A source shorter than the range is an error.
    """
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < length:
        n = 0
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, length - done, src_offset + done,
                                       dst_offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                use_kernel = False
                continue
        else:
            chunk = os.pread(src_fd, min(8 << 20, length - done), src_offset + done)
            n = len(chunk)
            view = memoryview(chunk)
            while view:
                w = os.pwrite(dst_fd, view, dst_offset + done + len(chunk) - len(view))
                view = view[w:]
        if n == 0:
            raise OSError(errno.EIO, f"copy ended early: the source holds only {src_offset + done} "
                                     f"bytes, {length - done} more were expected")
        done += n
