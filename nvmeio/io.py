"""DeepSpeed's FastPersist writer API (``deepspeed.io``) on nvmeio: ``torch.save`` into a
file-like object that writes at disk speed.

A script written for DeepSpeed runs with its imports changed::

    import nvmeio                                                  # was: AsyncIOBuilder().load()
    from nvmeio.io import FastFileWriter, FastFileWriterConfig     # was: from deepspeed.io import ...

    h = nvmeio.aio_handle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
    pinned = h.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
    config = FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned, double_buffer=True)
    writer = FastFileWriter(file_path="model.pt", config=config)
    torch.save(state, writer)
    writer.close()

The names, arguments and methods are DeepSpeed's (0.19): ``FastFileWriterConfig``
(``dnvme_handle``, ``pinned_tensor``, ``double_buffer``, ``num_parallel_writers``,
``writer_rank``, ``global_rank``), the writers ``FastFileWriter``, ``PyFileWriter`` and
``MockFileWriter`` with ``write``, ``flush``, ``fileno``, ``close``, ``file_path``,
``save_torch_storage_object_list`` and ``_dump_state`` (the statistics DeepSpeed prints).
``fileno()`` returns -1 as DeepSpeed's do: ``torch.save(..., _use_new_zipfile_serialization=False)``
would otherwise write tensors to the descriptor directly, past the writer's buffers.

Where this differs (each on purpose):

- Arguments are checked when the config is made, with errors that say what to pass,
  instead of DeepSpeed's asserts at first use.
- ``num_parallel_writers > 1`` writes *one* file from several writers, each its own
  stripes of the stream (see [Note: parallel writers of one file] in
  _striped_writer.py; ``stripe_bytes`` is ours): every writer is given the same
  object, the file is byte-identical to a plain ``torch.save`` once all of them
  closed. DeepSpeed splits only the tensor bytes, and only under a modified
  ``torch.save``; its launcher names a file per writer.
- With one writer the file is replaced atomically at ``close()`` (nothing appears
  under the name before every byte is written and fsynced; an older file is never
  left with a stale tail, as DeepSpeed's open without ``O_TRUNC`` leaves it). A writer
  dropped without ``close()`` writes nothing (DeepSpeed's finishes the file when
  collected) and warns (ResourceWarning). Writers are also context managers.
- ``PyFileWriter`` fsyncs and replaces atomically too; ``MockFileWriter`` counts
  bytes and creates no file (DeepSpeed's leaves an empty one).
- The pinned tensor is a host tensor: a device tensor (DeepSpeed's GDS path) is refused.
"""
from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time
from typing import Any, Dict, Optional

from ._fast_buffers import IOBuffers
from ._fast_writer import FastFileWriter as _AtomicFastWriter
from ._plain_writer import PlainFileWriter
from ._striped_writer import DEFAULT_STRIPE_BYTES, StripedFileWriter

__all__ = ["FastFileWriterConfig", "FastFileWriter", "PyFileWriter", "MockFileWriter", "BaseFileWriter",
           "INVALID_FD", "DEFAULT_STRIPE_BYTES"]

