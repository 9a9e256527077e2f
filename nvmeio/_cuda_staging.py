"""CUDA tensors through aio_handle: a pipelined copy engine over locked host chunks.

The native core never sees device memory. A CUDA tensor's bytes travel
through ``num_chunks`` page-aligned host chunks of ``chunk_bytes`` each,
pinned for DMA with ``cudaHostRegister``; the copies run on one dedicated
CUDA stream per device, and one CUDA event per chunk says when a chunk's copy
is done. The tensor is never copied whole to host memory.

[Note: the staging pipeline]
An op is cut into chunks by :func:`plan_chunks`: every chunk but the first
starts at a file offset that is a multiple of 4096, so each chunk's middle
goes O_DIRECT; the first chunk sits in its host chunk at ``file_offset %
4096`` so that memory and file alignment agree there as well.

- write (device -> file): the device-to-host copies of the first
  ``num_chunks`` chunks are queued on the stream at once. Then, for chunk i:
  wait for its copy's event, write it to the file through the native handle,
  and queue the copy of chunk i + num_chunks into the host chunk just freed.
  While chunk i goes to the file, the copies of the next chunks run on the
  GPU's copy engine.
- read (file -> device): for chunk i: wait until the host-to-device copy of
  chunk i - num_chunks (the last user of this host chunk) is done, read
  chunk i from the file, queue its copy to the device. While chunk i + 1 is
  read from the file, the copy of chunk i runs on the GPU.

File I/O is one chunk at a time (each chunk is itself split over the
handle's ``intra_op_parallelism`` workers); device copies run ahead of it
(write) or behind it (read) by up to ``num_chunks - 1`` chunks. PCIe copies
are usually several times faster than an NVMe drive, so a transfer should
run near the speed of the same transfer from locked host memory (not yet
measured on a GPU).

[Note: async ops on CUDA tensors and data races]
``async_pread``/``async_pwrite`` of a CUDA tensor check the file when they
are called, as the native core does (a missing file, a directory, a short
file raise at once and the op is not counted; a write creates a new file
0600), then queue the pipeline on the handle's background thread; ops on CUDA tensors run one at a time in submission order, and
``wait()`` waits for them, counts each as one op and raises the first error.
At submission an event is recorded on the tensor device's *current stream*,
and the copy stream waits for it: kernels queued there before the call
(typically the ones that produced the tensor) finish before any byte is
copied, without blocking the caller. Work on other streams is not ordered:
synchronize it first. Until ``wait()`` returns, do not modify the source of
a write nor use the target of a read, on any stream; after it returns the
bytes are complete on the device for every stream.

Tuning (read once per handle): ``NVMEIO_STAGING_CHUNK_BYTES`` (default
32 MiB, at least ``block_size * intra_op_parallelism``; rounded up to 4096)
and ``NVMEIO_STAGING_CHUNKS`` (default 3, at least 2). A handle allocates
its chunks on its first CUDA op and keeps them until it is collected.
Events are created with ``blocking=True``: the background thread sleeps
while it waits for a copy instead of spinning on a core the I/O needs.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import _native
from ._cuda import CudaBackend
from ._device_ops import DeviceOpQueue
from . import env
from ._file_checks import compare_with_file, prepare_target

__all__ = ["Chunk", "plan_chunks", "StagingConfig", "StagingEngine", "run_write", "run_read"]

FILE_ALIGN = 4096  # chunk boundaries in the file; the O_DIRECT alignment nvmeio uses
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_NUM_CHUNKS = env.default("NVMEIO_STAGING_CHUNKS")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# -- planning (pure, testable without a GPU) ------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    """One piece of an op: ``nbytes`` at ``buffer_offset`` of the tensor and at
    ``file_offset`` of the file, staged at ``host_offset`` of a host chunk."""

    index: int
    buffer_offset: int
    file_offset: int
    nbytes: int
    host_offset: int


def plan_chunks(nbytes: int, file_offset: int, chunk_bytes: int) -> list[Chunk]:
    """Cuts ``nbytes`` at ``file_offset`` into chunks of at most ``chunk_bytes``.

    Every chunk after the first starts at a multiple of 4096 in the file; the
    first ends at the first such boundary that keeps it within
    ``chunk_bytes - file_offset % 4096`` bytes, and is staged at host offset
    ``file_offset % 4096``, so ``host_offset + nbytes <= chunk_bytes`` always.
    An empty op has no chunks.
    """
    if chunk_bytes <= 0 or chunk_bytes % FILE_ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {FILE_ALIGN}, "
                         f"got {chunk_bytes}")
    if nbytes < 0 or file_offset < 0:
        raise ValueError(f"nbytes and file_offset must be >= 0, got {nbytes}, {file_offset}")
    chunks: list[Chunk] = []
    done = 0
    while done < nbytes:
        pos = file_offset + done
        host_offset = pos % FILE_ALIGN
        size = min(nbytes - done, chunk_bytes - host_offset)
        chunks.append(Chunk(len(chunks), done, pos, size, host_offset))
        done += size
    return chunks


@dataclass(frozen=True)
class StagingConfig:
    """Host staging of one handle: ``num_chunks`` chunks of ``chunk_bytes``."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_chunks: int = DEFAULT_NUM_CHUNKS

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % FILE_ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {FILE_ALIGN}, "
                             f"got {self.chunk_bytes}")
        if self.num_chunks < 2:
            raise ValueError(f"num_chunks must be at least 2 to overlap, got {self.num_chunks}")

    @classmethod
    def from_env(cls, block_size: int, intra_op_parallelism: int) -> "StagingConfig":
        """The handle's staging: the environment's values, else the defaults,
        with a chunk big enough to give every worker thread a full block."""
        default = max(DEFAULT_CHUNK_BYTES, _round_up(block_size, FILE_ALIGN) * intra_op_parallelism)
        chunk = env.get("NVMEIO_STAGING_CHUNK_BYTES")
        return cls(_round_up(default if chunk is None else chunk, FILE_ALIGN), env.get("NVMEIO_STAGING_CHUNKS"))


