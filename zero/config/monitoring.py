"""Monitoring and profiling sections (``tensorboard``, ``wandb``, ``csv_monitor``,
``comms_logger``, ``flops_profiler``): DeepSpeed features nvmeio does not have, accepted so
that DeepSpeed files load unchanged. Their keys are still checked (a typo is an error), and
enabling one warns that it has no effect.
"""

from __future__ import annotations

from typing import ClassVar, List, Optional

from pydantic import Field

from .base import StrictModel
from .values import Flag, Int, PathText, Real


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
