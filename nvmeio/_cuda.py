"""The CUDA side of nvmeio: is CUDA usable here, stream fences, copies on a private stream.

Imported without torch; torch is imported by the functions that need it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

__all__ = ["cuda_unavailable_reason", "stream_fence", "CudaBackend", "RegisteredHost"]


def cuda_unavailable_reason(torch: Any = None) -> Optional[str]:
    """None when torch can use a CUDA device here, else what is missing."""
    if torch is None:
        try:
            import torch
        except ImportError:
            return "torch is not installed (`pip install torch`)"
    if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; on a machine with an "
                "NVIDIA GPU install a CUDA build, e.g. `pip install torch --index-url "
                "https://download.pytorch.org/whl/cu126` (other CUDA versions: "
                "https://pytorch.org/get-started/locally/)")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} has CUDA {torch.version.cuda}, but "
                "torch.cuda.is_available() is False: no NVIDIA GPU or driver is visible to this "
                "process (nvidia-smi must list the GPU; check CUDA_VISIBLE_DEVICES)")
    return None


def stream_fence(device: Any) -> Any:
    """An event recorded now on ``device``'s current stream (of the calling
    thread): waiting for it orders after the work already queued there."""
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    return event


class _CudaCopier:
    """Copies of one device, queued on its own stream, one event per copy."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def fence(self) -> Any:
        return stream_fence(self._device)

    def start(self, fence: Any) -> None:
        self._stream.wait_event(fence)

    def _copy(self, src, dst) -> Any:
        torch = self._torch
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
        return done

    to_host = _copy
    to_device = _copy

    def wait(self, token: Any) -> None:
        token.synchronize()


class CudaBackend:
    """The device side of :class:`StagingEngine` on a real GPU."""

    def copier(self, device: Any) -> _CudaCopier:
        return _CudaCopier(device)

    def pin_host(self, ptr: int, nbytes: int) -> Optional[str]:
        """Pins host memory for DMA from every device; returns why not, or None."""
        import torch

        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        if err == 0:
            return None
        _clear_last_error(cudart)
        return f"cudaHostRegister returned error {err}"

    def unpin_host(self, ptr: int) -> None:
        import torch

        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            _clear_last_error(cudart)  # else torch's next kernel launch raises it (see _clear_last_error)

    def alloc_pinned(self, nbytes: int) -> Optional[Any]:
        """``nbytes`` of page-locked host memory from torch's pinned allocator (cudaHostAlloc), or
        None if CUDA refuses that too."""
        import torch

        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            if torch.cuda.is_available():
                _clear_last_error(torch.cuda.cudart())
            return None


def _loaded_cudart() -> Optional[str]:
    """The path of the CUDA runtime library this process has loaded (torch's), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def _clear_last_error(cudart: Any) -> None:
    """A failed cudaHostRegister stays the thread's last CUDA error, and torch's next kernel launch
    check would raise it as that kernel's (seen on an H200: "part or all of the requested memory
    range is already mapped" from an unrelated op). Reading it clears it: torch's own binding
    where it has one, else the runtime torch loaded, through ctypes. Best effort: a runtime linked
    into torch statically keeps its own error state."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    path = _loaded_cudart()
    if path is not None:
        import ctypes

        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            pass


def _unpin_all(backend: Any, ptrs: List[int]) -> None:
    while ptrs:
        try:
            backend.unpin_host(ptrs.pop())
        except Exception:  # noqa: BLE001 - at exit the CUDA runtime may be gone already
            pass


