"""How a checkpoint's bytes move (``checkpoint.writer``); save.py decides what is written.

Every file goes through nvmeio: with ``type: fast`` (the default) one
:class:`nvmeio.FastIO` (an aio_handle and ``io_buffer_size`` locked buffers,
two with ``io_buffer_double``) writes all the files of one save in turn, each
atomically; ``type: python`` writes with plain buffered file I/O.

[Note: sub-group shards are safetensors in the swap files' layout]
A sub-group's shard holds its fp32 ``master`` and optimizer states as one
safetensors file laid out exactly as a swap file of the optimizer swapper: a
4096-byte header page, then each tensor followed by filler (``__pad__.<name>``,
uint8) up to a 4096-byte boundary. So a swap file can itself become the shard:
the header goes into its header page and a hard link puts it in the
checkpoint; no byte moves, and the swapper writes its next swap-out to a new
file, leaving the checkpoint's untouched (swapper/_sub_group.py [Note: the header
page]); a load on the same layout links the shard back as the swap file and
reads only the masters (for the parameters). The gradient written during
backward has a file of its own, so nothing writes a linked file again. Where
no link can be made (another file system), the bytes are copied: read O_DIRECT
into the writer's locked buffers and written O_DIRECT into a file allocated
whole up front (``type: fast``; faster on ext4 than ``copy_file_range``, which
copies through the page cache and must then be fsynced: bench/checkpoint_io.py,
bench/RESULTS.md) or by ``copy_file_range`` (``type: python``); on load, where
no link can be made, read straight into the swapper's pool buffer and written
to a staging swap file as it arrives (load.py [Note: verified while loading]).
State in memory is written through the writer.

[Note: checksums travel with the state]
With swap checksums on, the swapper recorded a digest of each tensor when it
wrote the state; the shard carries them in its metadata (``checksum``: the
algorithm, ``checksum.<name>``: hex digests), so a save links or copies the
bytes without reading them. A load reads every shard it uses front to back
before it changes anything and refuses one whose bytes differ
(:class:`CheckpointCorruptionError`, naming file and tensor); where the store
stages shards, that read is the load itself, each byte read once (load.py
[Note: verified while loading]). A shard linked back as a swap file keeps
its digests, which the swapper verifies at each swap-in. Damage to a swap file between its write and a save is therefore
caught by the load of that checkpoint (and by the next swap-in of the
sub-group), not by the save: verifying at save would mean reading every byte,
which is what made saves slow, and would not cover damage after the save.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from nvmeio import FastFileReader, FastIO, FastIOStats, PlainFileWriter, SafetensorsReader, SafetensorsWriter, StripedFile
from nvmeio.safetensors_file import encode_header
from swapper.checksum import ChecksumAlgorithm, digest_chunks

from .format import MAX_STRIPES, STRIPE_UNIT, STRIPES, CheckpointCorruptionError, open_shard, shard_part

SHARD_METADATA = {"format": "nvmeio-zero3-subgroup"}
CHECKSUM = "checksum"  # metadata: the algorithm; "checksum.<name>": each tensor's digest (hex)
HEADER_BYTES = 4096  # as the swapper's header page: shards and swap files share one layout
PAD = "__pad__."     # filler after each tensor, up to the next 4096-byte boundary


def checksum_metadata(checksums: Optional[Tuple[str, Mapping[str, int]]]) -> Dict[str, str]:
    """A shard's metadata, with (algorithm, digest of each tensor) where given."""
    meta = dict(SHARD_METADATA)
    if checksums is not None:
        meta[CHECKSUM] = checksums[0]
        meta.update({f"{CHECKSUM}.{name}": f"{digest:016x}" for name, digest in sorted(checksums[1].items())})
    return meta


