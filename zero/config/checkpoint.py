"""``checkpoint``: how checkpoints are written and checked (read by the engine)."""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import Field, model_validator

from .base import StrictModel, raise_problems
from .values import Choice, FileMode, Flag, Int


class ParallelWriteConfig(StrictModel):
    pipeline_stage: Flag = False


class CheckpointWriterConfig(StrictModel):
    """``checkpoint.writer``: how checkpoint bytes reach the disk (DeepSpeed's FastPersist keys).

    ``fast`` writes through nvmeio's FastFileWriter (an aio_handle, O_DIRECT,
    ``io_buffer_size`` bytes per locked buffer, two of them with
    ``io_buffer_double``) and copies state already in NVMe swap files file to
    file; ``python`` writes with plain buffered Python file I/O. With ZeRO-3
    every rank writes only its own partitions (and rank 0 the few replicated
    files), so ``data_parallel`` (replica / socket / machine: which ranks share
    the writing of replicated state in DeepSpeed) changes nothing here.
    """

    type: Choice("fast", "python", "mock", what="checkpoint.writer.type") = "fast"
    decoupled: Flag = False
    io_buffer_size: Int(minimum=4096) = 64 * 1024 * 1024
    io_buffer_double: Flag = True
    show_statistics: Flag = False
    data_parallel: Optional[Choice("replica", "socket", "machine", what="checkpoint.writer.data_parallel")] = None
    io_multiplier: Int(minimum=1) = 1

    @model_validator(mode="after")
    def _check(self) -> "CheckpointWriterConfig":
        problems = []
        if self.type == "mock":
            problems.append((("type",), "checkpoint.writer.type 'mock' writes nothing (DeepSpeed's mode for "
                             "timing the rest of a save): its checkpoints could not be loaded; use 'fast' "
                             "or 'python'", "mock"))
        if self.decoupled:
            problems.append((("decoupled",), "checkpoint.writer.decoupled (writing from a background "
                             "process while training goes on) is not supported; set it to false (saves "
                             "run at disk speed in the training process)", True))
        if self.io_multiplier != 1:
            problems.append((("io_multiplier",), "checkpoint.writer.io_multiplier repeats every write to "
                             "simulate a faster disk (a DeepSpeed benchmarking knob); nvmeio writes each "
                             "byte once: only 1 is accepted", self.io_multiplier))
        raise_problems(type(self).__name__, problems)
        return self


class CheckpointConfig(StrictModel):
    """``checkpoint``: how checkpoints are written and checked."""

    _inert: ClassVar[frozenset[str]] = frozenset({"load_universal", "parallel_write"})

    use_node_local_storage: Flag = False
    """The save directory is on each node's own storage (no shared file system): each node's
    first rank (LOCAL_RANK 0) writes the shared files (``latest``, ``zero_meta.json``,
    ``buffers.pt``) into its node's copy, every rank its own shards, and a load reads only its
    node's copy (zero/checkpoint/storage.py, [Note: node-local storage])."""
    tag_validation: Choice("Ignore", "Warn", "Fail", what="tag_validation") = "Warn"
    """What to do when ranks disagree on the checkpoint tag."""
    load_universal: Flag = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    writer: CheckpointWriterConfig = Field(default_factory=CheckpointWriterConfig)
    """How the bytes are written (see :class:`CheckpointWriterConfig`)."""
    file_mode: FileMode = 0o600
    """Permissions of the files a checkpoint writes (an octal string, e.g. "0640"); its
    directories get the same bits plus search (x) where read is set: 0700 by default."""

    @property
    def dir_mode(self) -> int:
        mode = self.file_mode
        return mode | ((mode & 0o444) >> 2)