class RegisteredHost:
    """Host memory registered with CUDA (``cudaHostRegister``) for one owner, so that copies
    between it and a GPU are DMA that overlap other work (locked or huge-page memory is not what
    CUDA calls pinned until then).

    [Note: a registration never outlives its memory]
    Every tensor registered here is also kept here. :meth:`close` (after a device synchronize,
    so no copy still uses the memory) unregisters them all; so does the finalizer when this
    object dies without it, which runs while the tensors it keeps are still alive. A registration
    left on freed memory made the next allocation at that address fail to register, and torch's
    next kernel raise that failure as its own (seen on an H200).

    ``on_refused(why)``: called once, the first time registering fails (the memory still works,
    only its copies are slower); later tensors are not tried. ``backend``: CudaBackend unless a
    test injects a stand-in with ``pin_host`` / ``unpin_host`` / ``alloc_pinned``.

    [Note: staging memory where CUDA refuses registration]
    Some systems refuse ``cudaHostRegister`` but still give page-locked memory through
    ``cudaHostAlloc`` (torch's pinned allocator). That allocator rounds each request up to a power
    of two and keeps it cached for good: fine for the engine's small, bounded buffers that
    copies to and from the GPU stage through (``empty(..., staging=True)``: the gradient
    crossing's slabs and the write-back ring), whose copies then stay asynchronous instead of
    each blocking the CPU; not for a store's master and states, which it could double, and which
    stay pageable there. aio_handle's CUDA chunks do not ask for it: they are read and written
    with O_DIRECT, and huge pages kept that twice as fast as 4 KiB pages here (nvmeio/_locked.py),
    while their copies run on the staging thread, not the caller's."""

    def __init__(self, backend: Any = None, on_refused: Optional[Callable[[str], None]] = None) -> None:
        self._backend = backend if backend is not None else CudaBackend()
        self._on_refused = on_refused
        self._ptrs: List[int] = []
        self._kept: list = []
        self.refused: Optional[str] = None
        self._finalizer = weakref.finalize(self, _unpin_all, self._backend, self._ptrs)

    def register(self, t: Any) -> Optional[str]:
        """Registers the memory of host tensor ``t`` (contiguous); returns why not, or None. After
        :meth:`close` nothing is registered (no finalizer is left to unregister it)."""
        if not self._finalizer.alive:
            return "closed"
        if self.refused is None:
            why = self._backend.pin_host(t.data_ptr(), t.numel() * t.element_size())
            if why is None:
                self._ptrs.append(t.data_ptr())
                self._kept.append(t)
            else:
                self.refused = why
                if self._on_refused is not None:
                    self._on_refused(why)
        return self.refused

    def empty(self, numel: int, dtype: Any = None, staging: bool = False) -> Any:
        """``numel`` elements of ``dtype`` (uint8 by default) of page-aligned host memory, on
        transparent huge pages, exactly their size, registered. ``staging``: a buffer that copies
        stage through, from torch's pinned allocator where registering is refused (see the note)."""
        import torch

        from ._locked import huge_page_tensor

        dtype = torch.uint8 if dtype is None else dtype
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        if self.refused is None:
            t = huge_page_tensor(nbytes)
            if self.register(t) is None or not staging or self.refused is None:  # registered, or closed
                return t.view(dtype)
            del t  # refused just now
        if staging:
            pinned = self._backend.alloc_pinned(nbytes)
            if pinned is not None and pinned.data_ptr() % 4096 == 0:  # page-aligned, as the memory it replaces
                return pinned.view(dtype)
        return huge_page_tensor(nbytes).view(dtype)

    def release(self, t: Any) -> None:
        """Unregisters ``t`` (a tensor from :meth:`empty`, or given to :meth:`register`) and stops
        keeping it, so its memory goes when its last view does. The caller knows no copy still
        uses it (its copy's event was waited for); a tensor not registered here is ignored."""
        ptr = t.data_ptr()
        if ptr in self._ptrs:
            self._ptrs.remove(ptr)
            self._backend.unpin_host(ptr)
        self._kept[:] = [k for k in self._kept if k.data_ptr() != ptr]

    def close(self) -> None:
        """Unregisters everything (the memory stays valid for whoever still views it)."""
        if self._ptrs:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
        self._finalizer()
        self._kept.clear()
