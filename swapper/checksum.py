"""Optional checksums of swapped tensors, kept in memory, checked on swap-in.

[Note: what a checksum protects against, and what it costs]
A swap file can change behind our back: another process, a full or failing
disk, a file system repair, a stale run writing into the same directory. The
raw file has no header, so without a record of what was written a swap-in
would feed whatever bytes it finds to training. With ``checksum`` set, every
region written (one tensor, or one piece of one) gets a 64-bit digest kept in
memory, and every read verifies the regions it covers before the data is
handed out; a mismatch raises :class:`SwapCorruptionError` naming the file and
the byte range. Cost on this machine's CPU, per byte swapped: ``xxhash``
(xxh3, ~26 GB/s), ``crc32c`` (~15 GB/s, hardware CRC), ``crc32`` (zlib from
the standard library, ~4 GB/s, needs no extra package). All three release the
GIL, so I/O threads keep running while a digest is computed.

[Note: digests off the critical path]
The engine's main thread drives compute, so a digest it computes delays the
step. A large swap-out records its digests on a helper thread
(:meth:`ChecksumTable.record_later`) while the write is in flight; whoever
reuses the buffer waits for them first (the optimizer swapper, before it
releases the buffer). A read verifying several large regions shares them with
the helpers (:func:`hash_together`). The helpers run at Linux's SCHED_IDLE: only on a
core nothing else wants. At normal priority a helper took a core from the
matrix products' second thread, and a parallel kernel waits for its slowest
thread: on the 2-CPU benchmark machine ~0.6 s of hashing a k = 16 iteration
(311M GPT, batch 1 x 8) cost 4 s of its 16. Whoever needs a digest and waits
for it leaves its core idle, so a helper is never starved for long.

[Note: a landed batch of reads is hashed at once]
Reads complete a batch at a time (a read queue's wait, _io_queue.py), and each read's
callback verified its regions one after the other on the thread that waited: the engine's
main thread, hashing every byte read. On a GPU that was a fixed cost the disk could not hide
(the 311M LoRA stand-in: 0.21 s an iteration of 0.75 s unquantized, 49 ms of 0.41 s quantized,
xxh3 at ~5.5 GB/s on freshly read memory). So when a queue's batch lands, the regions its reads
cover are hashed together (:meth:`ChecksumTable.hashed_ahead`): the waiting thread and a pool of
helper threads (SCHED_IDLE, as above) each take the next region nobody has started, so a
helper that gets no core leaves its share to the waiting thread, and the callbacks' ``verify``
compares against those digests instead of hashing again. A region is still hashed from the
bytes just read, before anything sees them; only where and when changes. The digests live only
while that batch's callbacks run: one kept longer could vouch for other bytes read later into
the same memory.

[Note: a drive's share of a striped region]
A region of a file striped over several drives (nvmeio.striping) keeps, beside its digest,
one digest per drive of that drive's share of the region (the share of each part is one
contiguous range of that part), so a mismatch names the drive whose bytes changed rather than
"one of N". The region's own digest stays the plain digest of its bytes (checkpoints carry it
and it must match a plain file's); the shares cost a second hash of a striped region, where it
is recorded (on the helper with :meth:`ChecksumTable.record_later`). A digest known from
elsewhere (:meth:`ChecksumTable.assign`, a checkpoint's) has no shares: its mismatch names the
drives the region spans.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import os
import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from nvmeio.striping import StripedFile

from ._errors import SwapCorruptionError

__all__ = ["ChecksumAlgorithm", "ChecksumTable", "StreamingDigest", "PendingDigests", "digest_chunks",
           "checksum_table", "fastest_available"]


class ChecksumAlgorithm(enum.Enum):
    """Digest of each swapped region; memory cost is 24 bytes per region either way."""

    XXHASH = "xxhash"  #: xxh3-64 from the ``xxhash`` package
    CRC32C = "crc32c"  #: Castagnoli CRC from the ``crc32c`` package
    CRC32 = "crc32"  #: zlib CRC-32 from the standard library

    @classmethod
    def coerce(cls, value: Union["ChecksumAlgorithm", str, None]) -> Optional["ChecksumAlgorithm"]:
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(repr(a.value) for a in cls)
            raise ValueError(f"unknown checksum {value!r}; use one of {names} or None") from None


def _digest_fn(algorithm: ChecksumAlgorithm) -> Callable[[memoryview], int]:
    if algorithm is ChecksumAlgorithm.CRC32:
        import zlib

        return zlib.crc32
    package = "xxhash" if algorithm is ChecksumAlgorithm.XXHASH else "crc32c"
    try:
        if algorithm is ChecksumAlgorithm.XXHASH:
            import xxhash

            return xxhash.xxh3_64_intdigest
        import crc32c

        return crc32c.crc32c
    except ImportError as exc:
        raise ImportError(
            f"checksum={algorithm.value!r} needs the {package!r} package (pip install {package}); "
            f"checksum='crc32' works with the standard library alone"
        ) from exc


class StreamingDigest:
    """A digest fed piece by piece (``update``), equal to the one :meth:`ChecksumTable.digest`
    gives all the pieces' bytes at once (to check a file while streaming it, never whole in
    memory)."""

    def __init__(self, algorithm: ChecksumAlgorithm):
        fn = _digest_fn(algorithm)  # the clear ImportError where the package is missing
        self._state = None
        self._value = 0
        if algorithm is ChecksumAlgorithm.XXHASH:
            import xxhash

            self._state = xxhash.xxh3_64()
        else:
            self._fn = fn

    def update(self, piece: memoryview) -> None:
        if self._state is not None:
            self._state.update(piece)
        else:
            self._value = self._fn(piece, self._value)

    def value(self) -> int:
        return self._state.intdigest() if self._state is not None else self._value


def digest_chunks(algorithm: ChecksumAlgorithm, chunks: Iterable[memoryview]) -> int:
    """The digest of the bytes of ``chunks`` taken in order (see :class:`StreamingDigest`)."""
    state = StreamingDigest(algorithm)
    for chunk in chunks:
        state.update(chunk)
    return state.value()


def _memory(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":  # a digest is of the host bytes a swap file gets (a staging buffer's)
        raise ValueError(f"a checksum is computed on host memory, got a tensor on {t.device}: copy it to the "
                         f"host (the staging buffer that is written) first")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


PARALLEL_MIN_BYTES = 8 << 20  # below this a helper thread costs more than it saves


def run_in_background() -> None:
    """The calling thread runs at SCHED_IDLE from now on (Linux; elsewhere nothing changes)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (AttributeError, OSError):
        pass


