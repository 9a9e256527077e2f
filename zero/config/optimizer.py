"""``optimizer``: Adam or AdamW, stepped on the CPU by torch's fused kernel.

DeepSpeed's ``"Adam"`` runs in AdamW mode unless ``adam_w_mode`` is false;
:attr:`OptimizerConfig.decoupled_weight_decay` states the result so the
engine does not re-derive it.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from pydantic import Field

from .base import StrictModel
from .values import AutoBetas, Choice, Flag, Real

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")


class AdamParams(StrictModel):
    """``optimizer.params``: arguments of the Adam/AdamW step."""

    _aliases: ClassVar[Mapping[str, str]] = {"adamw_mode": "adam_w_mode"}

    lr: Real(minimum=0.0, auto=True) = 1e-3
    betas: AutoBetas = (0.9, 0.999)
    eps: Real(minimum=0.0, exclusive_minimum=True, auto=True) = 1e-8
    weight_decay: Real(minimum=0.0, auto=True) = 0.0
    adam_w_mode: Flag = True
    """For type Adam: decoupled (AdamW) weight decay; ignored for AdamW."""
    bias_correction: Flag = True
    amsgrad: Flag = False
    torch_adam: Flag = False
    """DeepSpeed: use torch's Adam instead of its own; nvmeio always uses torch's."""


class OptimizerConfig(StrictModel):
    """``optimizer``: ``type`` (Adam or AdamW, any case) and its ``params``."""

    _inert: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    type: Choice(*SUPPORTED_OPTIMIZERS, what="optimizer type")
    params: AdamParams = Field(default_factory=AdamParams)
    legacy_fusion: Flag = False

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style weight decay: type AdamW, or type Adam with adam_w_mode."""
        return self.type == "AdamW" or self.params.adam_w_mode
