"""Top-level sections nvmeio accepts so that DeepSpeed files load unchanged.

``checkpoint`` is read by the engine. The monitoring and profiling sections
(``tensorboard``, ``wandb``, ``csv_monitor``, ``comms_logger``,
``flops_profiler``) and ``activation_checkpointing`` belong to DeepSpeed
features nvmeio does not have: their keys are still checked (a typo is still
an error), and enabling one warns that it has no effect.
"""

from __future__ import annotations

from typing import ClassVar, List, Optional

from pydantic import Field

from .base import StrictModel
from .values import Choice, Flag, Int, PathText, Real

DataType = Choice("fp16", "bf16", "fp32", what="data type", aliases={"bfp16": "bf16"})


class ParallelWriteConfig(StrictModel):
    pipeline_stage: Flag = False


class CheckpointConfig(StrictModel):
    """``checkpoint``: how checkpoints are written and checked."""

    _inert: ClassVar[frozenset[str]] = frozenset({"load_universal", "parallel_write"})

    use_node_local_storage: Flag = False
    """Each node writes its ranks' shards to its own storage (no shared file system)."""
    tag_validation: Choice("Ignore", "Warn", "Fail", what="tag_validation") = "Warn"
    """What to do when ranks disagree on the checkpoint tag."""
    load_universal: Flag = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)


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