# -- the pipeline (device side injected: CUDA in use, a CPU stand-in in tests) ---------------------

def run_write(chunks: list[Chunk], src, slots: list, copier, file_write: Callable) -> None:
    """Device -> file. ``slots``: host chunk tensors (uint8); ``copier.to_host``
    queues a copy and returns a token for ``copier.wait``; ``file_write(slot,
    chunk)`` writes ``slot[chunk.host_offset:][:chunk.nbytes]`` at the chunk's
    file offset and returns when it is on the file. See [Note: the staging
    pipeline]."""
    k = len(slots)
    tokens: list[Any] = [None] * k

    def issue(i: int) -> None:
        c = chunks[i]
        tokens[i % k] = copier.to_host(
            src[c.buffer_offset:c.buffer_offset + c.nbytes],
            slots[i % k][c.host_offset:c.host_offset + c.nbytes])

    try:
        for i in range(min(k, len(chunks))):
            issue(i)
        for i, c in enumerate(chunks):
            slot = i % k
            copier.wait(tokens[slot])
            tokens[slot] = None
            file_write(slots[slot], c)
            if i + k < len(chunks):
                issue(i + k)  # the host chunk just written is free again
    finally:
        _settle(copier, tokens)


def run_read(chunks: list[Chunk], dst, slots: list, copier, file_read: Callable) -> None:
    """File -> device, the mirror of :func:`run_write`: ``file_read(slot,
    chunk)`` fills the slot, ``copier.to_device`` queues the copy out of it."""
    k = len(slots)
    tokens: list[Any] = [None] * k
    try:
        for i, c in enumerate(chunks):
            slot = i % k
            if tokens[slot] is not None:
                # The copy of chunk i - k still reads this host chunk.
                copier.wait(tokens[slot])
                tokens[slot] = None
            file_read(slots[slot], c)
            tokens[slot] = copier.to_device(
                slots[slot][c.host_offset:c.host_offset + c.nbytes],
                dst[c.buffer_offset:c.buffer_offset + c.nbytes])
        for slot in range(k):
            if tokens[slot] is not None:
                copier.wait(tokens[slot])
                tokens[slot] = None
    finally:
        _settle(copier, tokens)


def _settle(copier, tokens: list) -> None:
    """After a failure: no copy may still be running into or out of a host
    chunk that the next op reuses. Errors here would hide the first one."""
    for i, token in enumerate(tokens):
        if token is not None:
            tokens[i] = None
            try:
                copier.wait(token)
            except Exception:  # noqa: BLE001 - the op's own error is the one raised
                pass


class _HostChunks:
    """``count`` page-aligned host chunks, pinned by the backend while alive."""

    def __init__(self, backend: Any, count: int, nbytes: int) -> None:
        import torch

        self.regions = [_native.LockedBuffer(nbytes, False) for _ in range(count)]
        self.tensors = [torch.frombuffer(r, dtype=torch.uint8, count=nbytes) for r in self.regions]
        pinned = []
        for region in self.regions:
            why = backend.pin_host(region.ptr, region.nbytes)
            if why is not None:
                warnings.warn(f"nvmeio: could not pin {nbytes} bytes of staging memory for CUDA "
                              f"({why}); CUDA tensors still work, but their copies do not overlap "
                              "the file I/O", RuntimeWarning, stacklevel=2)
                break
            pinned.append(region.ptr)
        # Unpinned before the regions are freed (the finalizer keeps them alive).
        weakref.finalize(self, _unpin_all, backend, pinned, self.regions)


