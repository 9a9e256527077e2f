"""ZeRO stage 3 with ZeRO-Infinity offload (none / cpu / nvme), on nvmeio.

    engine, optimizer, _, scheduler = zero.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

The config layer is :mod:`zero.config`; see DESIGN.md for the layering.
"""

from .config import ConfigError, DeepSpeedConfig, load_config, resolve_auto
from .engine import ZeroEngine
from .estimator import (estimate_zero3_model_states_mem_needs_all_cold,
                        estimate_zero3_model_states_mem_needs_all_live)
from .gathered import GatheredParameters
from .init_context import Init
from .initialize import initialize

__all__ = ["ConfigError", "DeepSpeedConfig", "GatheredParameters",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live", "Init", "ZeroEngine", "get_fp32_state_dict_from_zero_checkpoint",
           "initialize", "load_config", "load_state_dict_from_zero_checkpoint", "resolve_auto"]


def __getattr__(name):
    # Imported on first use, so that ``python -m zero.zero_to_fp32`` runs a module not yet imported.
    if name in ("get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"):
        from . import zero_to_fp32

        return getattr(zero_to_fp32, name)
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
