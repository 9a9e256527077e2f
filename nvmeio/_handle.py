"""aio_handle: DeepSpeed's DeepNVMe handle API on nvmeio's native core.

Every op moves one buffer to or from one file range. ``async_*`` ops return
at once; ``wait()`` completes all of them. Until then the buffer belongs to
the handle: writing into the source of an async write or reading the target
of an async read before ``wait()`` is a data race. The handle keeps a
reference to every buffer in flight, so dropping yours is safe. Threads may
share a handle, but ``wait()`` collects the ops (and the first error) of all
of them: a thread that needs its own results uses its own handle.

A CUDA tensor is staged through locked host memory by ``cuda_staging`` (its
ops run in order on a background thread of the handle, and ``wait()`` waits
for them too); see [Note: async ops on CUDA tensors and data races] there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import warnings
from typing import Any, Callable, Optional

from . import atomic_file
from ._backend_choice import resolve_backend
from ._buffers import DeviceBuffer, IoBuffer, as_io_buffer, mark_read_into
from ._cuda_staging import StagingConfig, StagingEngine
from . import env
from .errors import make_error
from ._file_checks import compare_with_file, whole_file_size
from ._locked import LockedTensors
from ._process import native_handle, prepare
from .settings import AioSettings
from .striping import StripedFile, check_parts_readable, preallocate_parts

__all__ = ["aio_handle"]

PathLike = "str | bytes | os.PathLike | int"
_DEFAULTS = AioSettings()
_VALIDATE_PIECE = 64 << 20  # bytes compared per step by validate=True
_MAX_OFFSET = (1 << 63) - 1     # off_t
_MAX_FD = (1 << 31) - 1
_warned_no_direct: set = set()  # kinds of file _warn_no_direct has warned of in this process


def path_arg(name: str, value: Any) -> str:
    """A path argument as a str; refuses what the kernel would misread.

    A NUL byte would end the C string early: "dir/victim\0.ignored" would
    write "dir/victim". Raised before any file is touched.
    """
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{name} must be a path (str, bytes or os.PathLike) or an open file "
                        f"descriptor, got {type(value).__name__}") from None
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if "\0" in path:
        raise ValueError(f"{name} contains a NUL byte, which would cut the path short: {path!r}")
    return path


def _fd_arg(name: str, fd: int) -> int:
    if not 0 <= fd <= _MAX_FD:
        raise ValueError(f"{name}: file descriptor {fd} is out of range (0..{_MAX_FD})")
    return fd


def _is_fd(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class aio_handle:  # the name users know from DeepSpeed
    """Asynchronous file I/O handle (DeepSpeed ``aio_handle`` compatible).

    Args:
        block_size: bytes per I/O request (rounded up to 4096).
        queue_depth: requests kept in flight per worker thread.
        single_submit: submit one request per syscall instead of batches.
        overlap_events: reap completions while submitting instead of waiting
            for each whole batch.
        intra_op_parallelism: worker threads; one op is split across them.
        backend: "auto" (the fastest available, measured once per process; see
            nvmeio._backend_choice), "io_uring", "aio" (kernel AIO) or "psync".

    Environment (read by nvmeio.env; flags take 0/1, false/true, no/yes,
    off/on): ``NVMEIO_BACKEND`` fixes what "auto" means; ``NVMEIO_DIRECT_IO=0``
    turns O_DIRECT off (buffered I/O + fdatasync, as on a file system that
    refuses O_DIRECT); ``NVMEIO_MLOCK=0`` makes ``new_cpu_locked_tensor`` skip
    mlock. The defaults and bounds are :class:`nvmeio.AioSettings`'.
    """

    def __init__(self, block_size: int = _DEFAULTS.block_size,
                 queue_depth: int = _DEFAULTS.queue_depth,
                 single_submit: bool = _DEFAULTS.single_submit,
                 overlap_events: bool = _DEFAULTS.overlap_events,
                 intra_op_parallelism: int = _DEFAULTS.intra_op_parallelism,
                 backend: str = _DEFAULTS.backend):
        settings = AioSettings(block_size=block_size, queue_depth=queue_depth,
                               single_submit=bool(single_submit),
                               overlap_events=bool(overlap_events),
                               intra_op_parallelism=intra_op_parallelism, backend=backend)
        prepare()  # before "auto" is resolved: its probe is native I/O too (_process.py)
        self._block_size = settings.block_size
        self._queue_depth = settings.queue_depth
        self._intra_op_parallelism = settings.intra_op_parallelism
        self._single_submit = settings.single_submit
        self._overlap_events = settings.overlap_events
        self._backend = resolve_backend(settings.backend)
        self._direct_io = env.get("NVMEIO_DIRECT_IO")
        self._native = self._new_native()
        self._device_ops = None  # device (CUDA) ops: created on the first one
        self._lock = threading.Lock()
        self._inflight: list[IoBuffer] = []
        self._checks: list[Callable[[], None]] = []  # validations run by wait()
        self._extra_pieces = 0  # native ops beyond one per striped op, not counted by wait()
        self._deferred: list[BaseException] = []  # striped ops that failed part-way through submission
        self._locked = LockedTensors(self._native)

    def __repr__(self) -> str:
        return (f"aio_handle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
                f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
                f"intra_op_parallelism={self._intra_op_parallelism}, backend={self._backend!r})")

    def _new_native(self):
        return native_handle(
            block_size=self._block_size, queue_depth=self._queue_depth,
            single_submit=self._single_submit, overlap_events=self._overlap_events,
            intra_op_parallelism=self._intra_op_parallelism, backend=self._backend,
            direct_io=self._direct_io)

    def _device_engine(self):
        """Runs the ops on CUDA tensors: staging through host memory, with
        native handles of its own so that its waits never see this handle's ops."""
        with self._lock:
            if self._device_ops is None:
                self._device_ops = StagingEngine(
                    self._new_native,
                    StagingConfig.from_env(self._block_size, self._intra_op_parallelism))
            return self._device_ops

    # -- submission -----------------------------------------------------------------

    def _submit(self, write: bool, buffer: Any, filename: Any, file_offset: int,
                validate: bool = False) -> None:
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"file_offset must be a non-negative int, got {file_offset!r}")
        if isinstance(filename, StripedFile):
            self._submit_striped(write, buffer, filename, file_offset, validate)
            return
        target = _fd_arg("filename", filename) if _is_fd(filename) else path_arg("filename", filename)
        if validate and isinstance(target, int):
            # Refused before anything is submitted: the check re-reads the file by its path.
            raise ValueError("validate=True needs a path, not a file descriptor")
        io = as_io_buffer(buffer, writable=not write)
        if file_offset > _MAX_OFFSET - io.nbytes:
            raise ValueError(f"file_offset {file_offset} is out of range: the op would end past "
                             f"the largest file offset ({_MAX_OFFSET})")
        if isinstance(io, DeviceBuffer):
            self._submit_device(write, io, target, file_offset, validate)
            if not write:
                mark_read_into(io)
            return
        with self._lock:
            self._inflight.append(io)
        try:
            if isinstance(target, int):
                # A descriptor's O_DIRECT is the caller's choice: nothing to warn of.
                self._native.submit_fd(write, io.ptr, io.nbytes, target, file_offset)
                path, buffered = None, False
            else:
                path = target
                # Bytes: a name that is not UTF-8 passes as it is (see [Note: paths cross
                # the binding as bytes] in native/bindings.cpp).
                buffered = self._native.submit(write, io.ptr, io.nbytes, os.fsencode(path),
                                               file_offset)
        except BaseException:
            with self._lock:
                self._inflight.remove(io)
            raise
        if not write:
            mark_read_into(io)  # at submission: see there
        if validate:
            with self._lock:
                self._checks.append(lambda: _validate(io, path, file_offset))
        if buffered:
            _warn_no_direct(path, self._direct_io)

    def _submit_striped(self, write: bool, buffer: Any, f: StripedFile, file_offset: int,
                        validate: bool) -> None:
        """One op on a striped file: a native op per unit (nvmeio/striping.py [Note: striping])."""
        io = as_io_buffer(buffer, writable=not write)
        if isinstance(io, DeviceBuffer):
            raise ValueError("a striped file takes host buffers (CPU tensors, numpy arrays); stage a "
                             "CUDA tensor through a locked host tensor first")
        if file_offset > _MAX_OFFSET - io.nbytes:
            raise ValueError(f"file_offset {file_offset} is out of range")
        if write:
            preallocate_parts(f, file_offset, io.nbytes)
        else:
            check_parts_readable(f, file_offset, io.nbytes)
        pieces = f.pieces(file_offset, io.nbytes) or [(0, 0, 0, 0)]  # an empty op: one empty piece
        with self._lock:
            self._inflight.append(io)
        submitted = 0
        for part, offset, start, length in pieces:
            path = f.parts[part]
            try:
                buffered = self._native.submit(write, io.ptr + start, length, os.fsencode(path), offset)
            except BaseException as exc:
                if submitted == 0:
                    with self._lock:
                        self._inflight.remove(io)
                    raise
                # Pieces are in flight in the buffer: the op fails at wait(), with them.
                with self._lock:
                    self._deferred.append(exc)
                break
            submitted += 1
            if validate:
                piece = _Piece(io.ptr + start, length)
                with self._lock:
                    self._checks.append(lambda p=piece, path=path, at=offset: _validate(p, path, at))
            if buffered:
                _warn_no_direct(path, self._direct_io)
        with self._lock:
            self._extra_pieces += submitted - 1
        if not write:
            mark_read_into(io)

    def _submit_device(self, write: bool, io: DeviceBuffer, target: "str | int", file_offset: int,
                       validate: bool) -> None:
        self._device_engine().submit(write, io, target, file_offset, validate)

    def async_pread(self, buffer: Any, filename: PathLike = None, file_offset: int = 0, *,
                    fd: Optional[int] = None) -> int:
        """Starts reading ``buffer.nbytes`` bytes at ``file_offset``; returns 0.

        ``filename`` is a path or an open file descriptor; ``fd=`` names the
        descriptor by keyword (DeepSpeed's overload). See :meth:`async_pwrite`.
        """
        self._submit(False, buffer, _target(filename, fd), file_offset)
        return 0

    def async_pwrite(self, buffer: Any, filename: PathLike = None, file_offset: int = 0, *,
                     fd: Optional[int] = None) -> int:
        """Starts writing ``buffer`` at ``file_offset``; returns 0.

        DeepSpeed's two overloads: ``async_pwrite(buffer, filename, file_offset=0)``
        and ``async_pwrite(buffer, fd, file_offset=0)`` (``fd=`` by keyword too).
        A descriptor stays the caller's: the handle works on a duplicate and
        never closes or moves it (positioned I/O). Any open mode works: with
        O_DIRECT the aligned middle goes direct and an unaligned head or tail
        byte-exact through a buffered reopening of the same file; without
        O_DIRECT every request goes through the page cache and a write is
        fdatasync'ed before the op completes, so it is as durable at ``wait()``
        as a direct one. Any offset and size work either way.
        """
        self._submit(True, buffer, _target(filename, fd), file_offset)
        return 0

    def sync_pread(self, buffer: Any, filename: PathLike = None, file_offset: int = 0, *,
                   fd: Optional[int] = None) -> int:
        """Reads and waits; returns the number of ops completed (pending ones included)."""
        self._submit(False, buffer, _target(filename, fd), file_offset)
        return self.wait()

    def sync_pwrite(self, buffer: Any, filename: PathLike = None, file_offset: int = 0, *,
                    fd: Optional[int] = None) -> int:
        """Writes and waits; returns the number of ops completed (pending ones included)."""
        self._submit(True, buffer, _target(filename, fd), file_offset)
        return self.wait()

    def pread(self, buffer: Any, filename: PathLike, validate: bool = False,
              async_op: bool = False, file_offset: int = 0, **kwargs: Any) -> int:
        """DeepSpeed's combined form; the 4th argument (``async`` there) picks async."""
        async_op = _async_kwarg(async_op, kwargs)
        self._submit(False, buffer, filename, file_offset, validate)
        return 0 if async_op else self.wait()

    def pwrite(self, buffer: Any, filename: PathLike, validate: bool = False,
               async_op: bool = False, file_offset: int = 0, **kwargs: Any) -> int:
        """DeepSpeed's combined form; the 4th argument (``async`` there) picks async."""
        async_op = _async_kwarg(async_op, kwargs)
        self._submit(True, buffer, filename, file_offset, validate)
        return 0 if async_op else self.wait()

    def read(self, buffer: Any, filename: PathLike, validate: bool = False) -> int:
        """Reads a whole file whose size must equal the buffer's; returns 0."""
        path = path_arg("filename", filename)
        io = as_io_buffer(buffer, writable=True)
        size = whole_file_size(path, io.nbytes)
        if size != io.nbytes:
            raise ValueError(f"read: {path!r} holds {size} bytes but the buffer has {io.nbytes}; "
                             "use pread with file_offset to read part of a file")
        self.pread(buffer, path, validate)
        return 0

    def write(self, buffer: Any, filename: PathLike, validate: bool = False) -> int:
        """Replaces a whole file with ``buffer``, atomically; returns 0.

        The bytes go to a new temporary file in the same directory (created
        exclusively, never through a symlink, nameless where the file system
        allows: see nvmeio.atomic_file), which is renamed over ``filename``
        only once complete and on disk. A failure, Ctrl-C or a killed process
        never leaves a half-written file under that name. Like
        ``open(filename, "w")``, it refuses a file this user may not write
        (PermissionError) and a directory (IsADirectoryError). The new file is
        0600.

        A block or character device node is written in place instead, from
        its first byte, as DeepSpeed does (no rename, no truncation: a failed
        write leaves it partly written); a FIFO, a socket, or a symlink to one
        or to a device is refused (AioError naming the file type). See
        [Note: device nodes are written in place] in nvmeio.atomic_file.
        """
        path = path_arg("filename", filename)
        nbytes = getattr(buffer, "nbytes", 0)
        if atomic_file.is_device_node(path, nbytes):
            self.pwrite(buffer, path, validate)
            return 0
        _check_replaceable(path, nbytes)
        try:
            tmp = atomic_file.create_temp_beside(path)
        except FileNotFoundError:
            directory = os.path.dirname(os.path.abspath(path))
            raise make_error(errno.ENOENT, f"open for writing failed: directory '{directory}' does "
                             "not exist", path, 0, nbytes) from None
        except OSError as e:
            raise make_error(e.errno, f"creating a temporary file beside it failed: {e.strerror}",
                             path, 0, nbytes) from None
        with tmp:
            try:
                self.pwrite(buffer, tmp.io_path, validate)
            except OSError as e:
                if e.filename == tmp.io_path:
                    e.filename = path       # the user's name, not /proc/self/fd/N
                raise
            tmp.publish(durable=True)
        return 0

    # -- completion -----------------------------------------------------------------

    def wait(self) -> int:
        """Blocks until every submitted op is done.

        Returns the number of ops completed since the last ``wait()`` (0 when
        nothing was pending) and raises the first error among them.

        A handle is one queue, as in DeepSpeed: the ops are those of every
        thread using it, so a thread's ``wait()`` may raise the error of an op
        another thread submitted (the error names that op's path, offset and
        length) and then that thread's ``wait()`` does not see it again.
        Threads that need their own results use a handle each.
        """
        with self._lock:
            # Buffers of ops submitted before this call; they stay referenced
            # until the native wait below has seen them complete.
            done, self._inflight = self._inflight, []
            checks, self._checks = self._checks, []
            extra, self._extra_pieces = self._extra_pieces, 0
            deferred, self._deferred = self._deferred, []
            device = self._device_ops
        if device is None:
            try:
                n = self._native.wait()
            except KeyboardInterrupt:
                # The ops go on: keep their buffers alive for the next wait().
                with self._lock:
                    self._inflight[:0] = done
                    self._checks[:0] = checks
                    self._extra_pieces += extra
                    self._deferred[:0] = deferred
                raise
            except BaseException:
                if deferred:
                    raise deferred[0] from None
                raise
        else:
            # Both halves complete before either's error is raised.
            error = None
            try:
                n = self._native.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                n, error = 0, exc
            device_n, device_error = device.drain()
            n += device_n
            if error is None:
                error = device_error
            if error is not None:
                raise error
        if deferred:
            raise deferred[0]
        for check in checks:
            check()
        return n - extra

    # -- locked host memory ----------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor):
        """A 1-D CPU tensor of ``example_tensor.dtype``, page-aligned and mlock'ed."""
        return self._locked.new(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor) -> bool:
        """Unlocks a tensor from ``new_cpu_locked_tensor`` (see [Note: freeing a locked tensor]).

        Returns True when it did; False, changing nothing, for a tensor this handle did not
        allocate or freed already (as DeepSpeed does).
        """
        return self._locked.free(tensor)

    def is_pinned(self, tensor) -> bool:
        """True when ``tensor`` is torch-pinned or inside a locked region of this handle."""
        try:
            if tensor.is_pinned():
                return True
        except RuntimeError:  # builds without an accelerator may refuse the query
            pass
        return self._locked.contains(tensor)

    # -- settings -------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        """``intra_op_parallelism * 512``, as DeepSpeed reports it.

        nvmeio accepts any size and offset; buffers sized to a multiple of this
        split evenly across the worker threads.
        """
        return self._intra_op_parallelism * 512

    def get_backend(self) -> str:
        return self._backend

    def buffered_fallback(self) -> bool:
        """True once a file system refused O_DIRECT and buffered I/O was used."""
        device = self._device_ops
        return bool(self._native.refused_direct()) or (device is not None
                                                       and device.refused_direct())

    def pending(self) -> int:
        """How many submitted ops have not finished yet. At 0, :meth:`wait` does not block
        (it still runs their completion and raises their errors): a caller can check
        whether a read has landed without waiting for it."""
        device = self._device_ops
        return int(self._native.pending()) + (device.pending() if device is not None else 0)

    def stats(self) -> list[dict]:
        """Per worker thread: requests, bytes, bounced, submit/reap calls, max_inflight."""
        return list(self._native.stats())

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Completes the ops in flight, then frees the worker threads and their
        engines at once (kernel AIO contexts are a system-wide resource that
        garbage collection would free only later). Further I/O raises
        ValueError; closing twice is harmless. Errors of ops still pending are
        raised here, as by ``wait()``.
        """
        try:
            if self._native.pending() or self._inflight:
                self.wait()
        finally:
            device = self._device_ops
            if device is not None:
                device.close()
            self._native.close()

    @property
    def closed(self) -> bool:
        return bool(self._native.closed())

    def __enter__(self) -> "aio_handle":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _target(filename: Any, fd: Optional[int]) -> Any:
    """The file of an op: ``filename`` (a path or an fd) or the keyword ``fd``, exactly one."""
    if fd is None:
        if filename is None:
            raise TypeError("missing the file: pass filename (a path or an open fd) or fd=")
        return filename
    if filename is not None:
        raise TypeError("pass either filename or fd, not both")
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise TypeError(f"fd must be an open file descriptor (a non-negative int), got {fd!r}")
    return fd


