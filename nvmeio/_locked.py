"""Page-aligned, page-locked host tensors owned by a handle.

[Note: freeing a locked tensor]
``free_cpu_locked_tensor`` unlocks the pages and forgets the region, but the
memory itself lives until the last tensor viewing it is garbage collected.
DeepSpeed frees at once, so a tensor kept by mistake reads freed memory; here
it stays valid, merely unlocked.

Each region is also registered with the handle's engines (io_uring fixed
buffers), and unregistered when freed or when its memory is collected, so a
later allocation at the same address can never hit a stale registration.
"""

from __future__ import annotations

import resource
import warnings
import weakref

from . import _native
from . import env

__all__ = ["LockedTensors", "check_new_tensor_args", "huge_page_tensor"]


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def check_new_tensor_args(num_elem, example_tensor) -> None:
    """The (num_elem, example_tensor) arguments of DeepSpeed's tensor factories."""
    import torch

    if not isinstance(example_tensor, torch.Tensor):
        raise TypeError("example_tensor must be a torch.Tensor (its dtype is used), "
                        f"got {type(example_tensor).__name__}")
    if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
        raise ValueError(f"num_elem must be a non-negative int, got {num_elem!r}")
    if num_elem * example_tensor.element_size() > (1 << 63) - 1:
        raise ValueError(f"num_elem {num_elem} is out of range: {num_elem} x "
                         f"{example_tensor.element_size()} bytes does not fit in a 64-bit size")


def huge_page_tensor(nbytes: int):
    """``nbytes`` of page-aligned host memory for I/O buffers that are not locked (pin_memory
    off): from 2 MiB up placed on a 2 MiB boundary with transparent huge pages asked for
    (native/locked.cpp, [Note: huge pages for I/O buffers]). torch.empty's 4 KiB pages make
    the disk split each direct request: here reads ran at 1.3-1.6 GiB/s from them, 2.5-2.8
    from these."""
    import torch

    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    region = _native.LockedBuffer(nbytes, False)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps ``region`` alive


class LockedTensors:
    """The locked regions of one handle, by data pointer."""

    def __init__(self, native_handle) -> None:
        self._native = weakref.ref(native_handle)
        self._regions: dict[int, _native.LockedBuffer] = {}
        self._unregister: dict[int, weakref.finalize] = {}
        self._warned = False

    def new(self, num_elem: int, example_tensor):
        import torch

        check_new_tensor_args(num_elem, example_tensor)
        dtype = example_tensor.dtype
        nbytes = num_elem * example_tensor.element_size()
        region = _native.LockedBuffer(nbytes, env.get("NVMEIO_MLOCK"))
        if not region.locked and not self._warned:
            self._warned = True
            why = region.lock_error or "disabled by NVMEIO_MLOCK=0"
            warnings.warn(
                f"nvmeio: could not lock {nbytes} bytes of host memory ({why}; memlock limit "
                f"{_memlock_limit()}); the tensor is page-aligned but not pinned. "
                "Raise the limit with `ulimit -l unlimited` (or memlock in "
                "/etc/security/limits.conf) for full speed.", RuntimeWarning, stacklevel=3)
        if num_elem == 0:
            t = torch.empty(0, dtype=dtype)
        else:
            # frombuffer keeps `region` alive for as long as the tensor lives.
            t = torch.frombuffer(region, dtype=dtype, count=num_elem)
            self._regions[t.data_ptr()] = region
            self._native().add_region(region.ptr, region.nbytes)
            self._unregister[t.data_ptr()] = weakref.finalize(
                region, _remove_region, self._native, region.ptr)
        return t

    def free(self, t) -> bool:
        """True when ``t`` was a region of this handle and is now unlocked; False for any
        other tensor, or one freed already (DeepSpeed's answers). An empty tensor holds no
        memory: freeing it always succeeds."""
        if t.numel() == 0:
            return True
        region = self._regions.pop(t.data_ptr(), None)
        if region is None:
            return False
        self._unregister.pop(t.data_ptr())()
        region.unlock()
        return True

    def contains(self, t) -> bool:
        """True when ``t`` lies inside a region of this handle that is locked."""
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        for base, region in self._regions.items():
            if region.locked and base <= start and end <= base + region.nbytes:
                return True
        return False


def _remove_region(native_ref, ptr: int) -> None:
    native = native_ref()
    if native is not None:
        native.remove_region(ptr)