class PendingDigests:
    """Digests computed on a helper thread, one per job (a call returning it); :meth:`wait`
    before the hashed tensors may change."""

    def __init__(self, jobs: Sequence[Callable[[], object]]):
        self._values: List[object] = [None] * len(jobs)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(list(jobs),), name="nvmeio-digest", daemon=True)
        self._thread.start()

    def _run(self, jobs: List[Callable[[], object]]) -> None:
        run_in_background()
        try:
            for i, job in enumerate(jobs):
                self._values[i] = job()
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def value(self, index: int):
        self.wait()
        return self._values[index]


HASH_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))  # helpers besides the thread that waits
_hash_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_hash_pool_lock = threading.Lock()


def _forget_hash_pool() -> None:  # a forked child has none of its parent's threads
    global _hash_pool
    _hash_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_hash_pool)


def hash_together(jobs: Sequence[Callable[[], int]]) -> List[int]:
    """Each job's digest, computed by the calling thread and the helper pool together: each takes
    the next job nobody has started, so the caller waits only for jobs a helper is running; where
    the helpers get no core (they run at SCHED_IDLE, a busy machine's data loaders beside them),
    the caller does them all (see [Note: a landed batch of reads is hashed at once])."""
    global _hash_pool
    if len(jobs) < 2:
        return [job() for job in jobs]
    results: List[Optional[int]] = [None] * len(jobs)
    errors: List[BaseException] = []
    todo = list(range(len(jobs) - 1, -1, -1))  # popped from the end: the first job first
    left = [len(jobs)]
    cond = threading.Condition()

    def work() -> None:
        while True:
            with cond:
                if not todo:
                    return
                i = todo.pop()
            try:
                results[i] = jobs[i]()
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                errors.append(exc)
            with cond:
                left[0] -= 1
                cond.notify_all()

    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = concurrent.futures.ThreadPoolExecutor(
                HASH_THREADS, thread_name_prefix="nvmeio-verify", initializer=run_in_background)
        for _ in range(min(HASH_THREADS, len(jobs) - 1)):
            try:
                _hash_pool.submit(work)
            except RuntimeError:  # the interpreter is exiting (an atexit cleanup): the caller does it
                break
    work()
    with cond:
        cond.wait_for(lambda: left[0] == 0)
    if errors:
        raise errors[0]
    return results


