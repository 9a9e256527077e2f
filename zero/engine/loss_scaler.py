"""fp16 loss scaling: a static scale, or DeepSpeed's dynamic scaler.

Dynamic scaling starts at ``2**initial_scale_power``. A step whose gradients
are not finite is skipped; the scale is then divided by 2 (not below
``min_loss_scale``), unless ``hysteresis`` allows more overflows first: each
overflow spends one unit of hysteresis and only the last one lowers the
scale. After ``loss_scale_window`` steps in a row without overflow the scale
doubles and the hysteresis is refilled (``consecutive_hysteresis`` refills it
after every good step instead). These are DeepSpeed's rules, so a config
tuned for DeepSpeed behaves the same here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LossScaler:
    """A fixed scale: 1.0 for fp32/bf16, ``fp16.loss_scale`` for static fp16."""

    loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return False

    def update(self, overflow: bool) -> Optional[str]:
        """Record the outcome of a step; returns a log line for an overflow."""
        return "OVERFLOW! Skipping step (static loss scale)." if overflow else None

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])


@dataclass
class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler (see the module docstring)."""

    loss_scale: float = 2.0 ** 16
    scale_window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    scale_factor: float = 2.0
    cur_hysteresis: int = field(default=-1)
    cur_iter: int = 0
    last_overflow_iter: int = -1

    def __post_init__(self) -> None:
        if self.cur_hysteresis < 0:
            self.cur_hysteresis = self.hysteresis

    @property
    def dynamic(self) -> bool:
        return True

    def update(self, overflow: bool) -> Optional[str]:
        message = None
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                lowered = max(self.loss_scale / self.scale_factor, self.min_scale)
                message = (f"OVERFLOW! Skipping step. Attempted loss scale: {self.loss_scale:g}, "
                           f"reducing to {lowered:g}")
                self.loss_scale = lowered
            else:
                message = (f"OVERFLOW! Skipping step. Attempted loss scale: {self.loss_scale:g}, but "
                           f"hysteresis is {self.cur_hysteresis}. Reducing hysteresis to "
                           f"{self.cur_hysteresis - 1}")
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.loss_scale *= self.scale_factor
        self.cur_iter += 1
        return message

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale, "cur_hysteresis": self.cur_hysteresis,
                "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])


def make_loss_scaler(config) -> LossScaler:
    """The scaler for a :class:`~zero.config.DeepSpeedConfig`: dynamic only for fp16 with loss_scale 0."""
    fp16 = config.fp16
    if not fp16.enabled:
        return LossScaler(1.0)
    if not fp16.dynamic_loss_scale:
        return LossScaler(float(fp16.loss_scale))
    return DynamicLossScaler(
        loss_scale=fp16.initial_loss_scale,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=float(fp16.min_loss_scale),
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