INVALID_FD = -1  # what fileno() returns, as DeepSpeed's writers do
_STORAGE_SIZE_BYTES = 8  # the int64 element count save_torch_storage_object_list writes before a storage


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class FastFileWriterConfig:
    """How a :class:`FastFileWriter` writes (DeepSpeed's fields, checked when made).

    Args:
        dnvme_handle: the ``nvmeio.aio_handle`` the writes go through (not closed by the writer).
        pinned_tensor: a 1-D uint8 host tensor, page-locked for speed
            (``dnvme_handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))``);
            its size a multiple of ``dnvme_handle.get_alignment()`` (twice that with
            ``double_buffer``). One open writer at a time may use it.
        double_buffer: split it in two halves, one filled while the other is written.
        num_parallel_writers: how many writers write the file, each from its own process or
            thread, each given the same object (see the module docstring).
        writer_rank: which of them this one is, in ``[0, num_parallel_writers)``.
        global_rank: this process's rank, for the statistics only.
        stripe_bytes: (ours) the stripe of the stream each writer takes in turn when
            ``num_parallel_writers > 1``; a multiple of 4096, the same for every writer.
    """

    dnvme_handle: Any
    pinned_tensor: Any
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0
    stripe_bytes: int = DEFAULT_STRIPE_BYTES

    def __post_init__(self) -> None:
        h = self.dnvme_handle
        if not all(callable(getattr(h, m, None)) for m in ("async_pwrite", "wait", "get_alignment")):
            raise TypeError(f"dnvme_handle must be an nvmeio.aio_handle (DeepSpeed's aio_handle), got "
                            f"{type(h).__name__}")
        if getattr(h, "closed", False):
            raise ValueError("dnvme_handle is closed")
        if not isinstance(self.double_buffer, bool):
            raise TypeError(f"double_buffer must be True or False, got {self.double_buffer!r}")
        self._check_tensor()
        if not _is_int(self.num_parallel_writers) or self.num_parallel_writers < 1:
            raise ValueError(f"num_parallel_writers must be an int >= 1, got {self.num_parallel_writers!r}")
        if not _is_int(self.writer_rank) or not 0 <= self.writer_rank < self.num_parallel_writers:
            raise ValueError(f"writer_rank must be an int in [0, num_parallel_writers={self.num_parallel_writers}),"
                             f" got {self.writer_rank!r}")
        if not _is_int(self.global_rank) or self.global_rank < 0:
            raise ValueError(f"global_rank must be an int >= 0, got {self.global_rank!r}")
        if not _is_int(self.stripe_bytes) or self.stripe_bytes <= 0 or self.stripe_bytes % 4096:
            raise ValueError(f"stripe_bytes must be a positive multiple of 4096, got {self.stripe_bytes!r}")

    def _check_tensor(self) -> None:
        import torch

        t = self.pinned_tensor
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pinned_tensor must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"pinned_tensor is on {t.device}: nvmeio.io writes through a host buffer; pass a "
                             f"page-locked CPU tensor (dnvme_handle.new_cpu_locked_tensor(n, "
                             f"torch.empty(0, dtype=torch.uint8)))")
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"pinned_tensor must be a contiguous 1-D torch.uint8 tensor, got {t.dtype} of "
                             f"shape {tuple(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}")
        unit = self.dnvme_handle.get_alignment() * (2 if self.double_buffer else 1)
        if t.numel() == 0 or t.numel() % unit:
            raise ValueError(f"pinned_tensor holds {t.numel()} bytes: it must be a positive multiple of {unit} "
                             f"(dnvme_handle.get_alignment() = {self.dnvme_handle.get_alignment()}"
                             f"{', times 2 halves with double_buffer' if self.double_buffer else ''})")


