"""SpanPool: one allocation handed out as page-aligned spans, each sized to its request.

[Note: read-ahead bounded by bytes, not by buffers]
A pool of whole buffers sized for the largest tensor holds as few small tensors
as large ones. A 1.1B Llama's units are 2-46 MB linears beside a 262 MB
embedding, so ten such buffers (2.6 GB) held ten units: about one layer read
ahead, and the disk idled between them (bench/RESULTS.md, "ZeRO-Inference
beyond memory"). This pool makes the same one allocation at construction and
never grows, but gives each request a span of its own size, rounded up to 4096
bytes so that every span starts aligned for O_DIRECT: the same memory holds
as many bytes of small tensors in flight as of large ones.

Spans are placed next-fit: each at the first free run at or after the end of
the one placed last, wrapping at the end of the region. A cyclic trace frees
its spans nearly in the order they were taken, so the region works as a ring
and the frees coalesce behind the ring's head into one run.

The last ``spare_bytes`` are a region of their own. Only ``spare=True``
requests use it, and only when the main region has no room: callers that
must not fail for want of read-ahead's memory (a fetch that was not read
ahead, a write). Read-ahead and spans lent out for long take the main region
only (``spare=False``), so a blocking request finds its span in the spare
region once that region's short-lived holders are back, however fragmented
the main region is.
"""
from __future__ import annotations

import bisect
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ._buffer_pool import PoolBuffer, StagingPool, allocate_staging
from ._errors import PoolExhaustedError, SwapStateError
from .host_memory import PAGE_BYTES, align_up, format_bytes

HOLDERS_NAMED = 8  # an exhaustion message names this many holders, then counts the rest


@dataclass(eq=False)
class PoolSpan(PoolBuffer):
    """A span of a :class:`SpanPool`: ``tensor`` is its bytes (uint8), from ``offset`` in the pool;
    ``spare`` when it lies in the pool's spare region (see the note)."""

    offset: int = 0

    @property
    def name(self) -> str:
        return f"span at byte {self.offset}"


class _Region:
    """Free runs ``[start, end)`` of one region, sorted, coalesced; spans placed next-fit."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.runs: List[Tuple[int, int]] = [(start, end)] if end > start else []
        self.cursor = start  # the end of the span placed last

    @property
    def size(self) -> int:
        return self.end - self.start

    def free_bytes(self) -> int:
        return sum(e - s for s, e in self.runs)

    def largest_run(self) -> int:
        return max((e - s for s, e in self.runs), default=0)

    def place(self, size: int) -> Optional[int]:
        """Where a span of ``size`` bytes goes (taken), or None when no free run holds it."""
        n = len(self.runs)
        if not n:
            return None
        first = next((i for i, (_, e) in enumerate(self.runs) if e > self.cursor), 0)
        for k in range(n + 1):  # the run holding the cursor is tried from the cursor, then (k == n) whole
            s, e = self.runs[(first + k) % n]
            pos = self.cursor if k == 0 and s < self.cursor < e else s
            if e - pos >= size:
                self._take((first + k) % n, pos, size)
                return pos
        return None

    def _take(self, i: int, pos: int, size: int) -> None:
        s, e = self.runs.pop(i)
        rest = [r for r in ((s, pos), (pos + size, e)) if r[1] > r[0]]
        self.runs[i:i] = rest
        self.cursor = pos + size if pos + size < self.end else self.start

    def give_back(self, pos: int, size: int) -> None:
        i = bisect.bisect_left(self.runs, (pos, pos + size))
        s, e = pos, pos + size
        if i < len(self.runs) and self.runs[i][0] == e:  # coalesce with the run after it
            e = self.runs.pop(i)[1]
        if i > 0 and self.runs[i - 1][1] == s:  # and with the one before it
            s = self.runs.pop(i - 1)[0]
            i -= 1
        self.runs.insert(i, (s, e))


def device_storage(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of memory on ``device`` (uint8) starting on a 4096-byte boundary, as host spans do."""
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, device=device)
    start = -raw.data_ptr() % PAGE_BYTES
    return raw[start:start + nbytes]


def _unpin_device(handle, storage: torch.Tensor) -> None:
    handle.unpin_device_tensor(storage)