def shard_checksums(shard: SafetensorsReader) -> Optional[Tuple[str, Dict[str, int]]]:
    """(algorithm, digest of each tensor) a shard carries; None for a shard without them."""
    meta = shard.metadata()
    if CHECKSUM not in meta:
        return None
    prefix = f"{CHECKSUM}."
    try:
        algorithm = ChecksumAlgorithm.coerce(meta[CHECKSUM])
        digests = {k[len(prefix):]: int(v, 16) for k, v in meta.items() if k.startswith(prefix)}
    except ValueError as error:
        raise CheckpointCorruptionError(f"checkpoint shard {shard.name} is damaged: its checksums cannot be "
                                        f"read ({error})") from None
    return algorithm.value, digests


def check_digests(path: str, carried: Tuple[str, Mapping[str, int]], keys: Sequence[str],
                  actual: Mapping[str, int]) -> None:
    """``actual`` (the digest of each of ``keys``, computed as the shard was read) equals what
    the shard carries; else :class:`CheckpointCorruptionError` naming the file and the tensor."""
    algorithm, digests = carried
    for key in keys:
        if key not in digests:
            raise CheckpointCorruptionError(f"checkpoint shard {path} is damaged: it carries checksums "
                                            f"but none of {key!r}")
        if actual[key] != digests[key]:
            raise CheckpointCorruptionError(
                f"checkpoint shard {path} is damaged: {algorithm} of {key!r} is {actual[key]:016x}, "
                f"saved as {digests[key]:016x}; nothing was loaded")


def _may_link(source, path: str) -> bool:
    """Whether to offer ``source`` (a swap file) to be linked as the shard ``path``: a plain
    file always (the link itself says whether it can be made); a striped one where one of its
    parts is on the checkpoint's file system (else one plain file is copied: format.py [Note:
    striped shards])."""
    if not isinstance(source, StripedFile):
        return True
    if not 2 <= len(source.parts) <= MAX_STRIPES:
        return False
    device = os.stat(os.path.dirname(path)).st_dev
    return any(os.stat(p).st_dev == device for p in source.parts)


def shard_spec(numel: int, names: Sequence[str]) -> Dict[str, Tuple[torch.dtype, Tuple[int]]]:
    """A shard's tensors: each name's fp32 values, then filler to a 4096-byte boundary."""
    tensor_bytes = numel * 4
    pad = -tensor_bytes % 4096
    spec: Dict[str, Tuple[torch.dtype, Tuple[int]]] = {}
    for name in names:
        spec[name] = (torch.float32, (numel,))
        if pad:
            spec[PAD + name] = (torch.uint8, (pad,))
    return spec


