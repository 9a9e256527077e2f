"""ZeRO stage 3 with ZeRO-Infinity offload (none / cpu / nvme), on nvmeio.

    engine, optimizer, _, scheduler = zero.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

The config layer is :mod:`zero.config`; see DESIGN.md for the layering.
"""

from .config import ConfigError, DeepSpeedConfig, load_config, resolve_auto
from .engine import ZeroEngine
from .gathered import GatheredParameters
from .init_context import Init
from .initialize import initialize

__all__ = ["ConfigError", "DeepSpeedConfig", "GatheredParameters", "Init", "ZeroEngine", "initialize", "load_config", "resolve_auto"]
