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

File ops go through ``lanes`` private native handles (default 2) used in
turn: chunk i + 1's file op is submitted before chunk i's is waited for, so
(with two lanes or more) the disk always has a chunk's requests queued. A native handle only has
wait-all, so with one handle the queue would drain at every chunk boundary
(16 times per GiB with 64 MiB chunks) while the host path submits a whole
op at once. A lane holds one file op at a time; ops are waited for in chunk
order, so the first error raised is the earliest chunk's.

- write (device -> file): the device-to-host copies of the first
  ``num_chunks`` chunks are queued on the stream at once. Then, for chunk i:
  wait for the file op of chunk i - lanes (this lane's last op), queue the
  copy of chunk i - lanes + num_chunks into the host chunk that op freed,
  wait for chunk i's copy, submit chunk i's file op. While chunks go to the
  file, the copies of the next chunks run on the GPU's copy engine.
- read (file -> device): for chunk i: wait for the file op of chunk
  i - lanes and queue its copy to the device; wait until the copy of chunk
  i - num_chunks (the last user of this host chunk) is done; submit chunk
  i's file op. While chunks are read from the file, the copies of earlier
  ones run on the GPU.

A host chunk is reused only after both its file op and its copy are done
(``num_chunks >= lanes`` makes the first hold by the time it is needed).
After a failure, the file ops still in flight and the copies still queued
are waited for before the op returns, so nothing runs into a host chunk
that the next op reuses. Each chunk is itself split over the handle's
``intra_op_parallelism`` workers. PCIe copies are usually several times
faster than an NVMe drive, so a transfer runs near the speed of the same
transfer from locked host memory (bench/gpu_check.py measures both: on an H200,
reads 0.96x and writes 0.90x of it with two lanes; 0.87x reads with one).

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
, ``NVMEIO_STAGING_CHUNKS`` (default 3, at least 2) and
``NVMEIO_STAGING_LANES`` (default 2, at most the chunks). A handle allocates
its chunks and its lanes' native handles (their worker threads and, on aio
or io_uring, their kernel contexts) on its first CUDA op and keeps them
until it is closed or collected.
Events are created with ``blocking=True``: the background thread sleeps
while it waits for a copy instead of spinning on a core the I/O needs.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ._cuda import CudaBackend, RegisteredHost
from ._device_ops import DeviceOpQueue
from . import env
from ._file_checks import compare_with_file, prepare_target

__all__ = ["Chunk", "plan_chunks", "StagingConfig", "StagingEngine", "run_write", "run_read"]

FILE_ALIGN = 4096  # chunk boundaries in the file; the O_DIRECT alignment nvmeio uses
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_NUM_CHUNKS = env.default("NVMEIO_STAGING_CHUNKS")
DEFAULT_LANES = env.default("NVMEIO_STAGING_LANES")


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
    """Host staging of one handle: ``num_chunks`` chunks of ``chunk_bytes``,
    their file ops on ``lanes`` native handles."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_chunks: int = DEFAULT_NUM_CHUNKS
    lanes: int = DEFAULT_LANES

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % FILE_ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {FILE_ALIGN}, "
                             f"got {self.chunk_bytes}")
        if self.num_chunks < 2:
            raise ValueError(f"num_chunks must be at least 2 to overlap, got {self.num_chunks}")
        if not 1 <= self.lanes <= self.num_chunks:
            raise ValueError(f"lanes must be between 1 and num_chunks ({self.num_chunks}): a file op "
                             f"in flight holds a host chunk; got {self.lanes}")

    @classmethod
    def from_env(cls, block_size: int, intra_op_parallelism: int) -> "StagingConfig":
        """The handle's staging: the environment's values, else the defaults,
        with a chunk big enough to give every worker thread a full block."""
        default = max(DEFAULT_CHUNK_BYTES, _round_up(block_size, FILE_ALIGN) * intra_op_parallelism)
        chunk = env.get("NVMEIO_STAGING_CHUNK_BYTES")
        chunks, lanes = env.get("NVMEIO_STAGING_CHUNKS"), env.get("NVMEIO_STAGING_LANES")
        if lanes > chunks:
            raise ValueError(f"NVMEIO_STAGING_LANES={lanes} must be at most NVMEIO_STAGING_CHUNKS "
                             f"({chunks}): a file op in flight holds a host chunk")
        return cls(_round_up(default if chunk is None else chunk, FILE_ALIGN), chunks, lanes)


# -- the pipeline (device side injected: CUDA in use, a CPU stand-in in tests) ---------------------

def run_write(chunks: list[Chunk], src, slots: list, copier, lanes: list) -> None:
    """Device -> file. ``slots``: host chunk tensors (uint8); ``copier.to_host``
    queues a copy and returns a token for ``copier.wait``; a lane's
    ``submit(slot, chunk)`` starts writing ``slot[chunk.host_offset:][:chunk.nbytes]``
    at the chunk's file offset and its ``wait()`` returns when that is on the
    file (or raises its error). Needs ``len(lanes) <= len(slots)``. See
    [Note: the staging pipeline]."""
    k, n = len(slots), len(chunks)
    tokens: list[Any] = [None] * k
    flight: collections.deque = collections.deque()  # (lane, chunk index), oldest first

    def copy_in(i: int) -> None:
        c = chunks[i]
        tokens[i % k] = copier.to_host(
            src[c.buffer_offset:c.buffer_offset + c.nbytes],
            slots[i % k][c.host_offset:c.host_offset + c.nbytes])

    def retire() -> None:  # the oldest file op is on the file: its host chunk is free again
        lane, j = flight.popleft()
        lane.wait()
        if j + k < n:
            copy_in(j + k)

    try:
        for i in range(min(k, n)):
            copy_in(i)
        for i, c in enumerate(chunks):
            if len(flight) == len(lanes):
                retire()  # chunk i - lanes, whose lane chunk i takes
            slot = i % k
            copier.wait(tokens[slot])
            tokens[slot] = None
            lane = lanes[i % len(lanes)]
            lane.submit(slots[slot], c)
            flight.append((lane, i))
        while flight:
            retire()
    finally:
        _settle(copier, tokens, flight)


def run_read(chunks: list[Chunk], dst, slots: list, copier, lanes: list) -> None:
    """File -> device, the mirror of :func:`run_write`: a lane's ``submit(slot,
    chunk)`` starts filling the slot, ``copier.to_device`` queues the copy out
    of it once that lane's ``wait()`` returned."""
    k = len(slots)
    tokens: list[Any] = [None] * k
    flight: collections.deque = collections.deque()

    def retire() -> None:  # the oldest file op filled its host chunk: copy it to the device
        lane, j = flight.popleft()
        lane.wait()
        c = chunks[j]
        tokens[j % k] = copier.to_device(
            slots[j % k][c.host_offset:c.host_offset + c.nbytes],
            dst[c.buffer_offset:c.buffer_offset + c.nbytes])

    try:
        for i, c in enumerate(chunks):
            if len(flight) == len(lanes):
                retire()
            slot = i % k
            if tokens[slot] is not None:
                # The copy of chunk i - k still reads this host chunk.
                copier.wait(tokens[slot])
                tokens[slot] = None
            lane = lanes[i % len(lanes)]
            lane.submit(slots[slot], c)
            flight.append((lane, i))
        while flight:
            retire()
        for slot in range(k):
            if tokens[slot] is not None:
                copier.wait(tokens[slot])
                tokens[slot] = None
    finally:
        _settle(copier, tokens, flight)


