"""Files striped over several directories, one per drive: RAID-0 without RAID.

    f = StripedFile(("/nvme0/x.swp", "/nvme1/x.swp"), unit=stripe_unit(1 << 20))
    h.async_pwrite(tensor, f, file_offset)   # any aio_handle op that takes a path
    h.wait()

[Note: striping]
A :class:`StripedFile` is one logical file kept as one plain file (a *part*) per drive. Its
bytes are cut into stripe units of ``unit`` bytes: unit ``i`` lives in part ``i % N`` at
``(i // N) * unit``, so the mapping of a byte never depends on how the file is read or
written (a swapper writes a sub-group whole and reads it whole, writes a unit's partitions
one by one and reads them packed). An ``aio_handle`` op on a striped file is cut at unit
boundaries into one op per unit (:meth:`StripedFile.pieces`), submitted in the file's order,
so every drive has its share of the requests in flight whatever the op's size, and ``wait()``
completes the op once all of its pieces are done.

Why one handle for all drives, not one per drive: a piece of ``unit`` = ``block_size``
bytes is one request, and the handle hands consecutive ops to its worker threads in turn,
each keeping ``queue_depth`` requests in flight from all the ops it holds, so consecutive
pieces (consecutive drives) are in flight together. A queue per drive would multiply the
worker threads and the registered buffers of every handle by the number of drives and gain
nothing on drives of one speed; the swappers already keep one handle per direction (and per
read batch), which is the queue that matters (swapper/_io_queue.py). bench/drives.py measures
the aggregate against N times one drive.

Why the unit is the block size: a smaller unit splits requests, a larger one leaves drives idle
on ops smaller than ``N * unit`` (a parameter partition of a few MiB). ``stripe_unit`` is the
handle's block size rounded up to a page, at least 64 KiB.

Each part is an ordinary file, so what a drive says goes with its name: an error of a piece
is raised with the part's path (its drive's directory), a part that is missing or too short
is refused before any piece is submitted, and a write allocates each part's new range first
(:func:`preallocate_parts`), so a full drive is an error naming it before any byte is written.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Collection, Dict, List, NamedTuple, Sequence, Tuple

from .errors import make_error
from .file_ops import preallocate

__all__ = ["StripedFile", "Piece", "stripe_unit", "MIN_STRIPE_UNIT", "file_size", "fspath", "preallocate_parts",
           "check_parts_readable"]

_ALIGN = 4096
MIN_STRIPE_UNIT = 64 << 10


def stripe_unit(block_size: int) -> int:
    """The stripe unit for handles of ``block_size`` bytes per request (see [Note: striping])."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return max(MIN_STRIPE_UNIT, -(-block_size // _ALIGN) * _ALIGN)


class Piece(NamedTuple):
    """One unit's share of an op: ``length`` bytes at ``start`` in the op's buffer, at
    ``file_offset`` in part ``part``."""

    part: int
    file_offset: int
    start: int
    length: int


