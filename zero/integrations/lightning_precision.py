"""Lightning's ``precision=`` on the engine: :class:`ZeroPrecision`, and the fp16 / bf16 sections it
puts in the config, as Lightning's DeepSpeedStrategy does (its ``_format_precision_config``).

| Trainer precision | the config gets (unless it has the section) | the module |
|---|---|---|
| ``32-true`` | nothing: its own ``fp16`` / ``bf16`` sections, if any, rule (``"auto"``: off) | as built |
| ``16-mixed`` (``16``) | ``fp16``: enabled, with ZeroStrategy's ``loss_scale``, ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale`` | fp32 as built; the engine computes in fp16 from fp32 master weights |
| ``bf16-mixed`` | ``bf16``: enabled | the same, in bf16 |
| ``16-true``, ``bf16-true`` | as the mixed one | built and converted to the 16-bit dtype before the engine (DeepSpeedPrecision's ``convert_module``): the master weights start from the 16-bit values |

With 16-bit compute, floating-point inputs are cast to its dtype as DeepSpeedPrecision casts them.
Where DeepSpeed would go on half configured, the strategy refuses, naming both sides (a
precision the config's section disables, fp16 beside bf16), and what it would ignore it warns
about once, by name (loss-scale arguments the config's own ``fp16`` section replaces, or that
a precision without fp16 never uses).

[Note: how the Trainer's precision reaches the strategy]
Lightning turns ``precision=`` into a plugin before the strategy sees it, and gives its
DeepSpeedPrecision to DeepSpeedStrategy only: any other strategy gets ``Precision`` (32-true),
``MixedPrecision`` (autocast and a GradScaler) or ``HalfPrecision``. ZeroStrategy's
``precision_plugin`` setter replaces the one Lightning sets by the ZeroPrecision of the same
precision, since the engine casts and scales the loss itself (autocast and a GradScaler would do
it a second time); a plugin of another precision (``64-true``, transformer-engine, ...) is
refused there, when the Trainer is built. On the CPU, Lightning turns ``"16-mixed"`` into
``"bf16-mixed"`` itself, with its warning, before any strategy sees it: for fp16 on the CPU pass
``Trainer(plugins=[ZeroPrecision("16-mixed")])`` (or the config's ``fp16`` section with
``precision="32-true"``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Mapping

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from ..config import IgnoredSettingWarning

DTYPES = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
          "16-true": torch.float16, "bf16-true": torch.bfloat16}
SECTION = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
LOSS_SCALE_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                       "min_loss_scale": 1}  # DeepSpeedStrategy's


class ZeroPrecision(Precision):
    """The precision plugin of :class:`ZeroStrategy` (see the module docstring): the engine computes in
    the 16-bit dtype of ``precision`` (``32-true``, ``16-mixed``, ``bf16-mixed``, ``16-true``,
    ``bf16-true``) and scales the loss; this plugin casts inputs and, for ``*-true``, the module."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in DTYPES:
            raise ValueError(f"ZeroPrecision({precision!r}): the engine computes in fp32, fp16 or bf16 with fp32 "
                             f"master weights; precision is one of {', '.join(map(repr, DTYPES))}")
        self.precision = precision
        self.dtype = DTYPES[precision]

    @property
    def converts_module(self) -> bool:
        return self.precision.endswith("-true") and self.dtype != torch.float32

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.dtype) if self.converts_module else module

    def convert_input(self, data: Any) -> Any:
        if self.dtype == torch.float32:
            return data
        from lightning_utilities import apply_to_collection

        return apply_to_collection(data, torch.Tensor,
                                   lambda t: t.to(self.dtype) if torch.is_floating_point(t) else t)

    @contextlib.contextmanager
    def tensor_init_context(self):
        if not self.converts_module:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def module_init_context(self):
        return self.tensor_init_context()


def zero_precision_of(plugin: Precision) -> ZeroPrecision:
    """The ZeroPrecision standing for the plugin Lightning chose from ``precision=`` (see the note)."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    if isinstance(plugin, (MixedPrecision, HalfPrecision)) and plugin.precision in DTYPES:
        return ZeroPrecision(plugin.precision)
    raise ValueError(f"ZeroStrategy trains with precision '32-true', '16-mixed', 'bf16-mixed', '16-true' or "
                     f"'bf16-true' (the engine computes in fp32, fp16 or bf16 from fp32 master weights); got "
                     f"{getattr(plugin, 'precision', None)!r} ({type(plugin).__name__})")


def _enabled(section: Any) -> Any:
    return section.get("enabled", False) if isinstance(section, Mapping) else None


def _warn(message: str) -> None:
    warnings.warn(message, IgnoredSettingWarning, stacklevel=3)


def apply_precision(config: Dict[str, Any], precision: str, options: Mapping[str, Any]) -> None:
    """Put the Trainer's ``precision`` into ``config`` (a dict, changed in place) as DeepSpeedStrategy
    does, with ZeroStrategy's loss-scale ``options``; refuse a config that contradicts it, warn about
    loss-scale arguments without effect."""
    if "bfloat16" in config and "bf16" not in config:  # the section's old name
        config["bf16"] = config.pop("bfloat16")
    scale = {k: options[k] for k in LOSS_SCALE_DEFAULTS if options[k] != LOSS_SCALE_DEFAULTS[k]}
    given = ", ".join(f"{k}={v!r}" for k, v in scale.items())
    wanted = SECTION.get(precision)
    if wanted is None:  # 32-true: the config's sections as they are, an "auto" one off
        for name in ("fp16", "bf16"):
            if _enabled(config.get(name)) == "auto":
                config[name] = dict(config[name], enabled=False)
        if scale and _enabled(config.get("fp16")) is not True:
            _warn(f"ZeroStrategy({given}) has no effect: the loss-scale arguments configure fp16, which "
                  f"Trainer(precision={precision!r}) does not compute in (use precision='16-mixed')")
        elif scale:
            _warn(f"ZeroStrategy({given}) has no effect: the config's own fp16 section sets the loss scaling "
                  f"(as with DeepSpeedStrategy); set these keys there")
        return
    other = "bf16" if wanted == "fp16" else "fp16"
    if _enabled(config.get(other)) is True:
        raise ValueError(f"Trainer(precision={precision!r}) computes in {wanted}, but the DeepSpeed config enables "
                         f"{other}; drop the config's {other} section, or pass the precision that matches it")
    if _enabled(config.get(other)) == "auto":
        config[other] = dict(config[other], enabled=False)
    section = config.get(wanted)
    if section is None:
        config[wanted] = {"enabled": True}
        if wanted == "fp16":
            config[wanted].update({k: options[k] for k in LOSS_SCALE_DEFAULTS})
    else:
        if _enabled(section) is False:
            raise ValueError(f"Trainer(precision={precision!r}) computes in {wanted}, but the DeepSpeed config's "
                             f"{wanted} section has enabled false; set it true, drop the section, or pass "
                             f"precision='32-true'")
        config[wanted] = dict(section, enabled=True)  # true, or "auto": the precision decides
        if wanted == "fp16" and scale:
            _warn(f"ZeroStrategy({given}) has no effect: the config's own fp16 section sets the loss scaling "
                  f"(as with DeepSpeedStrategy); set these keys there")
    if wanted == "bf16" and scale:
        _warn(f"ZeroStrategy({given}) has no effect: loss scaling is fp16's, and Trainer(precision={precision!r}) "
              f"computes in bf16, which needs none")