class BaseFileWriter:
    """What every writer here shares (DeepSpeed's ``BaseFileWriter``): the path, the
    statistics, ``fileno() == -1``, the context manager."""

    def __init__(self, file_path):
        self._file_path = os.fspath(file_path)
        self._stats: Dict[str, Any] = {"close": 0, "fileno": 0, "flush": 0, "write": 0, "bytes": 0,
                                       "write_secs": 0.0, "write_GB/s": 0.0}

    def file_path(self) -> str:
        return self._file_path

    _file = None  # the file a subclass writes through (PlainFileWriter, FastFileWriter, ...)

    def write(self, buffer) -> int:
        """Writes ``buffer`` through the subclass's file, counting bytes and seconds."""
        if self._file is None:
            raise TypeError(f"{type(self).__name__} has no file to write through: use FastFileWriter, "
                            f"PyFileWriter or MockFileWriter")
        start = time.perf_counter()
        n = self._file.write(buffer)
        self._count_write(n, time.perf_counter() - start)
        return n

    def flush(self) -> None:
        self._stats["flush"] += 1

    def fileno(self) -> int:
        """-1, as DeepSpeed's writers return: torch must write through :meth:`write`."""
        self._stats["fileno"] += 1
        return INVALID_FD

    def close(self) -> None:
        self._stats["close"] += 1

    def writable(self) -> bool:
        return True

    def stats(self) -> Dict[str, Any]:
        """The statistics DeepSpeed's ``_dump_state`` prints (counts of calls, bytes, seconds)."""
        out = dict(self._stats)
        if out["write_secs"] > 0:
            out["write_GB/s"] = out["bytes"] / out["write_secs"] / (1 << 30)
        out["path"] = self._file_path
        return out

    def _dump_state(self) -> None:
        """Prints :meth:`stats` (DeepSpeed's name, which its scripts call)."""
        print(f"stats = {self.stats()}")

    def save_torch_storage_object_list(self, storage_obj_list, save_size: bool) -> int:
        """What a torch.save modified for FastPersist calls with the tensors' storages (each a
        ``(untyped_storage, dtype)`` pair): each storage's bytes, after its element count as
        8 bytes when ``save_size``. Returns the bytes written."""
        import torch

        total = 0
        for item in storage_obj_list:
            storage, dtype = item if isinstance(item, tuple) else (item, getattr(item, "dtype", torch.uint8))
            untyped = storage.untyped() if hasattr(storage, "untyped") else storage
            data = torch.empty(0, dtype=torch.uint8).set_(untyped.cpu())
            if save_size:
                total += self.write(struct.pack("<q", data.numel() // torch._utils._element_size(dtype)))
            total += self.write(memoryview(data.numpy()))
        self._stats["save_storage"] = self._stats.get("save_storage", 0) + len(storage_obj_list)
        self._stats["save_storage_bytes"] = self._stats.get("save_storage_bytes", 0) + total
        return total

    def _count_write(self, nbytes: int, seconds: float) -> None:
        self._stats["write"] += 1
        self._stats["bytes"] += nbytes
        self._stats["write_secs"] += seconds

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
        else:
            self.close()

    def _abort(self) -> None:
        self.close()


class PyFileWriter(BaseFileWriter):
    """Plain buffered Python file I/O (DeepSpeed's ``PyFileWriter``); the file is fsynced and
    replaces ``file_path`` atomically at ``close()``."""

    def __init__(self, file_path):
        super().__init__(file_path)
        self._file = PlainFileWriter(self._file_path)

    def close(self) -> None:
        if not self._file.closed:
            super().close()
        self._file.close()

    def _abort(self) -> None:
        self._file.abort()  # drops the temporary file: file_path is untouched
        self._file.close()


class MockFileWriter(BaseFileWriter):
    """Counts what would be written and writes nothing (DeepSpeed's ``MockFileWriter``, for
    timing the rest of a save); unlike DeepSpeed's it creates no file either."""

    def write(self, buffer) -> int:
        n = memoryview(buffer).nbytes
        self._count_write(n, 0.0)
        return n


# Host memory that an open FastFileWriter writes from: (address, bytes) -> the writer's path.
_in_use: Dict[tuple, str] = {}
_in_use_lock = threading.Lock()


class FastFileWriter(BaseFileWriter):
    """Writes ``file_path`` through ``config.dnvme_handle`` from ``config.pinned_tensor``
    (DeepSpeed's ``FastFileWriter``): bytes written are copied into the pinned buffer, each
    full half written O_DIRECT while the other fills. See the module docstring for
    ``num_parallel_writers``."""

    def __init__(self, file_path, config: FastFileWriterConfig):
        if not isinstance(config, FastFileWriterConfig):
            raise TypeError(f"config must be an nvmeio.io.FastFileWriterConfig, got {type(config).__name__}")
        super().__init__(file_path)
        self._config = config
        self._file: Optional[Any] = None
        t = config.pinned_tensor
        self._region = (t.data_ptr(), t.numel())
        with _in_use_lock:
            for (ptr, n), user in _in_use.items():
                if ptr < self._region[0] + self._region[1] and self._region[0] < ptr + n:
                    raise RuntimeError(f"pinned_tensor is in use by the open FastFileWriter of {user!r}: close "
                                       f"that writer first, or give each writer a buffer of its own")
            _in_use[self._region] = self._file_path
        try:
            halves = list(t.chunk(2)) if config.double_buffer else [t]
            self._io = IOBuffers(handle=config.dnvme_handle, buffers=halves)
            if config.num_parallel_writers == 1:
                self._file = _AtomicFastWriter(self._file_path, io=self._io)
            else:
                self._file = StripedFileWriter(self._file_path, self._io, config.num_parallel_writers,
                                               config.writer_rank, config.stripe_bytes)
        except BaseException:
            self._release()
            raise
        self._stats.update({"rank": config.global_rank, "aio_bytes": 0})

    def close(self) -> None:
        """Writes what is buffered and fsyncs (with one writer, renames the file into place);
        idempotent. With several writers the file is whole once every one has closed."""
        if self._file is None or self._file.closed:
            return
        start = time.perf_counter()
        try:
            self._file.close()
        finally:
            self._release()
        self._stats["write_secs"] += time.perf_counter() - start
        self._stats["aio_bytes"] = self._io.stats.bytes_written
        super().close()

    def _abort(self) -> None:
        try:
            if self._file is not None:
                self._file.abort()
        finally:
            self._release()

    def _release(self) -> None:
        with _in_use_lock:
            _in_use.pop(self._region, None)
        io = getattr(self, "_io", None)
        if io is not None:
            io.close()  # the caller's handle and pinned tensor stay the caller's

    def __del__(self) -> None:
        # The file dropped without close() warns and writes nothing (its own __del__); the
        # pinned tensor is free for another writer.
        if getattr(self, "_file", None) is not None and not self._file.closed:
            self._file = None
            self._release()

    def __repr__(self) -> str:
        c = self._config
        return (f"FastFileWriter({self._file_path!r}, double_buffer={c.double_buffer}, "
                f"writer {c.writer_rank} of {c.num_parallel_writers})")
