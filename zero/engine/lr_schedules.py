"""DeepSpeed's LR schedules: WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest.

Each sets ``lr`` of every optimizer param group from the number of steps
taken, exactly as DeepSpeed defines it, so a config's ``scheduler`` section
gives the same curve here. The engine calls ``step()`` after every optimizer
step that was not skipped. ``last_batch_iteration`` is the index of the last
step taken; at ``-1`` (not started) the schedules set their starting lr.
"""
from __future__ import annotations

import abc

import math
from typing import List, Sequence, Union

Number = Union[float, Sequence[float]]


def _per_group(optimizer, value: Number, name: str) -> List[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} has {len(value)} values for {len(optimizer.param_groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class _Schedule(abc.ABC):
    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: List[float] = [g["lr"] for g in optimizer.param_groups]

    @abc.abstractmethod
    def get_lr(self) -> List[float]:
        ...

    def _apply(self, lrs: List[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def step(self, last_batch_iteration: int = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self) -> List[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        if self.last_batch_iteration >= 0:
            self._apply(self.get_lr())


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` in ``warmup_num_steps`` (log or linear), then flat."""

    def __init__(self, optimizer, warmup_min_lr: Number = 0.0, warmup_max_lr: Number = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        return 1.0

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: Number = 0.0,
                 warmup_max_lr: Number = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        left = self.total_num_steps - self.last_batch_iteration
        return max(0.0, float(left) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class LRRangeTest(_Schedule):
    """lr = min_lr × (1 + step_rate × interval), interval continuous or staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr: Number = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = int(lr_range_test_step_size)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._apply(self.min_lr)

    def get_lr(self) -> List[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


class OneCycle(_Schedule):
    """One cycle of lr (and beta1 inversely) between the bounds, then optional decay."""

    def __init__(self, optimizer, cycle_min_lr: Number, cycle_max_lr: Number, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Number = 0.8,
                 cycle_max_mom: Number = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and all("betas" in g for g in optimizer.param_groups)
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)
        if self.cycle_momentum:
            betas2 = [g["betas"][1] for g in optimizer.param_groups]
            self.min_moms = [(m, b) for m, b in zip(_per_group(optimizer, cycle_min_mom, "cycle_min_mom"), betas2)]
            self.max_moms = [(m, b) for m, b in zip(_per_group(optimizer, cycle_max_mom, "cycle_max_mom"), betas2)]
            self.decay_mom_rate = float(decay_mom_rate)
            self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
            if last_batch_iteration == -1:
                for group, mom in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = mom

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decayed = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * decayed) for lo in self.min_lrs]

    def get_mom(self):
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decayed = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(m * (1 + self.decay_mom_rate * decayed), b) for m, b in self.max_moms]

    def step(self, last_batch_iteration: int = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = mom


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "OneCycle": OneCycle,
             "LRRangeTest": LRRangeTest}


def build_scheduler(scheduler_config, optimizer):
    """The schedule a config's ``scheduler`` section describes, driving ``optimizer``."""
    params = scheduler_config.params.model_dump()
    return SCHEDULES[scheduler_config.type](optimizer, **params)