def _check_replaceable(path: str, nbytes: int) -> None:
    """What ``open(path, "w")`` would refuse, ``write()`` refuses too (a rename
    would replace a read-only file or a symlink's target silently otherwise)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise make_error(e.errno, f"open for writing failed: {e.strerror}", path, 0, nbytes) from None
    if stat.S_ISDIR(st.st_mode):
        raise make_error(errno.EISDIR, "open for writing failed: Is a directory", path, 0, nbytes)
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise make_error(errno.EACCES, "open for writing failed: Permission denied (the file is "
                         "read-only for this user; write() does not replace it: change its mode "
                         "or remove it first)", path, 0, nbytes)


def _warn_no_direct(path: str, direct_io: bool) -> None:
    """Says that an op went without O_DIRECT, once per process for each kind of file:
    direct I/O turned off, a character device (none has it), each file system refusing it."""
    try:
        st = os.stat(path)
    except OSError:
        return  # gone already: the op's own outcome says the rest
    if not direct_io:
        key, why = "off", ("NVMEIO_DIRECT_IO=0 turns it off: every handle falls back to buffered "
                           "I/O + fdatasync (warned once per process)")
    elif stat.S_ISCHR(st.st_mode):
        key, why = "chr", ("character devices refuse it, so its ops use plain reads and writes "
                           "(warned once per process for all character devices)")
    else:
        key, why = st.st_dev, ("its file system refuses it: ops on that file system fall back to "
                               "buffered I/O + fdatasync (warned once per process per file system)")
    if key not in _warned_no_direct:
        _warned_no_direct.add(key)
        warnings.warn(f"nvmeio: no O_DIRECT for {path!r}: {why}", RuntimeWarning, stacklevel=4)


class _Piece:
    """A piece of an op's buffer, as ``_validate`` reads it."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


def _async_kwarg(async_op: bool, kwargs: dict) -> bool:
    if "async" in kwargs:
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
    return bool(async_op)


def _validate(io: IoBuffer, path: str, offset: int) -> None:
    """Re-reads the file range through the page cache and compares bytes."""
    compare_with_file(path, offset, io.nbytes, lambda at, n: ctypes.string_at(io.ptr + at, n),
                      _VALIDATE_PIECE)
