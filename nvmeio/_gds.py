"""gds_handle: the aio_handle API, with CUDA tensors moved by cuFile (GPUDirect Storage).

    h = nvmeio.gds_handle(block_size=1048576, intra_op_parallelism=8)
    t = h.new_pinned_device_tensor(1 << 28, torch.empty(0, device="cuda"))
    h.async_pwrite(t, "/local_nvme/t.bin"); h.wait()

cuFile is reached through kvikio (``pip install nvmeio[gds]``: kvikio-cu12;
``nvmeio[gds-cu13]``: kvikio-cu13), imported when a handle is constructed.
CUDA tensors go through kvikio's ``CuFile.pread/pwrite``; host buffers go
through nvmeio's native core exactly as on ``aio_handle``, so one handle
serves both, as DeepSpeed's gds_handle does.

Settings: ``block_size`` is the task size of each CuFile op (kvikio splits an
op into tasks of that size); ``intra_op_parallelism`` sizes kvikio's thread
pool, which is process-wide: a handle grows it to at least that many
threads and never shrinks it. ``queue_depth``, ``single_submit`` and
``overlap_events`` have no cuFile equivalent and apply to host buffers.
Unless ``NVMEIO_DIRECT_IO=0`` or ``KVIKIO_AUTO_DIRECT_IO_READ`` is set, a
handle also turns on kvikio's (process-wide) O_DIRECT for POSIX reads, as
nvmeio's own reads use it. A handle keeps a file's cuFile handle open from
one op to the next (see [Note: cuFile handles kept open] in _cufile_cache)
and closes them all with ``close()``.

Where the GPUDirect Storage driver (nvidia-fs) or libcufile is missing,
kvikio's compatibility mode does the I/O with POSIX calls and its own host
bounce buffers: slower, still correct. ``get_compat_mode()`` says whether it
is on, ``get_io_mode()`` which path is active.

[Note: without GPUDirect, CUDA tensors take nvmeio's staging]
Without the GDS driver no byte goes from the drive to the GPU directly: kvikio's
compatibility mode (io mode "posix") and cuFile's own fallback ("cufile-compat")
both bounce through host memory. aio_handle's staging pipeline does the same
bouncing through locked chunks, copies and file ops overlapped (cuda_staging),
and measured faster on an H200 VM in compatibility mode: 1 GiB read at 0.96x
host buffers' speed against kvikio's 0.82x, written at 0.90x by both
(bench/gpu_runs/2026-11-27_0017_h200; the three runs there: 0.80-0.89x of the
staging's reads). cuFile's own fallback was not on those machines; it bounces
through host memory too, so it is taken to be no faster. So in those two modes a gds_handle
gives CUDA tensors to that pipeline (``get_device_path()`` says "staging");
with the driver (io mode "gds") or where kvikio cannot tell ("cufile"), to
cuFile. ``NVMEIO_GDS_STAGING`` forces one or the other.

Ops on CUDA tensors follow aio_handle's rules (see [Note: async ops on CUDA
tensors and data races] in cuda_staging): they run in submission order on
the handle's background thread after the work queued on the current stream
at submission, and ``wait()`` waits for them.
"""

from __future__ import annotations

import errno
import importlib
import threading
import weakref
from typing import Any, Optional

from . import env
from ._handle import aio_handle
from ._cuda import cuda_unavailable_reason, stream_fence
from ._cufile_cache import CuFileCache
from ._device_ops import DeviceOpQueue
from .errors import AioError, make_error
from ._file_checks import compare_with_file, prepare_target
from ._locked import check_new_tensor_args
from .settings import AioSettings

__all__ = ["gds_handle", "gds_unavailable_reason", "gds_device_path"]

_DEFAULTS = AioSettings()
_VALIDATE_PIECE = 64 << 20  # bytes compared per step by validate=True