@dataclass(frozen=True)
class StripedFile:
    """One logical file striped over ``parts`` (one path per drive, in stripe order) in units
    of ``unit`` bytes (a positive multiple of 4096). Hashable: it keys checksum tables as a
    path does. Not a path (no ``__fspath__``): ``os`` functions refuse it rather than act on
    one part."""

    parts: Tuple[str, ...]
    unit: int

    def __post_init__(self):
        parts = tuple(os.fsdecode(os.fspath(p)) for p in self.parts)
        if not parts:
            raise ValueError("a striped file needs at least one part")
        if len(set(parts)) != len(parts):
            raise ValueError(f"a striped file names a part twice: {parts}")
        if isinstance(self.unit, bool) or not isinstance(self.unit, int) or self.unit <= 0 or self.unit % _ALIGN:
            raise ValueError(f"stripe unit must be a positive multiple of {_ALIGN}, got {self.unit!r}")
        object.__setattr__(self, "parts", parts)

    def __str__(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0]
        return f"{self.parts[0]} (striped over {len(self.parts)} drives: {', '.join(self.drives)})"

    @property
    def name(self) -> str:
        """The file's name (every part has it, in its own directory)."""
        return os.path.basename(self.parts[0])

    @property
    def drives(self) -> List[str]:
        """The directory of each part."""
        return [os.path.dirname(p) for p in self.parts]

    def pieces(self, offset: int, nbytes: int) -> List[Piece]:
        """``[offset, offset + nbytes)`` cut at unit boundaries, in the file's order."""
        n, unit = len(self.parts), self.unit
        out: List[Piece] = []
        pos, end = offset, offset + nbytes
        while pos < end:
            index, within = divmod(pos, unit)
            length = min(unit - within, end - pos)
            out.append(Piece(index % n, (index // n) * unit + within, pos - offset, length))
            pos += length
        return out

    def part_ends(self, offset: int, nbytes: int) -> Dict[int, int]:
        """For each part an op on ``[offset, offset + nbytes)`` touches, the part's end offset."""
        ends: Dict[int, int] = {}
        for p in self.pieces(offset, nbytes):
            ends[p.part] = max(ends.get(p.part, 0), p.file_offset + p.length)
        return ends

    def part_bytes(self, size: int) -> List[int]:
        """How many bytes each part holds of a logical file of ``size`` bytes."""
        n, unit = len(self.parts), self.unit
        full, rest = divmod(size, unit)
        out = [(full // n + (1 if k < full % n else 0)) * unit for k in range(n)]
        if rest:
            out[full % n] += rest
        return out

    def size_from_parts(self, sizes: Sequence[int]) -> int:
        """The logical size whose bytes parts of ``sizes`` hold (the furthest byte any has)."""
        n, unit, size = len(self.parts), self.unit, 0
        for k, s in enumerate(sizes):
            if s > 0:
                units, rest = divmod(s, unit)
                last = units * n + k if rest else (units - 1) * n + k
                size = max(size, last * unit + (rest or unit))
        return size

    def size(self) -> int:
        """The logical size on disk now (a missing part holds nothing)."""
        sizes = []
        for p in self.parts:
            try:
                sizes.append(os.stat(p).st_size)
            except FileNotFoundError:
                sizes.append(0)
        return self.size_from_parts(sizes)

    def exists(self) -> bool:
        """Whether every part exists."""
        return all(os.path.exists(p) for p in self.parts)


def fspath(path):
    """``os.fspath(path)``, a :class:`StripedFile` kept as it is (where either may be given)."""
    return path if isinstance(path, StripedFile) else os.fspath(path)


def file_size(path) -> int:
    """The size of a file or the logical size of a :class:`StripedFile`; 0 where it is missing."""
    if isinstance(path, StripedFile):
        return path.size()
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def check_parts_readable(f: StripedFile, offset: int, nbytes: int) -> None:
    """Refuses, naming the part (its drive), a read of ``[offset, offset + nbytes)`` that a
    missing or short part cannot serve; nothing is submitted before this passes."""
    for k, end in sorted(f.part_ends(offset, nbytes).items()):
        path = f.parts[k]
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise make_error(e.errno, f"open for reading failed: {e.strerror} (part {k + 1} of {len(f.parts)} "
                             f"of a striped file, on drive {os.path.dirname(path)})", path, offset, nbytes) from None
        if size < end:
            raise make_error(errno.ENODATA, f"short read: part {k + 1} of {len(f.parts)} of a striped file "
                             f"(drive {os.path.dirname(path)}) holds {size} bytes, but the read needs {end}",
                             path, offset, nbytes)


def preallocate_parts(f: StripedFile, offset: int, nbytes: int, skip: Collection[int] = ()) -> None:
    """Allocates the range each part needs for a write of ``[offset, offset + nbytes)``
    (creating a missing part, 0600; every part holds its share of the bytes before the op),
    so that the pieces overwrite allocated blocks in
    parallel ([Note: preallocating extending writes], native/file.h) and a full or missing
    drive is an error naming it before any piece is submitted. On an error the parts
    extended here get their old sizes back, the parts created here are removed. The parts
    in ``skip`` are left alone (a caller writing none of their pieces)."""
    done: List[Tuple[str, int, int, bool]] = []  # (path, fd, old size, created)
    if nbytes == 0:
        return  # an empty write never extends a file
    try:
        # Every part takes its share of [0, offset + nbytes): a gap before the op reads as zeros,
        # as in a plain file, even in a part the op does not touch.
        for k, end in enumerate(f.part_bytes(offset + nbytes)):
            if k in skip:
                continue
            path = f.parts[k]
            where = f"part {k + 1} of {len(f.parts)} of a striped file, on drive {os.path.dirname(path)}"
            created = False
            try:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    created = True
            except OSError as e:
                why = e.strerror
                if e.errno == errno.ENOENT:
                    why = f"directory '{os.path.dirname(path)}' does not exist"
                raise make_error(e.errno, f"open for writing failed: {why} ({where})", path, offset, nbytes) from None
            st = os.fstat(fd)
            done.append((path, fd, st.st_size, created))
            if end == 0:
                continue
            if end > st.st_size:
                try:
                    preallocate(fd, st.st_size, end - st.st_size, path)
                except OSError as e:
                    raise make_error(e.errno, f"preallocating the file range failed: {os.strerror(e.errno)} "
                                     f"({where})", path, offset, nbytes) from None
    except BaseException:
        for path, fd, old, created in done:
            if created:
                os.unlink(path)
            else:
                os.ftruncate(fd, old)
        raise
    finally:
        for _path, fd, _old, _created in done:
            os.close(fd)
