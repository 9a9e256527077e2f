"""How a checkpoint's bytes move (``checkpoint.writer``); checkpoint.py decides what is written.

Every file goes through nvmeio: with ``type: fast`` (the default) one
:class:`nvmeio.FastIO` (an aio_handle and ``io_buffer_size`` locked buffers,
two with ``io_buffer_double``) writes all the files of one save in turn, each
atomically; ``type: python`` writes with plain buffered file I/O.

[Note: sub-group shards are safetensors, copied from swap files]
A sub-group's shard holds its fp32 ``master`` and optimizer states as one
safetensors file whose data starts on a 4096-byte boundary. When the state
lives in NVMe swap files (``offload_optimizer.device: nvme``), its bytes go
from the swap file into the shard file to file, never through torch tensors:
with ``type: fast`` read O_DIRECT into the writer's locked buffers and
written O_DIRECT (measured 2-3x faster on ext4 than ``copy_file_range``,
which copies through the page cache and must then be fsynced); with
``type: python`` by ``copy_file_range`` (a reflink where the file system
shares blocks). A load on the same layout reads the shard's bytes straight
into the swapper's pool buffer and writes them out as a swap-out
(``import_state``). Otherwise tensors are written from memory.
"""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from nvmeio import FastIO, FastFileReader, SafetensorsReader, SafetensorsWriter
from nvmeio.fast_io import FastIOStats
from nvmeio.plain_writer import PlainFileWriter

SHARD_METADATA = {"format": "nvmeio-zero3-subgroup"}


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
                   stored: Optional[Tuple[str, Dict[str, int]]] = None) -> None:
        """One sub-group's shard: ``tensors`` from memory, or ``stored`` = (swap file,
        byte offset of each name) copied file to file."""
        spec = {name: (torch.float32, (numel,)) for name in names}
        with SafetensorsWriter(path, spec, SHARD_METADATA, file=self.writer(path),
                               data_alignment=4096) as w:
            for name in names:
                if stored is not None:
                    w.copy_from(name, stored[0], stored[1][name])
                else:
                    w.write(name, tensors[name])

    def shard_reader(self, path: str) -> SafetensorsReader:
        return SafetensorsReader(path, io=self._read_io())

    def _reader(self, path: str) -> FastFileReader:
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