DriveDigests = Tuple[Tuple[int, int], ...]  # (part, digest of its share), for each part a region touches


@dataclass(frozen=True)
class _Region:
    offset: int
    nbytes: int
    digest: int
    pending: Optional[Tuple[PendingDigests, int]] = None  # (record_later's digests, index) until read
    drives: Union[DriveDigests, Tuple[PendingDigests, int], None] = None  # striped files (see the note)

    def value(self) -> int:
        return self.digest if self.pending is None else self.pending[0].value(self.pending[1])

    def drive_digests(self) -> Optional[DriveDigests]:
        if self.drives is not None and isinstance(self.drives[0], PendingDigests):
            return self.drives[0].value(self.drives[1])
        return self.drives


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat (uint8)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _striped(path) -> bool:
    return isinstance(path, StripedFile) and len(path.parts) > 1


class ChecksumTable:
    """Digests of the regions written to each swap file, by path and byte offset."""

    def __init__(self, algorithm: Union[ChecksumAlgorithm, str]):
        algo = ChecksumAlgorithm.coerce(algorithm)
        if algo is None:
            raise ValueError("ChecksumTable needs an algorithm")
        self.algorithm = algo
        self._digest = _digest_fn(algo)
        self._files: Dict[str, List[_Region]] = {}
        self._ahead: Dict[tuple, int] = {}  # digests hashed together as a batch landed (hashed_ahead)

    def digest(self, data: torch.Tensor) -> int:
        return self._digest(_memory(data))

    def drive_digests(self, path: StripedFile, offset: int, data: torch.Tensor) -> DriveDigests:
        """The digest of each drive's share of ``data`` at ``offset`` of striped ``path``."""
        raw = _raw(data)
        shares: Dict[int, List[memoryview]] = {}
        for piece in path.pieces(offset, raw.numel()):  # a part's pieces are its share in order
            shares.setdefault(piece.part, []).append(_memory(raw[piece.start:piece.start + piece.length]))
        return tuple((part, digest_chunks(self.algorithm, chunks)) for part, chunks in sorted(shares.items()))

    def record(self, path: str, offset: int, data: torch.Tensor) -> None:
        """Remember the digest of ``data``, about to be written at ``offset`` of ``path``.

        Regions it overlaps are forgotten: their bytes are being overwritten.
        """
        drives = self.drive_digests(path, offset, data) if _striped(path) else None
        self._put(path, _Region(offset, data.numel() * data.element_size(), self.digest(data), drives=drives))

    def record_later(self, path: str, regions: Sequence[Tuple[int, torch.Tensor]]) -> PendingDigests:
        """:meth:`record` each ``(offset, data)`` of ``regions``, hashing on a helper thread (see
        the note): the caller must not change the data before the returned digests' ``wait()``."""
        jobs = [functools.partial(self.digest, t) for _, t in regions]
        if _striped(path):
            jobs += [functools.partial(self.drive_digests, path, offset, t) for offset, t in regions]
        pending = PendingDigests(jobs)
        for i, (offset, t) in enumerate(regions):
            drives = (pending, len(regions) + i) if _striped(path) else None
            self._put(path, _Region(offset, t.numel() * t.element_size(), 0, (pending, i), drives))
        return pending

    def recorded(self, path: str, offset: int, nbytes: int) -> Optional[int]:
        """The digest recorded for exactly the bytes ``[offset, offset + nbytes)`` of ``path``."""
        for r in self._files.get(path, []):
            if r.offset == offset and r.nbytes == nbytes:
                return r.value()
        return None

    def assign(self, path: str, offset: int, nbytes: int, digest: int) -> None:
        """Record ``digest`` as the one of bytes ``[offset, offset + nbytes)`` of ``path``,
        known from elsewhere (a checkpoint that carries it); overlapped regions are forgotten."""
        self._put(path, _Region(offset, nbytes, int(digest)))

    def _put(self, path: str, region: _Region) -> None:
        end = region.offset + region.nbytes
        regions = [r for r in self._files.get(path, []) if r.offset >= end or r.offset + r.nbytes <= region.offset]
        regions.append(region)
        self._files[path] = regions

    def _inside(self, path, offset: int, data: torch.Tensor) -> Tuple[List[_Region], List[torch.Tensor]]:
        """The recorded regions of ``path`` inside the bytes ``data`` was read from, and their bytes."""
        raw = _raw(data)
        end = offset + raw.numel()
        inside = [r for r in self._files.get(path, []) if r.offset >= offset and r.offset + r.nbytes <= end]
        return inside, [raw[r.offset - offset:r.offset - offset + r.nbytes] for r in inside]

    def hashed_ahead(self, reads: Sequence[Tuple[object, int, torch.Tensor]]) -> ContextManager:
        """Hashes the regions inside ``reads`` (``(path, offset, data)``, landed) together, now;
        within the returned context :meth:`verify` of any of them uses those digests, which go
        when it exits (see [Note: a landed batch of reads is hashed at once]). Enter it at once:
        a digest kept past it could vouch for other bytes read later into the same memory."""
        keys, jobs = [], []
        for path, offset, data in reads:
            for r, piece in zip(*self._inside(path, offset, data)):
                keys.append((path, r.offset, r.nbytes, piece.data_ptr()))
                jobs.append(functools.partial(self.digest, piece))
        self._ahead = {}
        if len(jobs) < 2 or sum(k[2] for k in keys) < PARALLEL_MIN_BYTES:
            return contextlib.nullcontext()
        self._ahead = dict(zip(keys, hash_together(jobs)))
        return self._ahead_until_exit()

    @contextlib.contextmanager
    def _ahead_until_exit(self):
        try:
            yield
        finally:
            self._ahead = {}

    def verify(self, path: str, offset: int, data: torch.Tensor) -> None:
        """Check every recorded region of ``path`` inside the bytes ``data`` was read from."""
        inside, pieces = self._inside(path, offset, data)
        known = [self._ahead.pop((path, r.offset, r.nbytes, p.data_ptr()), None) for r, p in zip(inside, pieces)]
        todo = [i for i, k in enumerate(known) if k is None]
        if len(todo) > 1 and sum(inside[i].nbytes for i in todo) >= PARALLEL_MIN_BYTES:  # (see the note)
            for i, value in zip(todo, hash_together([functools.partial(self.digest, pieces[i]) for i in todo])):
                known[i] = value
        for i, r in enumerate(inside):
            actual = known[i] if known[i] is not None else self.digest(pieces[i])
            if actual != r.value():
                drives, where = self._changed_drives(path, r, pieces[i])
                raise SwapCorruptionError(
                    f"swap file {path} changed since it was written: {self.algorithm.value} of bytes "
                    f"[{r.offset}, {r.offset + r.nbytes}) is {actual:#x}, expected {r.value():#x}{where}",
                    drives[0] if len(drives) == 1 else path,
                )

    def _changed_drives(self, path, region: _Region, data: torch.Tensor) -> Tuple[List[str], str]:
        """The part files a mismatched region's change is on, and the words that say so."""
        if not _striped(path):
            return [], ""
        now = self.drive_digests(path, region.offset, data)
        then = region.drive_digests()
        if then is None:  # a digest from elsewhere: the drives it spans
            spanned = [path.parts[part] for part, _ in now]
            return spanned, f"; the region is on the drives of {', '.join(spanned)} (no digest per drive recorded)"
        changed = [path.parts[part] for (part, digest), (_, was) in zip(now, then) if digest != was]
        if not changed:  # cannot be, short of the recorded shares being wrong themselves
            return [], ""
        return changed, f"; the changed bytes are on {', '.join(changed)}"

    def forget(self, path: str) -> None:
        self._files.pop(path, None)

    def forget_region(self, path: str, offset: int, nbytes: int) -> None:
        """Forget the digest of exactly bytes ``[offset, offset + nbytes)`` of ``path``."""
        self._files[path] = [r for r in self._files.get(path, []) if (r.offset, r.nbytes) != (offset, nbytes)]

    def __len__(self) -> int:
        return sum(len(v) for v in self._files.values())


def checksum_table(checksum) -> Optional[ChecksumTable]:
    """A table for ``checksum`` (an algorithm, its name, a table to share) or ``None`` when off."""
    if checksum is None or isinstance(checksum, ChecksumTable):
        return checksum
    algorithm = ChecksumAlgorithm.coerce(checksum)
    return None if algorithm is None else ChecksumTable(algorithm)


def fastest_available() -> ChecksumAlgorithm:
    """xxhash, else crc32c, else crc32 (the standard library's): the fastest this install has."""
    for algorithm in (ChecksumAlgorithm.XXHASH, ChecksumAlgorithm.CRC32C):
        try:
            _digest_fn(algorithm)
            return algorithm
        except ImportError:
            continue
    return ChecksumAlgorithm.CRC32
