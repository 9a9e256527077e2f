"""The whole DeepSpeed JSON for the ZeRO engine (stages 0-3): :class:`DeepSpeedConfig`.

The top-level model holds the sections and the checks that span them (batch
sizes, fp16 with bf16, aio given twice). Once the config is valid it sets the
dotted path of every section and emits the notes its sections collected
(deprecated keys, inert settings) as warnings. :func:`validate_config` turns
pydantic's errors into one :class:`~.errors.ConfigError`.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Mapping, Optional

from pydantic import Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from .aio import AioConfig
from .base import StrictModel, join, problems_from, raise_problems, sections
from .batch import ACCUM, MICRO, TRAIN, derive_batch_sizes
from .errors import ConfigDeprecationWarning, ConfigError, IgnoredSettingWarning, Problem, short
from .activation_checkpointing import ActivationCheckpointingConfig, spill_offload
from .checkpoint import CheckpointConfig
from .monitoring import CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig, TensorBoardConfig, WandbConfig
from .optimizer import OptimizerConfig
from .precision import BF16Config, DataType, DataTypesConfig, FP16Config
from .scheduler import SchedulerConfig
from .values import AUTO, Flag, Int, Real, whole_number
from .zero_section import ZeroConfig


class DeepSpeedConfig(StrictModel):
    """A DeepSpeed config, validated (no ``zero_optimization`` section: stage 0, as in DeepSpeed).

    Build it with :func:`zero.config.load_config`. Sections are attributes
    (``config.zero_optimization.offload_param.device``); after loading, the
    three batch sizes are complete (see batch.py) and ``config.aio`` holds the
    aio settings wherever they were given.
    """

    _aliases: ClassVar[Mapping[str, str]] = {"bfloat16": "bf16"}
    _inert: ClassVar[frozenset[str]] = frozenset({
        "sparse_gradients", "disable_allgather", "dump_state", "memory_breakdown", "prescale_gradients",
        "zero_force_ds_cpu_optimizer"})
    _unsupported: ClassVar[Mapping[str, str]] = {
        "amp": ("NVIDIA Apex AMP is not supported by this engine; use fp16 / bf16 instead "
                "(\"bf16\": {\"enabled\": true}, or \"fp16\": {\"enabled\": true} with its loss scaling)"),
        "pipeline": ("pipeline parallelism is not supported by this engine: every rank holds the whole model "
                     "(partitioned by ZeRO); remove the section"),
        "tensor_parallel": ("tensor parallelism (AutoTP) is not supported by this engine: every rank holds the "
                            "whole model (partitioned by ZeRO); remove the section"),
        "sparse_attention": ("DeepSpeed's sparse attention kernels are not supported by this engine; remove the "
                             "section (the model's own attention runs)"),
    }

    train_batch_size: Optional[Int(minimum=1, auto=True)] = None
    train_micro_batch_size_per_gpu: Optional[Int(minimum=1, auto=True)] = None
    gradient_accumulation_steps: Optional[Int(minimum=1, auto=True)] = None
    gradient_clipping: Real(minimum=0.0, auto=True) = 0.0
    """Max global gradient norm; 0 turns clipping off."""

    # model_construct: the default (stage 0) is reported as a missing section
    # by _check_given, not by ZeroConfig's own check.
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig.model_construct)
    aio: AioConfig = Field(default_factory=AioConfig)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: Optional[OptimizerConfig] = None
    """None: the script passes its own optimizer to the engine."""
    scheduler: Optional[SchedulerConfig] = None
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)

    steps_per_print: Optional[Int(minimum=1)] = 10
    wall_clock_breakdown: Flag = False
    memory_breakdown: Flag = False
    dump_state: Flag = False
    prescale_gradients: Flag = False
    gradient_predivide_factor: Real(minimum=0.0, exclusive_minimum=True) = 1.0
    communication_data_type: Optional[DataType] = None
    """dtype of gradient reduction; None: the compute dtype."""
    zero_allow_untested_optimizer: Flag = False
    zero_force_ds_cpu_optimizer: Flag = True
    sparse_gradients: Flag = False
    disable_allgather: Flag = False

    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)

    @property
    def precision(self) -> str:
        """Compute dtype of the model: ``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    def unresolved_autos(self) -> list[str]:
        """Dotted paths of the keys that still hold ``"auto"``."""
        return [join(path, name) for path, section in sections(self)
                for name in sorted(type(section)._auto_fields) if section.is_auto(name)]

    @model_validator(mode="after")
    def _check_across_sections(self, info: ValidationInfo) -> "DeepSpeedConfig":
        context = info.context or {}
        problems = []
        zero_aio = self.zero_optimization.aio
        if (zero_aio is not None and "aio" in self.model_fields_set
                and zero_aio.model_dump() != self.aio.model_dump()):
            problems.append((("aio",), (
                f"aio is given both at the top level ({short(self.aio.model_dump(exclude_unset=True))}) "
                f"and in zero_optimization ({short(zero_aio.model_dump(exclude_unset=True))}) with "
                f"different values; keep one"), None))
        budget = self.activation_checkpointing.max_in_cpu_bytes
        if budget is not None and spill_offload(self.zero_optimization) is None:
            problems.append((("activation_checkpointing", "max_in_cpu_bytes"), (
                "saved activations past max_in_cpu_bytes go to NVMe, but neither zero_optimization."
                "offload_param nor offload_optimizer has device 'nvme' (with the nvme_path they go to); "
                "offload one of them to NVMe, or drop max_in_cpu_bytes to keep them all in host memory"),
                budget))
        if self.fp16.raw("enabled") is True and self.bf16.raw("enabled") is True:
            problems.append((("bf16", "enabled"), (
                "fp16.enabled and bf16.enabled are both true; enable at most one"), True))
        sizes = [self.raw(key) for key in (TRAIN, MICRO, ACCUM)]
        if AUTO not in sizes:  # with an "auto" the sizes are checked once resolved
            derived, why = derive_batch_sizes(*sizes, context.get("world_size", 1))
            problems += [((key,), message, self.raw(key)) for key, message in why]
            if derived is not None:
                self.__dict__.update(derived._asdict())
        raise_problems(type(self).__name__, problems)

        for path, section in sections(self):
            section._path = path
        if not context.get("quiet"):
            _emit_notes(self, context.get("warnings"))
        if zero_aio is not None and "aio" not in self.model_fields_set:
            self.__dict__["aio"] = zero_aio.model_copy()
            self.aio._path = "aio"
        return self


