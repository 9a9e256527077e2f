"""ZeRO stage 3 with ZeRO-Infinity offload, on nvmeio.

For now this package holds the config layer: :mod:`zero.config`.
"""

from .config import ConfigError, DeepSpeedConfig, load_config, resolve_auto

__all__ = ["ConfigError", "DeepSpeedConfig", "load_config", "resolve_auto"]