def _install_hint(torch: Any) -> str:
    major = (torch.version.cuda or "").split(".")[0]
    cu12 = "`pip install nvmeio[gds]` (pulls kvikio-cu12, for CUDA 12)"
    cu13 = "`pip install nvmeio[gds-cu13]` (pulls kvikio-cu13, for CUDA 13)"
    if major == "12":
        return f"{cu12}; this torch uses CUDA {torch.version.cuda}"
    if major == "13":
        return f"{cu13}; this torch uses CUDA {torch.version.cuda}"
    return f"{cu12} or {cu13}, matching the CUDA version of your torch"


def _load_kvikio() -> Any:
    """kvikio, or RuntimeError saying what is missing and how to install it."""
    try:
        import torch
    except ImportError:
        raise RuntimeError("gds_handle needs torch with CUDA: `pip install torch`") from None
    reason = cuda_unavailable_reason(torch)
    if reason is not None:
        raise RuntimeError(f"gds_handle needs CUDA and an NVIDIA GPU: {reason}")
    try:
        kvikio = importlib.import_module("kvikio")
        importlib.import_module("kvikio.defaults")
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise RuntimeError(
            f"gds_handle needs kvikio (NVIDIA's Python binding of cuFile), which could not be "
            f"imported ({type(e).__name__}: {e}). Install it with {_install_hint(torch)}") from e
    return kvikio


def gds_device_path() -> Optional[str]:
    """How a gds_handle made now would move CUDA tensors (``get_device_path()``: "cufile" or
    "staging"), without making one; None where no gds_handle can be made here."""
    try:
        return _device_path(_load_kvikio())
    except RuntimeError:
        return None


def gds_unavailable_reason() -> Optional[str]:
    """None when a gds_handle can be constructed here, else what is missing
    (the message gds_handle's constructor raises)."""
    try:
        _load_kvikio()
    except RuntimeError as e:
        return str(e)
    return None


# -- kvikio's settings, across its API versions (kvikio.defaults.get/set since 25.04) -------------

def _kvikio_num_threads(defaults: Any) -> int:
    if hasattr(defaults, "get"):
        return int(defaults.get("num_threads"))
    return int(defaults.get_num_threads())


def _kvikio_set_num_threads(defaults: Any, n: int) -> None:
    if hasattr(defaults, "set"):
        defaults.set("num_threads", n)
    else:
        defaults.num_threads_reset(n)


def _kvikio_prefer_direct_reads(defaults: Any) -> None:
    """Turns on kvikio's O_DIRECT for POSIX reads (process-wide, as its thread
    pool is), unless KVIKIO_AUTO_DIRECT_IO_READ says otherwise.

    In compatibility mode (and below its GDS threshold) kvikio does POSIX I/O
    through host bounce buffers; by default its writes use O_DIRECT but its
    reads go through the page cache (``auto_direct_io_read`` is off), an
    extra copy per byte that nvmeio's own reads never make. On an H200 VM in
    compatibility mode a 1 GiB read ran at 0.69x the host path's speed, the
    write at 0.96x (bench/gpu_check.py). A kvikio without the setting (older
    releases) is left as it is.
    """
    if env.is_set("KVIKIO_AUTO_DIRECT_IO_READ") or not hasattr(defaults, "get"):
        return
    try:
        if not defaults.get("auto_direct_io_read"):
            defaults.set("auto_direct_io_read", True)
    except Exception:  # noqa: BLE001 - a kvikio without the setting
        pass


def _kvikio_compat_mode(kvikio: Any) -> bool:
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.compat_mode()
    if isinstance(mode, bool):  # kvikio <= 24.10
        return mode
    name = getattr(mode, "name", str(mode)).upper()
    if name.endswith("AUTO"):  # unresolved: AUTO falls back to POSIX without GDS
        return _gds_available(kvikio) is not True
    return name.endswith("ON")


_NO_GPUDIRECT = ("posix", "cufile-compat")  # io modes that bounce through host memory