def _unpin_all(backend: Any, ptrs: list, regions: list) -> None:
    for ptr in ptrs:
        try:
            backend.unpin_host(ptr)
        except Exception:  # noqa: BLE001 - at exit the CUDA runtime may be gone already
            pass


class StagingEngine:
    """aio_handle's device ops: the staging pipeline on a background thread.

    Args:
        native: a private ``_native.Handle`` (its ``wait()`` must see only the
            engine's own chunks), with the settings of the aio_handle.
        config: chunk size and count.
        backend: the device side; :class:`CudaBackend` unless a test injects
            a stand-in with the same methods.
    """

    def __init__(self, native: Any, config: StagingConfig, backend: Any = None) -> None:
        self._native = native
        self._config = config
        self._backend = backend if backend is not None else CudaBackend()
        self._lock = threading.Lock()
        self._copiers: dict = {}
        self._chunks: Optional[_HostChunks] = None  # used by the queue thread only
        self._ops = DeviceOpQueue()
        weakref.finalize(self, self._ops.close)

    @property
    def config(self) -> StagingConfig:
        return self._config

    def refused_direct(self) -> bool:
        return bool(self._native.refused_direct())

    def close(self) -> None:
        """Lets queued ops finish, then frees the thread and the native handle."""
        self._ops.close()
        close = getattr(self._native, "close", None)
        if close is not None:
            close()

    def drain(self) -> "tuple[int, BaseException | None]":
        return self._ops.drain()

    def pending(self) -> int:
        return self._ops.pending()

    def _copier(self, device: Any) -> Any:
        key = (device.type, device.index)
        with self._lock:
            copier = self._copiers.get(key)
            if copier is None:
                copier = self._copiers[key] = self._backend.copier(device)
            return copier

    def submit(self, write: bool, buf: Any, target: "str | int", file_offset: int,
               validate: bool = False) -> None:
        """Queues one op of ``buf`` (a buffers.DeviceBuffer) at ``file_offset``
        of ``target`` (a path or an open fd); checks the file first."""
        undo = prepare_target(write, target, file_offset, buf.nbytes)
        try:
            copier = self._copier(buf.device)
            fence = copier.fence()
            chunks = plan_chunks(buf.nbytes, file_offset, self._config.chunk_bytes)
            self._ops.submit(lambda: self._run(write, buf, target, file_offset, chunks, copier,
                                               fence, validate, undo))
        except BaseException:
            undo()
            raise

    def _file_op(self, write: bool, target: "str | int") -> Callable:
        native = self._native

        def op(slot, c: Chunk) -> None:
            ptr = slot.data_ptr() + c.host_offset
            if isinstance(target, int):
                native.submit_fd(write, ptr, c.nbytes, target, c.file_offset)
            else:
                native.submit(write, ptr, c.nbytes, os.fsencode(target), c.file_offset)
            native.wait()

        return op

    def _run(self, write: bool, buf: Any, target: "str | int", file_offset: int, chunks: list,
             copier: Any, fence: Any, validate: bool, undo: Callable[[], None]) -> None:
        try:
            if self._chunks is None:
                self._chunks = _HostChunks(self._backend, self._config.num_chunks,
                                           self._config.chunk_bytes)
            slots = self._chunks.tensors
            copier.start(fence)
            if not chunks:
                # No bytes to copy; the native core still gives an empty op its
                # meaning (an empty write extends the file to file_offset).
                self._file_op(write, target)(slots[0], Chunk(0, 0, file_offset, 0, 0))
            elif write:
                run_write(chunks, buf.tensor, slots, copier, self._file_op(True, target))
            else:
                run_read(chunks, buf.tensor, slots, copier, self._file_op(False, target))
        except BaseException:
            undo()
            raise
        if validate:  # a difference is reported; the file stays, as on the CPU path
            region = self._chunks.regions[0]

            def fetch(at: int, n: int):
                copier.wait(copier.to_host(buf.tensor[at:at + n], slots[0][:n]))
                return memoryview(region)[:n]

            compare_with_file(target, file_offset, buf.nbytes, fetch, self._config.chunk_bytes)
