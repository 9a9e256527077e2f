"""``scheduler``: the learning-rate schedule, one params model per type.

``params`` is validated by the model of the given ``type`` (so a WarmupLR
key misspelled, or a OneCycle key under WarmupLR, is reported with its path).
Defaults are DeepSpeed's.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationInfo, field_validator

from .base import StrictModel
from .values import Choice, Flag, Int, Real

WarmupType = Choice("log", "linear", what="warmup_type")


class WarmupLRParams(StrictModel):
    """WarmupLR: from warmup_min_lr to warmup_max_lr in warmup_num_steps, then flat."""

    warmup_min_lr: Real(minimum=0.0, auto=True) = 0.0
    warmup_max_lr: Real(minimum=0.0, auto=True) = 0.001
    warmup_num_steps: Int(minimum=0, auto=True) = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: Int(minimum=-1) = -1


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: Int(minimum=1, auto=True)


class OneCycleParams(StrictModel):
    """OneCycle: lr (and momentum) up and down over one cycle, then decay."""

    cycle_min_lr: Real(minimum=0.0)
    cycle_max_lr: Real(minimum=0.0)
    decay_lr_rate: Real(minimum=0.0) = 0.0
    cycle_first_step_size: Int(minimum=1) = 2000
    cycle_second_step_size: Optional[Int(minimum=1)] = None
    cycle_first_stair_count: Int(minimum=0) = 0
    cycle_second_stair_count: Optional[Int(minimum=0)] = None
    decay_step_size: Int(minimum=0) = 0
    cycle_momentum: Flag = True
    cycle_min_mom: Real(minimum=0.0) = 0.8
    cycle_max_mom: Real(minimum=0.0) = 0.9
    decay_mom_rate: Real(minimum=0.0) = 0.0
    last_batch_iteration: Int(minimum=-1) = -1


class LRRangeTestParams(StrictModel):
    """LRRangeTest: grow lr from lr_range_test_min_lr to find a good maximum."""

    lr_range_test_min_lr: Real(minimum=0.0) = 0.001
    lr_range_test_step_size: Int(minimum=1) = 2000
    lr_range_test_step_rate: Real(minimum=0.0) = 1.0
    lr_range_test_staircase: Flag = False
    last_batch_iteration: Int(minimum=-1) = -1


PARAMS_BY_TYPE: dict[str, type[StrictModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}

SchedulerType = Choice(*PARAMS_BY_TYPE, what="scheduler type")


class SchedulerConfig(StrictModel):
    """``scheduler``: ``type`` and the ``params`` of that type."""

    type: SchedulerType
    params: Any = None
    """One of the ``*Params`` models above, chosen by ``type``."""

    @classmethod
    def _upgrade(cls, data: dict, notes: list) -> dict:
        if data.get("params") is None:
            data["params"] = {}  # validated (defaults, required keys) like a given one
        return data

    @field_validator("params", mode="plain")
    @classmethod
    def _params_of_type(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind is None:  # the type is invalid and reported: nothing to check against
            return value
        return PARAMS_BY_TYPE[kind].model_validate(value, context=info.context)

    @classmethod
    def child_models(cls, name: str, raw: Any = None) -> list[type[StrictModel]]:
        if name != "params":
            return super().child_models(name, raw)
        kind = raw.get("type") if isinstance(raw, dict) else None
        by_lower = {k.lower(): m for k, m in PARAMS_BY_TYPE.items()}
        if isinstance(kind, str) and kind.lower() in by_lower:
            return [by_lower[kind.lower()]]
        return list(PARAMS_BY_TYPE.values())
