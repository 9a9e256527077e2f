"""``fp16``, ``bf16`` and ``data_types``: the precision of compute, the fp16 loss scaler and
the dtype of gradient accumulation.

fp32 master weights always live in the optimizer; these sections choose the
dtype of the parameters the model computes with. ``fp16.loss_scale: 0``
means dynamic loss scaling starting at ``2**initial_scale_power``.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from .base import StrictModel
from .values import AutoFlag, Choice, Flag, Int, Real

DataType = Choice("fp16", "bf16", "fp32", what="data type", aliases={"bfp16": "bf16"})


class FP16Config(StrictModel):
    """``fp16``: half precision compute with a (dynamic) loss scaler."""

    _inert: ClassVar[frozenset[str]] = frozenset({"fp16_master_weights_and_grads"})

    enabled: AutoFlag = False
    auto_cast: Flag = False
    """Cast the inputs of the forward pass to fp16."""
    loss_scale: Real(minimum=0.0) = 0.0
    """0: dynamic loss scaling; any other value: that static scale."""
    initial_scale_power: Int(minimum=0) = 16
    loss_scale_window: Int(minimum=1) = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: Int(minimum=1) = 2
    """Overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: Flag = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: Real(minimum=0.0, exclusive_minimum=True) = 1.0
    fp16_master_weights_and_grads: Flag = False

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_loss_scale(self) -> float:
        """The scale of the first step: static value, or ``2**initial_scale_power``."""
        return float(2 ** self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


class BF16Config(StrictModel):
    """``bf16`` (old name of the section: ``bfloat16``): bfloat16 compute."""

    _inert: ClassVar[frozenset[str]] = frozenset({"immediate_grad_update", "check_grad_overflow"})

    enabled: AutoFlag = False
    immediate_grad_update: Flag = False
    check_grad_overflow: Flag = False


class DataTypesConfig(StrictModel):
    """``data_types``: dtype of gradient accumulation (None: the compute dtype)."""

    grad_accum_dtype: Optional[DataType] = None
