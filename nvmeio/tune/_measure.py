"""One configuration's read and write GB/s, in-process, striped over the directories.

A :class:`Workload` owns what every measurement shares: one buffer of
``io_size`` bytes (a page-locked CPU tensor, or a CUDA tensor with --gpu /
--gds) split into one equal part per --nvme_dir, and one temporary file per
directory. ``measure(config)`` builds a fresh handle for the configuration,
then times ``loops`` writes of the whole buffer and ``loops`` reads back.

[Note: striping, and what a timing covers]
A list of nvme_path directories has the swappers stripe every swap file over
them (nvmeio/striping.py [Note: striping]); so does one measurement here, with
several --nvme_dir: one handle, one op of the whole buffer on a striped file
of one part per directory, in stripe units of the configuration's block
size, then one ``wait()``. (A CUDA buffer, --gpu or --gds, is split instead
into one part per directory, one op each: a striped file takes host buffers.) A timing runs from the first submit
to the return of that ``wait()``. The files are written once, untimed, when
the workload starts, so every timed write overwrites allocated blocks (the
steady state of a swap file) and no configuration pays for allocation that
another does not. With O_DIRECT the page cache plays no part; on a file
system that refuses O_DIRECT the handle writes buffered + fdatasync, and the
files' clean pages are evicted (posix_fadvise DONTNEED) before every timed
read so that a read is not served from memory. --flush_page_cache drops the
whole page cache (sync; echo 1 > /proc/sys/vm/drop_caches) before every
timed op, as ds_nvme_tune does between its runs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ._space import Config

__all__ = ["GIB", "Sample", "PageCache", "Workload", "split_io_size"]

GIB = 1 << 30  # GB/s here is GiB/s, as ds_nvme_tune reports it
ALIGN = 4096   # each part of the striped buffer starts on a page boundary
DROP_CACHES = "/proc/sys/vm/drop_caches"


@dataclass
class Sample:
    """One measurement of one configuration (None: that op was not measured)."""

    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None
    read_s: Optional[float] = None
    write_s: Optional[float] = None
    error: Optional[str] = None

    @property
    def score(self) -> float:
        """read + write GB/s: what ds_nvme_tune maximises to pick its configuration."""
        if self.error:
            return 0.0
        return (self.read_gbps or 0.0) + (self.write_gbps or 0.0)


def split_io_size(io_size: int, ndirs: int) -> int:
    """Bytes per directory: io_size split in equal parts, each a multiple of 4 KiB."""
    part = (io_size // ndirs) // ALIGN * ALIGN
    if part <= 0:
        raise ValueError(f"--io_size {io_size} is too small to stripe over {ndirs} "
                         f"director{'y' if ndirs == 1 else 'ies'} ({ALIGN} bytes each at least)")
    return part


class PageCache:
    """Drops the page cache between runs when asked and allowed; evicts our files otherwise."""

    def __init__(self, drop: bool):
        self.requested = drop
        self.can_drop = False
        self.why_not: Optional[str] = None
        if drop:
            try:
                self._drop()
                self.can_drop = True
            except OSError as e:
                need = "" if os.geteuid() == 0 else " (needs root)"
                self.why_not = f"cannot write {DROP_CACHES}: {e.strerror}{need}"

    @staticmethod
    def _drop() -> None:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("1")

    def describe(self) -> Optional[str]:
        if not self.requested:
            return None
        if self.can_drop:
            return "page cache dropped before every timed op (sync; echo 1 > drop_caches)"
        return (f"--flush_page_cache: {self.why_not}; the page cache is NOT dropped, only the "
                "tune files are evicted (posix_fadvise DONTNEED) before every timed op")

    def settle(self, paths: Sequence[str], evict: bool) -> None:
        """Before a timed op: drop the whole cache, or evict ``paths`` when ``evict``."""
        if self.can_drop:
            self._drop()
        elif evict or self.requested:
            for p in paths:
                _evict(p)


def _setup_backend() -> str:
    import nvmeio

    return nvmeio.available_backends()[0]


@contextlib.contextmanager
def _quiet_buffered_warning():
    """Buffered mode is announced once by nvme_tune, not by every handle."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="nvmeio: no O_DIRECT")
        yield