class SpanPool(StagingPool):
    """``nbytes`` of page-aligned host memory (locked when ``pin_memory``, else on transparent
    huge pages) handed out as spans of the sizes asked for; the last ``spare_bytes`` for
    ``spare=True`` requests only (see the note). Memory: ``nbytes`` rounded up to 4096, from
    construction until :meth:`close`; nothing is allocated afterwards.

    With ``device`` (a CUDA device) the memory is that device's instead, registered with cuFile
    through ``handle`` where it is a ``gds_handle``: NVMe reads and writes of the spans go
    between the drive and the GPU (a swapper with ``aio.use_gds``: swapper/_pool_kind.py
    [Note: a parameter pool on the GPU])."""

    def __init__(self, nbytes: int, spare_bytes: int = 0, *, pin_memory: bool = True, handle=None,
                 device: Optional[torch.device] = None):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        if isinstance(spare_bytes, bool) or not isinstance(spare_bytes, int) or not 0 <= spare_bytes <= nbytes:
            raise ValueError(f"spare_bytes must be an integer from 0 to nbytes ({nbytes}), got {spare_bytes!r}")
        self.nbytes = align_up(nbytes)
        self.spare_bytes = align_up(spare_bytes)
        self.pin_memory = pin_memory
        what = f"SpanPool(nbytes={nbytes}, spare_bytes={spare_bytes})"
        self.device = device
        if device is None:
            self._storage, self._finalizer, self._handle = allocate_staging(self, self.nbytes, what, pin_memory,
                                                                            handle)
        else:
            self._storage, self._finalizer, self._handle = device_storage(self.nbytes, device), None, handle
            if hasattr(handle, "pin_device_tensor"):
                try:
                    handle.pin_device_tensor(self._storage)
                except RuntimeError as error:  # cuFile's BAR1 or pinned-memory limit: it bounces instead
                    warnings.warn(f"nvmeio: the GPU swap pool ({format_bytes(self.nbytes)}) could not be registered "
                                  f"with cuFile ({error}); its I/O goes on through cuFile's own buffers",
                                  RuntimeWarning, stacklevel=3)
                else:
                    self._finalizer = weakref.finalize(self, _unpin_device, handle, self._storage)
        self._main = _Region(0, self.nbytes - self.spare_bytes)
        self._spare = _Region(self.nbytes - self.spare_bytes, self.nbytes)
        self._held: Dict[int, PoolSpan] = {}  # by offset
        self._cond = threading.Condition()
        self._closed = False

    def register_with_cuda(self, backend=None) -> Optional[str]:
        if self.device is not None:
            return None  # device memory: nothing to register for copies
        return super().register_with_cuda(backend)

    def __repr__(self) -> str:
        return (f"SpanPool({format_bytes(self.nbytes)}, spare {format_bytes(self.spare_bytes)}, "
                f"free {format_bytes(self.free_bytes)} in {len(self._main.runs) + len(self._spare.runs)} runs"
                f"{', pinned' if self.pin_memory else ''})")

    @property
    def main_bytes(self) -> int:
        """Bytes outside the spare region: all that read-ahead and loans may hold at once."""
        return self._main.size

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return self._main.free_bytes() + self._spare.free_bytes()

    @property
    def held_bytes(self) -> int:
        return self.nbytes - self.free_bytes

    @staticmethod
    def span_bytes(nbytes: int) -> int:
        """The bytes a request for ``nbytes`` takes: whole pages, at least one."""
        return align_up(max(1, nbytes))

    def acquire(self, sizes: Sequence[int], *, holder: str = "", spare: bool = True,
                timeout: Optional[float] = 0.0) -> List[PoolSpan]:
        """A span of at least ``sizes[i]`` bytes for each i, all or none; ``spare`` lets them use
        the spare region when the main one has no room.

        ``timeout=0`` raises :class:`PoolExhaustedError` at once when they do not fit now; a
        positive timeout waits that many seconds for other threads to release spans; ``None``
        waits without limit. Asking for more than the pool could ever hold raises at once.
        """
        wanted = [self.span_bytes(n) for n in sizes]
        self._refuse_impossible(wanted, holder, spare)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open()
            while True:
                placed = self._place_all(wanted, spare, keep=True)
                if len(placed) == len(wanted):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolExhaustedError(self._exhausted(wanted, holder, spare, timeout))
                self._cond.wait(remaining)
                self._check_open()
            spans = []
            for (pos, in_spare), size in zip(placed, wanted):
                span = PoolSpan(index=pos // PAGE_BYTES, tensor=self._storage[pos:pos + size],
                                holder=holder or "caller", offset=pos, spare=in_spare)
                self._held[pos] = span
                spans.append(span)
            return spans

    def take(self, sizes: Sequence[int], *, holder: str = "", spare: bool = True) -> List[PoolSpan]:
        """:meth:`acquire` without waiting (:class:`~swapper.StagingPool`)."""
        return self.acquire(sizes, holder=holder, spare=spare)

    def fits(self, sizes: Sequence[int], *, spare: bool = False) -> int:
        """How many of ``sizes``, from the first, :meth:`acquire` would place now (taking nothing)."""
        with self._cond:
            self._check_open()
            return len(self._place_all([self.span_bytes(n) for n in sizes], spare, keep=False))

    def release(self, spans: Iterable[PoolSpan]) -> None:
        """Give spans back. Releasing one that is not out is an error."""
        with self._cond:
            for span in spans:
                if self._held.get(span.offset) is not span:
                    raise SwapStateError(f"{span.name} released twice or not from this pool")
                del self._held[span.offset]
                span.holder = None
                region = self._spare if span.spare else self._main
                region.give_back(span.offset, span.nbytes)
            self._cond.notify_all()

    def close(self) -> None:
        """Free the memory. Every span must be back: their tensors die with the pool."""
        with self._cond:
            if self._closed:
                return
            if self._held:
                raise SwapStateError(f"cannot close the pool while spans are held by: {self._holders()}")
            self._closed = True
            self._cond.notify_all()
        self._unregister_cuda()
        self._storage = None
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "SpanPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _place_all(self, sizes: List[int], spare: bool, keep: bool) -> List[Tuple[int, bool]]:
        """Places ``sizes`` in order until one does not fit; returns (offset, in spare region) of
        those placed. All are given back unless ``keep`` and every one was placed."""
        regions = [self._main, self._spare] if spare else [self._main]
        cursors = [r.cursor for r in regions]
        placed: List[Tuple[int, bool]] = []
        for size in sizes:
            where = next(((pos, r is self._spare) for r in regions for pos in [r.place(size)] if pos is not None),
                         None)
            if where is None:
                break
            placed.append(where)
        if not keep or len(placed) < len(sizes):
            for (pos, in_spare), size in zip(placed, sizes):
                (self._spare if in_spare else self._main).give_back(pos, size)
            for r, c in zip(regions, cursors):
                r.cursor = c
        return placed

    def _refuse_impossible(self, sizes: List[int], holder: str, spare: bool) -> None:
        who = holder or "caller"
        capacity = self.nbytes if spare else self.main_bytes
        region = max(self._main.size, self._spare.size) if spare else self._main.size
        where = "" if spare or not self.spare_bytes else " outside its spare region"
        if sum(sizes) > capacity:
            raise PoolExhaustedError(
                f"{who} asks for {sum(sizes)} bytes at once, but the pool has only {capacity}{where}; "
                f"raise buffer_count")
        if max(sizes, default=0) > region:
            raise PoolExhaustedError(
                f"{who} asks for a span of {max(sizes)} bytes, but the pool's largest region{where} is "
                f"{region} bytes; raise buffer_count")

    def _exhausted(self, sizes: List[int], holder: str, spare: bool, timeout: Optional[float]) -> str:
        regions = [self._main, self._spare] if spare else [self._main]
        free = sum(r.free_bytes() for r in regions)
        capacity = sum(r.size for r in regions)
        message = (f"{holder or 'caller'} asks for {sum(sizes)} bytes but only {free} of {capacity} are free"
                   + (f" after waiting {timeout:g} s" if timeout else ""))
        if free >= sum(sizes):
            message += f" (fragmented: the largest free run is {max(r.largest_run() for r in regions)} bytes)"
        return message + f"; held by: {self._holders()}. Release buffers first or raise buffer_count"

    def _holders(self) -> str:
        spans = sorted(self._held.values(), key=lambda s: s.offset)
        named = ", ".join(f"{s.holder or '?'} ({s.nbytes} bytes)" for s in spans[:HOLDERS_NAMED])
        more = len(spans) - HOLDERS_NAMED
        return named + (f", and {more} more" if more > 0 else "")

    def _check_open(self) -> None:
        if self._closed:
            raise SwapStateError("the buffer pool is closed")