def _emit_notes(config: DeepSpeedConfig, sink: list | None) -> None:
    found = []
    for path, section in sections(config):
        for old, new in section._notes:
            new = " and ".join(join(path, key) for key in (new if isinstance(new, tuple) else (new,)))
            found.append((f"{join(path, old)} is deprecated; use {new} instead",
                          ConfigDeprecationWarning))
        for name in sorted(type(section)._inert & section.model_fields_set):
            default = type(section).model_fields[name].get_default(call_default_factory=True)
            value = section.raw(name)
            if value != default and value != "auto":  # "auto": the user chose nothing
                found.append((f"{join(path, name)} = {short(value)} is accepted for DeepSpeed "
                              f"compatibility but has no effect in nvmeio", IgnoredSettingWarning))
        for name, why in section.inert_now().items():
            found.append((f"{join(path, name)} = {short(section.raw(name))} {why}", IgnoredSettingWarning))
    for message, category in found:
        if sink is None:
            warnings.warn(message, category, stacklevel=2)
        else:
            sink.append((message, category))


def validate_config(data: Any, world_size: int = 1, source: str | None = None,
                    quiet: bool = False, stacklevel: int = 2) -> DeepSpeedConfig:
    """Validate a parsed config; every problem in one ConfigError.

    Warnings are attributed to the caller ``stacklevel`` frames up;
    ``quiet`` drops them (for a config validated before).
    """
    if not isinstance(data, Mapping):
        raise ConfigError([Problem("", f"a DeepSpeed config is a JSON object, got {short(data)}")], source)
    try:
        world_size = whole_number(world_size, minimum=1)
    except PydanticCustomError:
        raise ConfigError([Problem("world_size", f"must be a positive integer, got {short(world_size)}")],
                          source) from None
    found: list = []
    context = {"world_size": world_size, "warnings": found, "quiet": quiet}
    try:
        config = DeepSpeedConfig.model_validate(data, context=context)
    except ValidationError as error:
        raise ConfigError(problems_from(error, DeepSpeedConfig, data), source) from None
    for message, category in found:
        warnings.warn(message, category, stacklevel=stacklevel)
    return config