def _io_mode(kvikio: Any) -> str:
    if _kvikio_compat_mode(kvikio):
        return "posix"
    gds = _gds_available(kvikio)
    return "cufile" if gds is None else ("gds" if gds else "cufile-compat")


def _device_path(kvikio: Any) -> str:
    """"staging" or "cufile": see [Note: without GPUDirect, CUDA tensors take nvmeio's staging]."""
    forced = env.get("NVMEIO_GDS_STAGING")
    if forced is not None:
        return "staging" if forced else "cufile"
    return "staging" if _io_mode(kvikio) in _NO_GPUDIRECT else "cufile"


def _gds_available(kvikio: Any) -> Optional[bool]:
    """Whether cuFile runs with the GDS driver (True) or in its own
    compatibility mode (False); None when this kvikio cannot tell."""
    try:
        driver = importlib.import_module("kvikio.cufile_driver")
        if hasattr(driver, "get"):
            return bool(driver.get("is_gds_available"))
        return bool(driver.DriverProperties().is_gds_available)
    except Exception:  # noqa: BLE001 - no libcufile, or an older kvikio
        return None


# -- CUDA tensors through cuFile -------------------------------------------------------------------

class _CuFileOps:
    """The device ops of a gds_handle: one CuFile op each, on the background
    thread, through the file's kept cuFile handle (see [Note: cuFile handles
    kept open] in _cufile_cache)."""

    def __init__(self, kvikio: Any, task_size: int) -> None:
        self._kvikio = kvikio
        self._task_size = task_size
        self._files = CuFileCache(kvikio.CuFile, limit=env.get("NVMEIO_CUFILE_HANDLES"))
        self._ops = DeviceOpQueue("nvmeio-gds-ops")
        weakref.finalize(self, _close_ops, self._ops, self._files)

    def refused_direct(self) -> bool:
        return False

    def close(self) -> None:
        """Lets queued ops finish, then ends the thread and closes the files."""
        _close_ops(self._ops, self._files)

    def drain(self) -> "tuple[int, BaseException | None]":
        return self._ops.drain()

    def pending(self) -> int:
        return self._ops.pending()

    def submit(self, write: bool, buf: Any, target: "str | int", file_offset: int,
               validate: bool = False) -> None:
        undo = prepare_target(write, target, file_offset, buf.nbytes)
        try:
            fence = stream_fence(buf.device)
            self._ops.submit(lambda: self._run(write, buf, target, file_offset, fence, validate,
                                               undo))
        except BaseException:
            undo()
            raise

    def _run(self, write: bool, buf: Any, target: "str | int", file_offset: int, fence: Any,
             validate: bool, undo: Any) -> None:
        where = f"<fd {target}>" if isinstance(target, int) else target
        path = f"/proc/self/fd/{target}" if isinstance(target, int) else target
        verb = "pwrite" if write else "pread"
        f = None
        try:
            fence.synchronize()  # the kernels that were producing (or using) the tensor
            if buf.nbytes:
                f = self._files.get(target, write)
                # kvikio splits the op into tasks of task_size run by its thread pool.
                op = f.pwrite if write else f.pread
                done = op(buf.tensor, buf.nbytes, file_offset, task_size=self._task_size).get()
                if done != buf.nbytes:
                    raise make_error(errno.EIO, f"cuFile {verb} moved {done} of {buf.nbytes} bytes",
                                     where, file_offset, buf.nbytes)
        except AioError:
            self._forget(f)
            undo()
            raise
        except Exception as e:  # kvikio raises RuntimeError and friends
            self._forget(f)
            undo()
            raise make_error(getattr(e, "errno", None) or errno.EIO, f"kvikio {verb} failed: {e}",
                             where, file_offset, buf.nbytes) from e
        if validate:
            compare_with_file(path, file_offset, buf.nbytes,
                              lambda at, n: buf.tensor[at:at + n].cpu().numpy(), _VALIDATE_PIECE)

    def _forget(self, f: Any) -> None:
        if f is not None:
            try:
                self._files.discard(f)
            except Exception:  # noqa: BLE001 - the op's own error is the one raised
                pass