def _settle(copier, tokens: list, flight: collections.deque) -> None:
    """After a failure: no file op and no copy may still be running into or
    out of a host chunk that the next op reuses. Errors here would hide the
    first one."""
    while flight:
        lane, _ = flight.popleft()
        try:
            lane.wait()
        except Exception:  # noqa: BLE001 - the op's own error is the one raised
            pass
    for i, token in enumerate(tokens):
        if token is not None:
            tokens[i] = None
            try:
                copier.wait(token)
            except Exception:  # noqa: BLE001 - the op's own error is the one raised
                pass


class _FileLane:
    """Chunk file ops of one op through one native handle, one at a time
    (its ``wait()`` waits for everything it was given)."""

    def __init__(self, native: Any, write: bool, target: "str | int") -> None:
        self._native, self._write, self._target = native, write, target
        self._path = None if isinstance(target, int) else os.fsencode(target)

    def submit(self, slot, c: Chunk) -> None:
        ptr = slot.data_ptr() + c.host_offset
        if self._path is None:
            self._native.submit_fd(self._write, ptr, c.nbytes, self._target, c.file_offset)
        else:
            self._native.submit(self._write, ptr, c.nbytes, self._path, c.file_offset)

    def wait(self) -> None:
        self._native.wait()


class _HostChunks:
    """``count`` page-aligned host chunks, registered with CUDA while alive."""

    def __init__(self, backend: Any, count: int, nbytes: int) -> None:
        def refused(why: str) -> None:
            warnings.warn(f"nvmeio: could not pin {nbytes} bytes of staging memory for CUDA "
                          f"({why}); CUDA tensors still work, but their copies do not overlap "
                          "the file I/O", RuntimeWarning, stacklevel=4)

        self.host = RegisteredHost(backend, on_refused=refused)
        self.tensors = [self.host.empty(nbytes) for _ in range(count)]


class StagingEngine:
    """aio_handle's device ops: the staging pipeline on a background thread.

    Args:
        new_native: makes a private ``_native.Handle`` with the settings of
            the aio_handle; the engine makes ``config.lanes`` of them (a handle's
            ``wait()`` must see only the engine's own chunks).
        config: chunk size and count.
        backend: the device side; :class:`CudaBackend` unless a test injects
            a stand-in with the same methods.
    """

    def __init__(self, new_native: Callable[[], Any], config: StagingConfig,
                 backend: Any = None) -> None:
        self._config = config
        self._natives = [new_native() for _ in range(config.lanes)]
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
        return any(bool(native.refused_direct()) for native in self._natives)

    def close(self) -> None:
        """Lets queued ops finish, then frees the thread and the native handles."""
        self._ops.close()
        for native in self._natives:
            close = getattr(native, "close", None)
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

    def _run(self, write: bool, buf: Any, target: "str | int", file_offset: int, chunks: list,
             copier: Any, fence: Any, validate: bool, undo: Callable[[], None]) -> None:
        try:
            if self._chunks is None:
                self._chunks = _HostChunks(self._backend, self._config.num_chunks,
                                           self._config.chunk_bytes)
            slots = self._chunks.tensors
            copier.start(fence)
            lanes = [_FileLane(native, write, target) for native in self._natives]
            if not chunks:
                # No bytes to copy; the native core still runs the empty op, as
                # on the CPU path.
                lanes[0].submit(slots[0], Chunk(0, 0, file_offset, 0, 0))
                lanes[0].wait()
            elif write:
                run_write(chunks, buf.tensor, slots, copier, lanes)
            else:
                run_read(chunks, buf.tensor, slots, copier, lanes)
        except BaseException:
            undo()
            raise
        if validate:  # a difference is reported; the file stays, as on the CPU path
            def fetch(at: int, n: int):
                copier.wait(copier.to_host(buf.tensor[at:at + n], slots[0][:n]))
                return memoryview(slots[0].numpy())[:n]

            compare_with_file(target, file_offset, buf.nbytes, fetch, self._config.chunk_bytes)
