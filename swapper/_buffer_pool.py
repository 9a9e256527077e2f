"""The pinned buffer pool: the only staging memory of the swapper layer.

[Note: one allocation, handed out whole, never grown]
The pool makes one page-aligned allocation of ``buffer_count`` buffers at
construction (locked through ``aio_handle.new_cpu_locked_tensor`` when
``pin_memory``; on transparent huge pages either way, nvmeio._locked.huge_page_tensor)
and never allocates again: asking for more buffers than exist
is an error right away, asking for more than are free either errors at once
(``timeout=0``, the default, right for single-threaded callers, where nobody
else could free one) or waits for another thread to release some. Each buffer
starts on a 4096-byte boundary, so a buffer's start is aligned for O_DIRECT in
any dtype; tensors of other dtypes are laid into buffers through byte views.

A swapper reaches its pool through :class:`StagingPool`, which this pool and
the packed one (_span_pool.py) both are: a request is a size in bytes, and
each pool answers it its way (a whole buffer here, a span of that size there).
"""
from __future__ import annotations

import abc
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch


from ._errors import BufferTooSmallError, InsufficientHostMemoryError, PoolExhaustedError, SwapStateError
from .host_memory import HostMemory, align_up, format_bytes


def as_count(value, name: str) -> int:
    """``value`` as a positive int; accepts integral floats such as ``1e8`` (DeepSpeed configs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 tensor (no copy)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


@dataclass(eq=False)
class PoolBuffer:
    """One buffer of the pool. ``tensor`` is the whole buffer in the pool's dtype.

    Valid until it is released; the memory is reused by whoever acquires it next.
    ``spare``: it lies in its pool's spare region (only a :class:`~swapper.SpanPool`
    has one, _span_pool.py).
    """

    index: int
    tensor: torch.Tensor
    holder: Optional[str] = field(default=None, repr=True)
    spare: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def name(self) -> str:
        return f"buffer {self.index}"

    def bytes(self) -> torch.Tensor:
        return byte_view(self.tensor)

    def view(self, numel: int, dtype: torch.dtype, byte_offset: int = 0) -> torch.Tensor:
        """``numel`` elements of ``dtype`` starting ``byte_offset`` bytes into the buffer."""
        itemsize = dtype.itemsize  # asked on every fetch: no tensor made to learn it
        end = byte_offset + numel * itemsize
        if byte_offset % itemsize or end > self.nbytes:
            raise BufferTooSmallError(
                f"{numel} elements of {dtype} at byte {byte_offset} do not fit {self.name} "
                f"of {self.nbytes} bytes"
            )
        return self.bytes()[byte_offset:end].view(dtype)


def _free_locked(handle, storage: torch.Tensor, close_handle: bool) -> None:
    try:
        handle.free_cpu_locked_tensor(storage)
    finally:
        if close_handle:
            handle.close()


def allocate_staging(owner, nbytes: int, what: str, pin_memory: bool, handle=None):
    """``nbytes`` of page-aligned host memory for ``owner`` (a pool) as a uint8 tensor, refused
    up front when the machine cannot give it (host_memory.py): locked through ``handle`` (one
    made here when None) when ``pin_memory``, else on transparent huge pages. Returns
    ``(storage, finalizer, handle)``; the finalizer (None when not pinned) unlocks the memory,
    at the latest when ``owner`` dies."""
    refusal = HostMemory.probe().refusal(nbytes, what, pin_memory)
    if refusal is not None:
        raise InsufficientHostMemoryError(refusal)
    if not pin_memory:
        from nvmeio import huge_page_tensor

        return huge_page_tensor(nbytes), None, handle  # not locked, but on huge pages: whole requests
    own_handle = handle is None
    if own_handle:
        import nvmeio

        handle = nvmeio.aio_handle()
    example = torch.empty(0, dtype=torch.uint8)
    try:
        storage = handle.new_cpu_locked_tensor(nbytes, example)
    except BaseException:
        if own_handle:
            handle.close()
        raise
    # Unlocks the pages (the memory itself lives as long as any view of it, nvmeio._locked),
    # and ends the threads of a handle made here only to lock them.
    return storage, weakref.finalize(owner, _free_locked, handle, storage, own_handle), handle


class StagingPool(abc.ABC):
    """What a swapper asks of its pool, whichever pool it is: memory for requests of given
    sizes in bytes, all or none, now (the swappers are single-threaded: nobody else would
    free any), what fits now, and giving it back. ``spare``: a request that must not fail for
    want of read-ahead's memory may use the pool's spare region, where it has one."""

    nbytes: int  # the pool's whole allocation

    @property
    @abc.abstractmethod
    def main_bytes(self) -> int:
        """Bytes outside the spare region: all that read-ahead and loans may hold at once."""

    @abc.abstractmethod
    def take(self, sizes: Sequence[int], *, holder: str = "", spare: bool = True) -> List[PoolBuffer]:
        """A buffer of at least ``sizes[i]`` bytes for each i, all or none;
        :class:`PoolExhaustedError` when they do not fit now."""

    @abc.abstractmethod
    def fits(self, sizes: Sequence[int], *, spare: bool = False) -> int:
        """How many of ``sizes``, from the first, :meth:`take` would serve now (taking nothing)."""

    @abc.abstractmethod
    def release(self, buffers: Iterable[PoolBuffer]) -> None:
        """Give buffers back. Releasing one that is not out is an error."""

    def register_with_cuda(self, backend=None) -> Optional[str]:
        """Registers the pool's memory with CUDA, once for the whole allocation
        (nvmeio.RegisteredHost), so that copies between it and a GPU are DMA that overlap other
        work. Returns why it could not, or None. Unregistered at close, before the memory goes."""
        if getattr(self, "_cuda", None) is None:
            from nvmeio import RegisteredHost

            self._cuda = RegisteredHost(backend)
            self._cuda.register(self._storage)
        return self._cuda.refused

    def _unregister_cuda(self) -> None:
        if getattr(self, "_cuda", None) is not None:
            self._cuda.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Free the memory; every buffer must be back."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        ...


class PinnedBufferPool(StagingPool):
    """``buffer_count`` aligned buffers of ``buffer_size`` elements of ``dtype``.

    Memory: ``buffer_count × align_up(buffer_size × itemsize, 4096)`` bytes, locked
    when ``pin_memory`` (page-locked, so the kernel can DMA into it and never swaps
    it out), from the moment of construction until :meth:`close`.
    """

    def __init__(
        self,
        buffer_count: int,
        buffer_size: int,
        dtype: torch.dtype = torch.float32,
        *,
        pin_memory: bool = True,
        handle=None,
    ):
        self.buffer_count = as_count(buffer_count, "buffer_count")
        self.buffer_size = as_count(buffer_size, "buffer_size")
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.itemsize = dtype.itemsize
        self.buffer_nbytes = self.buffer_size * self.itemsize
        self._stride_bytes = align_up(self.buffer_nbytes)
        self.nbytes = self.buffer_count * self._stride_bytes
        what = (
            f"PinnedBufferPool(buffer_count={self.buffer_count}, buffer_size={self.buffer_size}, "
            f"dtype={dtype})"
        )
        self._storage, self._finalizer, self._handle = allocate_staging(self, self.nbytes, what, pin_memory, handle)
        self._buffers = [
            PoolBuffer(
                index=i,
                tensor=self._storage[i * self._stride_bytes : i * self._stride_bytes + self.buffer_nbytes].view(dtype),
            )
            for i in range(self.buffer_count)
        ]
        self._free: List[PoolBuffer] = list(reversed(self._buffers))
        self._cond = threading.Condition()
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"PinnedBufferPool(buffer_count={self.buffer_count}, buffer_size={self.buffer_size}, "
            f"dtype={self.dtype}, free={self.free_count}, {format_bytes(self.nbytes)}"
            f"{', pinned' if self.pin_memory else ''})"
        )

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def main_bytes(self) -> int:
        return self.nbytes  # no spare region

    def take(self, sizes: Sequence[int], *, holder: str = "", spare: bool = True) -> List[PoolBuffer]:
        """One whole buffer per request (:class:`StagingPool`); a request larger than a buffer's
        stride is refused (the caller sized the pool)."""
        if any(n > self._stride_bytes for n in sizes):
            raise BufferTooSmallError(
                f"{holder or 'caller'} asks for {max(sizes)} bytes in one buffer, but a buffer of the pool "
                f"holds {self.buffer_nbytes}")
        return self.acquire(len(sizes), holder=holder)

    def fits(self, sizes: Sequence[int], *, spare: bool = False) -> int:
        with self._cond:
            self._check_open()
            fit = 0
            while fit < min(len(sizes), len(self._free)) and sizes[fit] <= self._stride_bytes:
                fit += 1
            return fit

    def acquire(self, count: int = 1, *, holder: str = "", timeout: Optional[float] = 0.0) -> List[PoolBuffer]:
        """Take ``count`` buffers, all or none.

        ``timeout=0`` raises :class:`PoolExhaustedError` at once when fewer are free;
        a positive timeout waits that many seconds for other threads to release
        buffers; ``None`` waits without limit. Asking for more buffers than the pool
        has raises at once whatever the timeout.
        """
        if count > self.buffer_count:
            raise PoolExhaustedError(
                f"{holder or 'caller'} asks for {count} buffers at once, but the pool has only "
                f"{self.buffer_count} (buffer_count={self.buffer_count}); raise buffer_count to at "
                f"least {count}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open()
            while len(self._free) < count:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    held = [b.holder or "?" for b in self._buffers if b not in self._free]
                    raise PoolExhaustedError(
                        f"{holder or 'caller'} asks for {count} buffers but only {len(self._free)} of "
                        f"{self.buffer_count} are free"
                        + (f" after waiting {timeout:g} s" if timeout else "")
                        + f"; held by: {', '.join(held)}. Release buffers first or raise buffer_count"
                    )
                self._cond.wait(remaining)
                self._check_open()
            taken = [self._free.pop() for _ in range(count)]
            for b in taken:
                b.holder = holder or "caller"
            return taken

    def release(self, buffers: Iterable[PoolBuffer]) -> None:
        """Give buffers back. Releasing one that is not out is an error."""
        with self._cond:
            for b in buffers:
                if self._buffers[b.index] is not b or b in self._free:
                    raise SwapStateError(f"buffer {b.index} released twice or not from this pool")
                b.holder = None
                self._free.append(b)
            self._cond.notify_all()

    def close(self) -> None:
        """Free the memory. Every buffer must be back: their tensors die with the pool."""
        with self._cond:
            if self._closed:
                return
            if len(self._free) != self.buffer_count:
                held = [b.holder or "?" for b in self._buffers if b not in self._free]
                raise SwapStateError(f"cannot close the pool while buffers are held by: {', '.join(held)}")
            self._closed = True
            self._buffers = []
            self._free = []
            self._cond.notify_all()
        self._unregister_cuda()
        self._storage = None
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SwapStateError("the buffer pool is closed")

    def __enter__(self) -> "PinnedBufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
