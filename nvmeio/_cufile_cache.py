"""The open cuFile handles of a gds_handle: one per file, kept across ops.

[Note: cuFile handles kept open]
Opening a kvikio ``CuFile`` opens the file twice (with and without O_DIRECT)
and, with GDS, registers it with cuFile (``cuFileHandleRegister``): too slow
to do for every op of a swapper that reads the same files again and again.
So a gds_handle keeps up to ``limit`` of them open, the least recently used
closed first, keyed on the identity of the file they opened (``st_dev``,
``st_ino`` of the open descriptor). An op looks its file up by what ``stat``
(or ``fstat`` of an fd target) says now, so a file deleted and recreated
under the same name, or replaced by a rename, is a new inode and gets a
handle of its own: the old handle keeps its inode allocated, so that inode
number cannot be handed to another file meanwhile. A kept handle whose file
has lost its last name (``st_nlink == 0``) is closed at the next open, so a
deleted file's space is not held for long; a handle whose op failed is
closed at once; all are closed with the gds_handle. A read can use a handle
opened for writing (``"r+"``); a write needs one, and reopens a read-only one.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Callable

__all__ = ["CuFileCache", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 64  # open files kept (each holds two descriptors and a cuFile registration); NVMEIO_CUFILE_HANDLES


class CuFileCache:
    """``open_file(path, flags)`` makes a handle (kvikio's ``CuFile``: ``fileno()``,
    ``close()``); :meth:`get` returns the one for a path or an open fd."""

    def __init__(self, open_file: Callable[[str, str], Any], limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._open = open_file
        self._limit = limit
        self._lock = threading.Lock()
        self._files: collections.OrderedDict = collections.OrderedDict()  # (dev, ino) -> (flags, handle)

    def __len__(self) -> int:
        return len(self._files)

    def get(self, target: "str | int", write: bool) -> Any:
        """The handle for ``target`` (a path, or an open fd), opened for writing
        when ``write``. Raises OSError when the file cannot be opened."""
        st = os.fstat(target) if isinstance(target, int) else os.stat(target)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._files.get(key)
            if entry is not None and (entry[0] == "r+" or not write):
                self._files.move_to_end(key)
                return entry[1]
            if entry is not None:
                self._close(key)  # read-only; a write reopens it
            self._close_unlinked()
            path = f"/proc/self/fd/{target}" if isinstance(target, int) else target
            flags = "r+" if write else "r"
            handle = self._open(path, flags)
            try:
                opened = os.fstat(handle.fileno())
            except BaseException:
                handle.close()
                raise
            # Keyed on what was opened: the name may have moved on since the stat above.
            key = (opened.st_dev, opened.st_ino)
            if key in self._files:
                self._close(key)
            self._files[key] = (flags, handle)
            while len(self._files) > self._limit:
                self._close(next(iter(self._files)))
            return handle

    def discard(self, handle: Any) -> None:
        """Closes ``handle`` (after its op failed: its state is unknown, and the
        failed write's undo may have removed the file)."""
        with self._lock:
            for key, (_, kept) in list(self._files.items()):
                if kept is handle:
                    self._close(key)

    def close(self) -> None:
        """Closes every handle kept."""
        with self._lock:
            while self._files:
                self._close(next(iter(self._files)))

    def _close(self, key: tuple) -> None:
        _, handle = self._files.pop(key)
        handle.close()

    def _close_unlinked(self) -> None:
        for key, (_, handle) in list(self._files.items()):
            try:
                unlinked = os.fstat(handle.fileno()).st_nlink == 0
            except OSError:
                unlinked = True
            if unlinked:
                self._close(key)