def _close_ops(ops: DeviceOpQueue, files: CuFileCache) -> None:
    ops.close()  # the queued ops still use the files
    files.close()


def _flat_bytes(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _allocation_of(t: Any) -> tuple:
    """The CUDA allocation (torch caching-allocator segment) holding ``t``."""
    import torch

    ptr = t.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        base = seg.get("address", 0)
        if seg.get("device") == t.device.index and base <= ptr < base + seg.get("total_size", 0):
            return (t.device.index, base)
    return (t.device.index, ptr)


class _DevicePins:
    """Device memory registered with cuFile by one handle.

    [Note: registering device memory]
    ``kvikio.memory_register`` registers the whole CUDA allocation that holds
    a pointer, and torch's caching allocator packs many tensors into one
    allocation: registering it twice is an error, and deregistering it for
    one tensor would drop it for its neighbours. So registrations are
    counted per allocation: the first pinned tensor of an allocation
    registers it, the last one unpinned deregisters it (through the tensor
    that registered it). A pinned tensor stays referenced until it is
    unpinned, so its memory is never freed, nor handed to another tensor,
    while cuFile has it registered. In compatibility mode kvikio skips
    registration; the bookkeeping is the same.
    """

    def __init__(self, kvikio: Any) -> None:
        self._kvikio = kvikio
        self._lock = threading.Lock()
        self._tensors: dict[int, tuple] = {}      # data_ptr -> (tensor, allocation)
        self._allocations: dict[tuple, list] = {}  # allocation -> [count, registering tensor]

    def pin(self, t: Any) -> None:
        if t.numel() == 0:
            return
        with self._lock:
            if t.data_ptr() in self._tensors:
                return
            key = _allocation_of(t)
            entry = self._allocations.get(key)
            if entry is None:
                try:
                    self._kvikio.memory_register(_flat_bytes(t))
                except Exception as e:  # cuFile's error, with the size
                    raise RuntimeError(f"cuFile could not register {t.numel() * t.element_size()} "
                                       f"bytes of device memory on {t.device}: {e}") from e
                entry = self._allocations[key] = [0, t]
            entry[0] += 1
            self._tensors[t.data_ptr()] = (t, key)

    def unpin(self, t: Any) -> None:
        if t.numel() == 0:
            return
        with self._lock:
            found = self._tensors.pop(t.data_ptr(), None)
            if found is None:
                raise ValueError("this tensor is not pinned by this gds_handle (or was unpinned "
                                 "already)")
            entry = self._allocations[found[1]]
            entry[0] -= 1
            if entry[0] == 0:
                del self._allocations[found[1]]
                self._kvikio.memory_deregister(_flat_bytes(entry[1]))

    def contains(self, t: Any) -> bool:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            for pinned, _ in self._tensors.values():
                base = pinned.data_ptr()
                if (pinned.device == t.device and base <= start
                        and end <= base + pinned.numel() * pinned.element_size()):
                    return True
        return False


class gds_handle(aio_handle):  # the name users know from DeepSpeed
    """GPUDirect Storage handle (DeepSpeed ``gds_handle`` compatible).

    Same I/O API as :class:`aio_handle`; CUDA tensors go through cuFile
    (kvikio), or through aio_handle's staging where cuFile has no GPUDirect
    path (see the [Note] above), host buffers through the native core. Raises RuntimeError,
    naming what is missing and the install command, where CUDA or kvikio is
    not available.
    """

    def __init__(self, block_size: int = _DEFAULTS.block_size,
                 queue_depth: int = _DEFAULTS.queue_depth,
                 single_submit: bool = _DEFAULTS.single_submit,
                 overlap_events: bool = _DEFAULTS.overlap_events,
                 intra_op_parallelism: int = _DEFAULTS.intra_op_parallelism):
        kvikio = _load_kvikio()
        super().__init__(block_size=block_size, queue_depth=queue_depth,
                         single_submit=single_submit, overlap_events=overlap_events,
                         intra_op_parallelism=intra_op_parallelism)
        self._kvikio = kvikio
        if _kvikio_num_threads(kvikio.defaults) < self._intra_op_parallelism:
            _kvikio_set_num_threads(kvikio.defaults, self._intra_op_parallelism)
        if self._direct_io:  # NVMEIO_DIRECT_IO=0 leaves kvikio's reads buffered too
            _kvikio_prefer_direct_reads(kvikio.defaults)
        self._pins = _DevicePins(kvikio)
        if _device_path(kvikio) == "cufile":
            self._device_ops = _CuFileOps(kvikio, task_size=self._block_size)
        # else left to aio_handle: its staging engine, made at the first device op

    def __repr__(self) -> str:
        return (f"gds_handle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
                f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
                f"intra_op_parallelism={self._intra_op_parallelism}, "
                f"io_mode={self.get_io_mode()!r}, device_path={self.get_device_path()!r})")

    # -- pinned device memory -------------------------------------------------------

    def new_pinned_device_tensor(self, num_elem: int, example_tensor):
        """A 1-D CUDA tensor of ``example_tensor.dtype`` registered with cuFile.

        It lives on the example's device when that is a CUDA device, else on
        the current CUDA device. Release it with ``free_pinned_device_tensor``.
        """
        import torch

        check_new_tensor_args(num_elem, example_tensor)
        device = example_tensor.device
        if device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        self._pins.pin(t)
        return t

    def free_pinned_device_tensor(self, tensor) -> bool:
        """Deregisters a tensor from ``new_pinned_device_tensor``; returns True."""
        self._pins.unpin(tensor)
        return True

    def pin_device_tensor(self, tensor) -> bool:
        """Registers an existing contiguous CUDA tensor with cuFile; returns True."""
        self._check_device_tensor(tensor, "pin_device_tensor")
        self._pins.pin(tensor)
        return True

    def unpin_device_tensor(self, tensor) -> bool:
        """Deregisters a tensor pinned by ``pin_device_tensor``; returns True."""
        self._pins.unpin(tensor)
        return True

    def is_pinned(self, tensor) -> bool:
        """True for host memory as on aio_handle, and for CUDA tensors this handle pinned."""
        if getattr(getattr(tensor, "device", None), "type", None) == "cuda":
            return self._pins.contains(tensor)
        return super().is_pinned(tensor)

    @staticmethod
    def _check_device_tensor(tensor, what: str) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{what} takes a CUDA tensor, got {where}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous; call .contiguous() first")

    # -- what cuFile is doing ---------------------------------------------------------

    def get_compat_mode(self) -> bool:
        """True when kvikio runs in compatibility mode: POSIX I/O staged through
        host memory, no cuFile (no libcufile, or KVIKIO_COMPAT_MODE=ON)."""
        return _kvikio_compat_mode(self._kvikio)

    def get_io_mode(self) -> str:
        """``"posix"`` (kvikio compatibility mode), ``"gds"`` (cuFile with the
        GPUDirect Storage driver), ``"cufile-compat"`` (cuFile without the
        driver: cuFile's own fallback) or ``"cufile"`` (cuFile; this kvikio
        cannot say whether the driver is there)."""
        return _io_mode(self._kvikio)

    def get_device_path(self) -> str:
        """How this handle moves CUDA tensors: ``"cufile"`` (kvikio's CuFile ops) or
        ``"staging"`` (aio_handle's pipeline through locked host chunks, where cuFile
        has no GPUDirect path: see [Note: without GPUDirect, CUDA tensors take nvmeio's
        staging])."""
        return "cufile" if isinstance(self._device_ops, _CuFileOps) else "staging"

    def get_kvikio_num_threads(self) -> int:
        """Threads of kvikio's (process-wide) pool."""
        return _kvikio_num_threads(self._kvikio.defaults)
