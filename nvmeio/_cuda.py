"""The CUDA side of nvmeio: is CUDA usable here, stream fences, copies on a private stream.

Imported without torch; torch is imported by the functions that need it.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["cuda_unavailable_reason", "stream_fence", "CudaBackend"]


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

        torch.cuda.cudart().cudaHostUnregister(ptr)


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