def _evict(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)  # only clean pages can be evicted
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Workload:
    """The shared buffer and files of a tuning run; use as a context manager.

    Leaving the context (normally, on an error or on Ctrl-C) waits for any op
    still in flight, removes the temporary files and frees the buffer.
    """

    def __init__(self, dirs: Sequence[str], io_size: int, *, loops: int = 1,
                 read: bool = True, write: bool = True, device: str = "cpu",
                 gds: bool = False, page_cache: Optional[PageCache] = None,
                 buffered_dirs: Sequence[str] = ()):
        if not (read or write):
            raise ValueError("nothing to measure: both reads and writes are off")
        self.dirs = list(dirs)
        self.part = split_io_size(io_size, len(self.dirs))
        self.nbytes = self.part * len(self.dirs)
        self.loops = loops
        self.do_read, self.do_write = read, write
        self.device = "cuda" if gds else device
        self.gds = gds
        self.page_cache = page_cache or PageCache(False)
        self.buffered = bool(buffered_dirs)
        # The files the sweep writes and reads: created exclusively, never
        # through a symlink planted at the name (nvme_dir may be shared), and
        # then reached only through their descriptors (/proc/self/fd/N).
        self.names: list[str] = []
        self._fds: list[int] = []
        self.paths: list[str] = []
        self.notes: list[str] = []
        self._buffer: Any = None
        self._parts: list[Any] = []
        self._allocator: Any = None
        self._active: Any = None  # the handle of the op being timed

    # -- lifetime ----------------------------------------------------------------------

    def __enter__(self) -> "Workload":
        try:
            self._allocate()
            self._prepare_files()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._drain()
        for p in self.names:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.notes.append(f"could not remove {p}: {e.strerror}")
        for fd in self._fds:
            os.close(fd)
        self.names, self._fds, self.paths = [], [], []
        if self._buffer is not None and self._allocator is not None:
            try:
                if self.gds:
                    self._allocator.free_pinned_device_tensor(self._buffer)
                else:
                    self._allocator.free_cpu_locked_tensor(self._buffer)
            except (ValueError, RuntimeError):
                pass
        self._parts, self._buffer, self._allocator = [], None, None

    def _drain(self) -> None:
        h, self._active = self._active, None
        if h is not None:
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - the op failed or was cut short: the files go anyway
                pass

    # -- setup -------------------------------------------------------------------------

    def _allocate(self) -> None:
        import torch

        pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(0))
        if self.gds:
            import nvmeio

            self._allocator = nvmeio.gds_handle()
            example = torch.empty(0, dtype=torch.uint8, device="cuda")
            self._buffer = self._allocator.new_pinned_device_tensor(self.nbytes, example)
        elif self.device == "cuda":
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        else:
            import nvmeio

            # A named backend: "auto" would measure the backends first.
            self._allocator = nvmeio.aio_handle(backend=_setup_backend())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._buffer = self._allocator.new_cpu_locked_tensor(
                    self.nbytes, torch.empty(0, dtype=torch.uint8))
            for w in caught:
                self.notes.append(str(w.message))
        whole = self.nbytes // pattern.numel()
        if whole:
            self._buffer[:whole * pattern.numel()].view(whole, -1).copy_(pattern)
        rest = self.nbytes - whole * pattern.numel()
        if rest:
            self._buffer[whole * pattern.numel():].copy_(pattern[:rest])
        self._parts = [self._buffer[i * self.part:(i + 1) * self.part]
                       for i in range(len(self.dirs))]

    def _prepare_files(self) -> None:
        """Writes every file once, untimed (see [Note: striping, and what a timing covers])."""
        for i, d in enumerate(self.dirs):
            name = os.path.join(d, f"nvme_tune.{os.getpid()}.{i}.{secrets.token_hex(4)}.tmp")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC,
                         0o600)
            self.names.append(name)
            self._fds.append(fd)
            self.paths.append(f"/proc/self/fd/{fd}")
        h = self._make_handle(None)
        self._active = h
        with _quiet_buffered_warning():
            for part, path in self._ops(h.get_block_size()):
                h.async_pwrite(part, path)
        h.wait()
        self._active = None

    def _make_handle(self, config: Optional[Config]):
        import nvmeio

        if config is not None:
            kwargs = config.handle_kwargs()
        elif self.gds:
            kwargs = {}
        else:  # the untimed set-up write
            kwargs = {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 4,
                      "backend": _setup_backend()}
        with _quiet_buffered_warning():
            if self.gds:
                return nvmeio.gds_handle(**kwargs)
            return nvmeio.aio_handle(**kwargs)

    # -- measuring ---------------------------------------------------------------------

    def _ops(self, block_size: int) -> list:
        """(buffer, file) of each op of one timed write or read (see the [Note])."""
        if len(self.paths) > 1 and self.device == "cpu" and not self.gds:
            from ..striping import StripedFile, stripe_unit

            return [(self._buffer, StripedFile(tuple(self.paths), stripe_unit(block_size)))]
        return list(zip(self._parts, self.paths))

    def _timed(self, h: Any, write: bool) -> float:
        self.page_cache.settle(self.paths, evict=self.buffered and not write)
        ops = self._ops(h.get_block_size())
        with _quiet_buffered_warning():
            self._active = h
            t0 = time.perf_counter()
            for part, path in ops:
                if write:
                    h.async_pwrite(part, path)
                else:
                    h.async_pread(part, path)
            h.wait()
            elapsed = time.perf_counter() - t0
            self._active = None
        return elapsed

    def measure(self, config: Config) -> Sample:
        """Writes then reads the whole buffer ``loops`` times with a fresh handle."""
        sample = Sample()
        try:
            h = self._make_handle(config)
            total = self.nbytes * self.loops
            if self.do_write:
                sample.write_s = sum(self._timed(h, True) for _ in range(self.loops))
                sample.write_gbps = total / sample.write_s / GIB
            if self.do_read:
                sample.read_s = sum(self._timed(h, False) for _ in range(self.loops))
                sample.read_gbps = total / sample.read_s / GIB
        except (OSError, ValueError, RuntimeError, TypeError) as e:
            self._drain()
            sample = Sample(error=f"{type(e).__name__}: {e}")
        return sample
