"""Host tensors for copies to and from a GPU: exactly their size, registered with CUDA.

[Note: not torch's pinned allocator]
``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
each request up to a power of two and keeps the block cached for reuse: the fp32 master, Adam
states and gradient partition of the host-offloaded optimizer could take up to twice the host
memory the memory check budgets (stores/rank_memory.py), and each allocation maps fresh pages
through the driver. Here each tensor is its own bytes, page-aligned on transparent huge pages
(nvmeio.huge_page_tensor), registered with CUDA once (``cudaHostRegister``). The owner's
:meth:`PinnedHost.close` unregisters them, or its finalizer when it dies: while the memory
still lives (a view kept past that only loses the registration, never its bytes).
"""
from __future__ import annotations

import warnings
import weakref
from typing import List, Optional

import torch

from nvmeio import CudaBackend, huge_page_tensor


def _unregister(backend, ptrs: List[int]) -> None:
    while ptrs:
        try:
            backend.unpin_host(ptrs.pop())
        except Exception:  # noqa: BLE001 - at exit the CUDA runtime may be gone already
            pass


class PinnedHost:
    """The registered host tensors of one store. ``backend``: CudaBackend unless a test injects
    a stand-in (``pin_host(ptr, nbytes)`` returns why not or None, ``unpin_host(ptr)``)."""

    def __init__(self, backend=None):
        self._backend = backend if backend is not None else CudaBackend()
        self._ptrs: List[int] = []
        # The memory of every registration, kept here: when this object dies its finalizer runs
        # before these go, so no registration outlives its memory whatever order the owner's
        # attributes are dropped in.
        self._kept: List[torch.Tensor] = []
        self.refused: Optional[str] = None  # why registration failed, once (the tensors still work)
        self._finalizer = weakref.finalize(self, _unregister, self._backend, self._ptrs)

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        t = huge_page_tensor(nbytes)
        if self.refused is None:
            why = self._backend.pin_host(t.data_ptr(), nbytes)
            if why is None:
                self._ptrs.append(t.data_ptr())
                self._kept.append(t)
            else:
                self.refused = why
                warnings.warn(f"nvmeio: host memory could not be registered with CUDA ({why}); training "
                              "goes on with slower copies to and from the GPU", RuntimeWarning, stacklevel=3)
        return t.view(dtype)

    def close(self) -> None:
        if self._ptrs and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no copy still reads or writes the memory
        self._finalizer()
        self._kept.clear()


def for_gpu_copies(pin_memory: bool) -> Optional[PinnedHost]:
    """The registered host memory of a store that ``pin_memory`` asks for, where a GPU is."""
    return PinnedHost() if pin_memory and torch.cuda.is_available() else None
