"""DeepSpeed JSON configs for nvmeio's ZeRO engine (stages 0-3) (pydantic, no torch).

    from zero.config import load_config, resolve_auto
    config = load_config("ds_config.json", world_size=8, hidden_size=4096)
    config = resolve_auto(config, world_size=8, lr=3e-5, train_micro_batch_size_per_gpu=4, ...)
    config.zero_optimization.offload_param.device      # "none" | "cpu" | "nvme"

Every section of the file is a frozen model; unknown keys, wrong values and
inconsistent settings are reported together in one :class:`ConfigError`,
each with its dotted key path and, for a misspelled key, the closest known one.
"""

from .aio import AioConfig
from .auto import resolve_auto
from .ds_config import DeepSpeedConfig
from .errors import (ConfigDeprecationWarning, ConfigError, IgnoredSettingWarning, Problem,
                     UnresolvedAutoError)
from .checkpoint import CheckpointConfig
from .load import load_config
from .offload import OffloadOptimizerConfig, OffloadParamConfig
from .optimizer import AdamParams, OptimizerConfig
from .precision import BF16Config, FP16Config
from .scheduler import (LRRangeTestParams, OneCycleParams, SchedulerConfig, WarmupDecayLRParams,
                        WarmupLRParams)
from .values import AUTO
from .zero_section import ZeroConfig

__all__ = [
    "AUTO", "AdamParams", "AioConfig", "BF16Config", "CheckpointConfig", "ConfigDeprecationWarning",
    "ConfigError", "DeepSpeedConfig", "FP16Config", "IgnoredSettingWarning", "LRRangeTestParams",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OneCycleParams", "OptimizerConfig", "Problem",
    "SchedulerConfig", "UnresolvedAutoError", "WarmupDecayLRParams", "WarmupLRParams", "ZeroConfig",
    "load_config", "resolve_auto",
]
