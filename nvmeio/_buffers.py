"""What may be read into or written from: checked before any I/O starts.

The native core takes a raw ``(pointer, nbytes)``; this module is where a
torch tensor, numpy array or buffer-protocol object becomes one, and where
wrong input is refused with a message that names the problem. A CUDA tensor
becomes a :class:`DeviceBuffer` instead, which the native core never sees: a
handle moves it through ``cuda_staging`` (or cuFile, for ``gds_handle``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from . import _native
from ._cuda import cuda_unavailable_reason

__all__ = ["IoBuffer", "DeviceBuffer", "as_io_buffer", "mark_read_into"]


@dataclass(frozen=True)
class IoBuffer:
    ptr: int
    nbytes: int
    # Kept referenced until the op completes, so memory cannot be freed under
    # the I/O even if the caller drops its own reference.
    keepalive: Any


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous CUDA tensor, as bytes: ``tensor`` is a flat uint8 view of it."""

    tensor: Any
    nbytes: int
    device: Any
    # The caller's tensor, kept referenced until the op completes.
    keepalive: Any


def _from_tensor(torch, t, writable: bool) -> "IoBuffer | DeviceBuffer":
    if t.layout != torch.strided:
        raise TypeError(f"nvmeio needs a dense (strided) tensor, got layout {t.layout}")
    if writable:
        _check_autograd_target(torch, t)
    t = _resolve_lazy_views(t, writable)
    if t.device.type != "cpu":
        if t.device.type == "cuda":
            return _from_cuda_tensor(torch, t)
        raise ValueError(f"tensor is on device '{t.device}'; nvmeio reads and writes CPU tensors")
    _check_contiguous(t)
    return IoBuffer(t.data_ptr(), t.numel() * t.element_size(), t)


def _resolve_lazy_views(t, writable: bool):
    """[Note: conjugate and negative views]
    ``x.conj()`` and some ``torch.neg`` results share ``x``'s memory and only
    carry a bit saying "conjugate (negate) on access". The raw bytes are not
    the values, so writing them would silently store ``x``. A write
    materialises the values (a copy, kept alive until the op completes); a
    read into such a view is refused, since its memory would then hold the
    conjugate of what the file holds."""
    lazy = [what for what, flag in (("conjugate", t.is_conj()), ("negative", t.is_neg())) if flag]
    if not lazy:
        return t
    kind = " and ".join(lazy)
    if writable:
        raise ValueError(f"tensor is a {kind} view (its memory holds other values than it shows), "
                         "so it cannot be the target of a read: read into a plain tensor, or call "
                         ".resolve_conj() / .resolve_neg() first")
    return t.resolve_conj().resolve_neg()


def _check_autograd_target(torch, t) -> None:
    """[Note: reads into tensors autograd knows]
    A read changes a tensor in place behind autograd's back, so it is held to
    what torch holds its own in-place ops (``t.copy_(src)``) to:

    - While grad mode is on, a tensor that requires grad is refused before any
      I/O. torch refuses a leaf that requires grad and a view of one; it lets
      ``copy_`` into another tensor that requires grad rewrite its history, which
      a read cannot do (the tensor would keep a grad_fn for values it no longer
      holds: a wrong gradient, silently). Under ``torch.no_grad()`` (loading
      weights into parameters) these are read into, as ``copy_`` writes them.
    - Every tensor read into gets its version counter bumped, as every in-place
      op does, so a backward that needs what the tensor held before (it was
      saved for backward) raises torch's "modified by an inplace operation"
      instead of using the new bytes. See :func:`mark_read_into` for when.
    """
    if not (t.requires_grad and torch.is_grad_enabled()):
        return
    base = t._base if t._is_view() else None
    if t.is_leaf or (base is not None and base.is_leaf and base.requires_grad):
        what = "a leaf tensor that requires grad" if t.is_leaf else \
            "a view of a leaf tensor that requires grad"
        raise ValueError(
            f"buffer is {what}, so it cannot be the target of a read (torch refuses in-place "
            "ops on it too: its gradient would be wrong): read under torch.no_grad(), or into "
            "a tensor that does not require grad")
    raise ValueError(
        "buffer requires grad (it was computed from tensors that do), so it cannot be the "
        "target of a read: autograd cannot record a read, and backward would differentiate "
        "the values the tensor held before it. Read into a tensor that does not require "
        "grad (t.detach() shares its memory), or under torch.no_grad()")


def mark_read_into(io: IoBuffer | DeviceBuffer) -> None:
    """Tells autograd that a read is changing the tensor behind ``io`` (see [Note: reads
    into tensors autograd knows]): bumps its version counter, as an in-place op does.

    Called once the read is submitted, not when ``wait()`` sees it land: from
    submission on the bytes are the handle's, and a backward that runs before
    ``wait()`` would otherwise use half-read bytes without a word. A tensor saved
    for backward after submission is a data race already (documented in
    nvmeio.handle). A read that fails still changed the tensor (in part), so
    the bump stands."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(io.keepalive, torch.Tensor):
        # No-op for an inference tensor (it has no version counter).
        torch.autograd.graph.increment_version(io.keepalive)


def _check_contiguous(t) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"tensor is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}); "
            "call .contiguous() first")


def _from_cuda_tensor(torch, t) -> DeviceBuffer:
    reason = cuda_unavailable_reason(torch)
    if reason is not None:
        raise ValueError(
            f"tensor is on {t.device}, but CUDA is not available: {reason}. nvmeio stages CUDA "
            "tensors through locked host memory with CUDA copies; without CUDA, read and "
            "write CPU tensors")
    _check_contiguous(t)
    try:
        # An empty tensor may have any strides; a view needs the last to be 1.
        flat = (t.detach().reshape(-1).view(torch.uint8) if t.numel()
                else t.detach().new_empty((0,), dtype=torch.uint8))
    except RuntimeError as e:
        raise TypeError(f"a CUDA tensor of dtype {t.dtype} cannot be viewed as bytes: {e}") from None
    return DeviceBuffer(flat, t.numel() * t.element_size(), t.device, t)


def _from_numpy(a, writable: bool) -> IoBuffer:
    if not a.flags.c_contiguous:
        raise ValueError(f"numpy array is not C-contiguous (shape {a.shape}, strides {a.strides}); "
                         "use numpy.ascontiguousarray first")
    if writable and not a.flags.writeable:
        raise TypeError("numpy array is read-only and cannot be the target of a read")
    return IoBuffer(a.__array_interface__["data"][0], a.nbytes, a)


def as_io_buffer(buf: Any, *, writable: bool) -> "IoBuffer | DeviceBuffer":
    """Validates ``buf`` and returns its address and size.

    ``writable``: the buffer is the target of a read. Raises TypeError for an
    unsupported or read-only object, ValueError for a non-contiguous buffer or
    one on a device nvmeio cannot address (a CUDA tensor where CUDA is not
    available says what is missing). A CUDA tensor gives a DeviceBuffer.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return _from_tensor(torch, buf, writable)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(buf, np.ndarray):
        return _from_numpy(buf, writable)
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError("expected a torch.Tensor, a numpy array or a buffer-protocol object, "
                        f"got {type(buf).__name__}") from None
    if writable and view.readonly:
        raise TypeError(f"{type(buf).__name__} is read-only and cannot be the target of a read")
    if not view.c_contiguous:
        raise ValueError(f"{type(buf).__name__} buffer is not C-contiguous")
    ptr, nbytes = _native.buffer_address(view, writable)
    return IoBuffer(ptr, nbytes, view)
