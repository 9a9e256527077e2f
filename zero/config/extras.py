"""Top-level sections nvmeio accepts so that DeepSpeed files load unchanged.

``checkpoint`` is read by the engine. The monitoring and profiling sections
(``tensorboard``, ``wandb``, ``csv_monitor``, ``comms_logger``,
``flops_profiler``) and ``activation_checkpointing`` belong to DeepSpeed
features nvmeio does not have: their keys are still checked (a typo is still
an error), and enabling one warns that it has no effect.
"""

from __future__ import annotations

from typing import ClassVar, List, Optional

from pydantic import Field, model_validator

from .base import StrictModel, raise_problems
from .values import Choice, FileMode, Flag, Int, PathText, Real

DataType = Choice("fp16", "bf16", "fp32", what="data type", aliases={"bfp16": "bf16"})


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
    """Each node writes its ranks' shards to its own storage (no shared file system)."""
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


class DataTypesConfig(StrictModel):
    """``data_types``: dtype of gradient accumulation (None: the compute dtype)."""

    grad_accum_dtype: Optional[DataType] = None


class ActivationCheckpointingConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({
        "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})

    partition_activations: Flag = False
    contiguous_memory_optimization: Flag = False
    cpu_checkpointing: Flag = False
    number_checkpoints: Optional[Int(minimum=1)] = None
    synchronize_checkpoint_boundary: Flag = False
    profile: Flag = False


class FlopsProfilerConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: Flag = False
    recompute_fwd_factor: Real(minimum=0.0) = 0.0
    profile_step: Int(minimum=1) = 1
    module_depth: Int(minimum=-1) = -1
    top_modules: Int(minimum=1) = 1
    detailed: Flag = True
    output_file: Optional[PathText] = None


class _FileMonitorConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: Flag = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class TensorBoardConfig(_FileMonitorConfig):
    pass


class CSVMonitorConfig(_FileMonitorConfig):
    pass


class WandbConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: Flag = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CommsLoggerConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: Flag = False
    verbose: Flag = False
    prof_all: Flag = True
    debug: Flag = False
    prof_ops: List[str] = Field(default_factory=list)