class CheckpointIO:
    """The writers and readers of one save or load, per ``checkpoint.writer``."""

    def __init__(self, writer_config):
        self.config = writer_config
        self.io: Optional[FastIO] = None
        if writer_config.type == "fast":
            self.io = FastIO(writer_config.io_buffer_size, writer_config.io_buffer_double)
        self.stats = self.io.stats if self.io is not None else FastIOStats()

    def writer(self, path: str):
        """An atomic file-like writer of ``path``."""
        if self.io is not None:
            return self.io.writer(path)
        return PlainFileWriter(path, stats=self.stats)

    def save_object(self, obj, path: str) -> None:
        """``torch.save`` into ``path`` (atomic, fsynced)."""
        with self.writer(path) as f:
            torch.save(obj, f)

    def load_object(self, path: str, weights_only: bool):
        with self._reader(path) as f:
            return torch.load(f, map_location="cpu", weights_only=weights_only)

    def save_shard(self, path: str, numel: int, names: Sequence[str],
                   tensors: Optional[Mapping[str, torch.Tensor]] = None,
                   stored: Optional[Tuple[object, Dict[str, int]]] = None,
                   link: Optional[Callable[..., bool]] = None,
                   checksums: Optional[Tuple[str, Mapping[str, int]]] = None) -> None:
        """One sub-group's shard: ``tensors`` from memory, or ``stored`` = (swap file, byte
        offset of each name), taken by ``link(dest, header, copy)`` where it can (``dest``: the
        shard's path, or for a swap file striped over drives one path per part, a part that
        cannot be linked copied by ``copy(part, dest part)``: format.py [Note: striped
        shards]), else copied as one file; ``checksums`` (algorithm, digest of each name) go
        into its metadata."""
        spec = shard_spec(numel, names)
        metadata = checksum_metadata(checksums)
        if stored is not None and link is not None:
            source, dest, meta = stored[0], path, metadata
            if isinstance(source, StripedFile):
                dest = tuple(shard_part(path, k) for k in range(len(source.parts)))
                meta = {**metadata, STRIPES: str(len(source.parts)), STRIPE_UNIT: str(source.unit)}
            header, infos = encode_header(spec, meta, HEADER_BYTES)
            if (len(header) == HEADER_BYTES and _may_link(source, path)
                    and all(stored[1][n] == HEADER_BYTES + i.begin for n, i in zip(spec, infos)
                            if not n.startswith(PAD))):
                copied = self.stats.bytes_copied
                if link(dest, header, self.copy_file):  # parts it could not link it copied
                    self.stats.bytes_linked += max(0, infos[-1].end - (self.stats.bytes_copied - copied))
                    return
        _, infos = encode_header(spec, metadata, HEADER_BYTES)
        tensor_bytes = numel * 4
        with SafetensorsWriter(path, spec, metadata, file=self.writer(path),
                               data_alignment=HEADER_BYTES) as w:
            for info in infos:
                base = info.name[len(PAD):] if info.name.startswith(PAD) else info.name
                if stored is not None:
                    offset = stored[1][base] + (tensor_bytes if base != info.name else 0)
                    w.copy_from(info.name, stored[0], offset)
                elif base != info.name:
                    w.write(info.name, torch.zeros(info.nbytes, dtype=torch.uint8))
                else:
                    w.write(info.name, tensors[info.name])

    def copy_file(self, source: str, dest: str) -> None:
        """``dest`` becomes a copy of the file ``source``, file to file through the writer."""
        size = os.path.getsize(source)
        with self.writer(dest) as w:
            reserve = getattr(w, "reserve", None)
            if reserve is not None:
                reserve(size)
            w.copy_from(source, size, 0)

    def shard_reader(self, path: str) -> SafetensorsReader:
        return open_shard(path, io=self._read_io())

    def verify_shard(self, path: str, keys: Sequence[str]) -> bool:
        """Reads the tensors ``keys`` of a shard front to back (O_DIRECT, never whole in
        memory) and checks them against the checksums it carries: a mismatch raises
        :class:`CheckpointCorruptionError` naming the file and the tensor. False for a
        shard saved without checksums (nothing to check against)."""
        with self.shard_reader(path) as shard:
            carried = shard_checksums(shard)
            if carried is None:
                return False
            algorithm = ChecksumAlgorithm(carried[0])
            check_digests(path, carried, keys, {k: digest_chunks(algorithm, shard.views(k)) for k in keys})
        return True

    def _reader(self, path: str) -> FastFileReader:
        size = os.path.getsize(path)
        if self.io is None or not self.io.buffers_made:
            if size < self.config.io_buffer_size:
                # A small file (engine.pt, buffers.pt) on a buffer of its size: locking the
                # writer's two io_buffer_size buffers for it cost more than reading it (~0.17 s
                # for 2 x 64 MiB), and a staged load needs them for nothing else.
                return FastFileReader(path, buffer_size=max(4096, size), double_buffer=False)
        return FastFileReader(path, io=self._read_io())

    def _read_io(self) -> FastIO:
        if self.io is None:  # reading is always direct; "python" names how writes are done
            self.io = FastIO(self.config.io_buffer_size, self.config.io_buffer_double)
            self.io.stats = self.stats
        return self.io

    def close(self, what: str, rank: int) -> None:
        if self.io is not None:
            self.io.close()
        if self.config.show_statistics:
            logging.getLogger("zero").info("rank %d %s (checkpoint.writer %s): %s", rank, what,
                                           self.config.type, self.stats.summary())
