"""Staging a sub-group's state from other files: read once, hashed as it streams in.

[Note: a staged load reads each byte once]
Loading a sub-group's state from a checkpoint shard used to read the shard
twice: once to check its bytes against the digests it carries, then again
into the swapper (or, where the shard is linked as the swap file, its master
again for the parameters). A staged load reads the shard's regions once,
front to back, into a pool buffer, ``CHUNK_BYTES`` at a time: while the disk
fills chunk i + 1, chunk i is hashed (the digest functions release the GIL,
and the handle's threads hold none) and, where the bytes must be copied
(no hard link possible), written to a staging file beside the swap file on
a second handle. Nothing the swapper serves changes: the staging file has a
name of its own, and the caller publishes it (a rename over the swap file)
only once every digest matched, everywhere (zero/checkpoint/load.py). The buffer
is kept until then where the pool allows, so the master comes from memory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch

from nvmeio import StripedFile
from nvmeio.file_ops import open_direct, preallocate
from nvmeio.striping import preallocate_parts

from ._buffer_pool import PoolBuffer
from .checksum import ChecksumAlgorithm, StreamingDigest

# One read op of a handle; the digest of one overlaps the reads of the next two. 128 MiB read
# ~10% faster than 64 MiB here (bench/checkpoint_io.py's disk; fewer waits between ops).
CHUNK_BYTES = 128 << 20


@dataclass(frozen=True)
class StagedRegion:
    """One tensor: ``nbytes`` hashed bytes at ``source`` = (path or StripedFile, byte offset), landing at
    ``buffer_offset`` of the buffer (and of the staging file); ``span`` bytes are moved (the
    tensor and its filler up to a 4096-byte boundary, where the source holds them)."""

    name: str
    source: Tuple[Union[str, StripedFile], int]
    buffer_offset: int
    nbytes: int
    span: int


@dataclass(eq=False)
class StagedState:
    """A sub-group's state staged for :meth:`~swapper.PartitionedOptimizerSwapper.publish_staged`."""

    sub_group_id: int
    file_name: str  # the staging file in the swap directory
    linked: bool  # the staging file is a hard link of the source (no byte was written)
    digests: Dict[str, int] = field(default_factory=dict)  # of each region, by the caller's algorithm
    buffer: Optional[PoolBuffer] = None  # holds the staged bytes until published (or dropped)
    bytes_read: int = 0
    bytes_written: int = 0


def _chunks(regions: Sequence[StagedRegion]) -> List[Tuple[int, int, int]]:
    """(region index, offset inside the region, length) of every read, in order."""
    out = []
    for i, r in enumerate(regions):
        for start in range(0, r.span, CHUNK_BYTES):
            out.append((i, start, min(CHUNK_BYTES, r.span - start)))
    return out


def stream_regions(reads: Sequence, writes, raw: torch.Tensor, regions: Sequence[StagedRegion],
                   algorithm: Optional[ChecksumAlgorithm], dest: Union[str, StripedFile, None],
                   skip: Collection[int] = ()) -> Tuple[Dict[str, int], int]:
    """Reads ``regions`` into the byte tensor ``raw``, chunk k on handle ``reads[k % len(reads)]``
    (one chunk in flight per handle: with two, the disk never waits for the digest), hashing
    each with ``algorithm`` (None: no digest) and writing each chunk to file ``dest`` (None:
    none) on handle ``writes``, as the [Note] above describes; a striped ``dest`` is written
    but for its parts in ``skip`` (hard links of the source's: they hold the bytes already).
    Returns (digest of each region, bytes written). Every handle is idle on return, also
    after an error."""
    fds: Dict[object, object] = {}  # source file -> what its reads are submitted on
    out_fd = -1
    hashers = {r.name: StreamingDigest(algorithm) for r in regions} if algorithm is not None else {}
    written = 0
    pending = set()  # handles with an op in flight
    try:
        for r in regions:  # a striped source is read as it is: the handle cuts each read by part
            if r.source[0] not in fds:
                src = r.source[0]
                fds[src] = src if isinstance(src, StripedFile) else open_direct(src, os.O_RDONLY)[0]
        out = None  # where the chunks are written: out_fd, or a striped file (nvmeio/striping.py)
        if dest is not None:
            # One allocation of the whole file up front: direct writes into allocated blocks run
            # in parallel, and measured ~1.5x faster here than the handle allocating op by op.
            end = max(r.buffer_offset + r.span for r in regions)
            if isinstance(dest, StripedFile):
                preallocate_parts(dest, 0, end, skip=skip)
                out = dest
            else:
                out = out_fd = open_direct(dest, os.O_WRONLY)[0]
                preallocate(out_fd, 0, end, dest)
        chunks = _chunks(regions)

        def submit(k: int) -> None:
            i, start, n = chunks[k]
            r = regions[i]
            handle = reads[k % len(reads)]
            handle.async_pread(raw[r.buffer_offset + start:r.buffer_offset + start + n], fds[r.source[0]],
                               r.source[1] + start)
            pending.add(handle)

        for k in range(min(len(reads), len(chunks))):
            submit(k)
        for k, (i, start, n) in enumerate(chunks):
            handle = reads[k % len(reads)]
            pending.discard(handle)
            handle.wait()
            if k + len(reads) < len(chunks):
                submit(k + len(reads))
            r = regions[i]
            lo = r.buffer_offset + start
            if out is not None and skip:  # piece by piece, past the linked parts
                for piece in out.pieces(lo, n):
                    if piece.part not in skip:
                        pending.add(writes)
                        writes.async_pwrite(raw[lo + piece.start:lo + piece.start + piece.length],
                                            out.parts[piece.part], piece.file_offset)
                        written += piece.length
            elif out is not None:
                pending.add(writes)
                writes.async_pwrite(raw[lo:lo + n], out, lo)
                written += n
            hashed = min(n, r.nbytes - start)  # the filler after a tensor is not hashed
            if r.name in hashers and hashed > 0:
                hashers[r.name].update(memoryview(raw[lo:lo + hashed].numpy()))
        digests = {name: h.value() for name, h in hashers.items()}
        if writes in pending:
            pending.discard(writes)
            writes.wait()
    finally:
        for handle in pending:
            try:
                handle.wait()
            except OSError:
                pass  # the error raised already (or the one the caller sees) names the file
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)
        if out_fd >= 0:
            os.close(out_fd)
    return digests, written
