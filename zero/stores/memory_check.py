"""Will the engine's host memory fit? Checked by ``initialize`` before anything is allocated.

The engine's host memory is known from the config and the partition layout
before the first buffer exists: the NVMe swappers' buffer pools, the gradient
buffers of the sub-groups being filled during backward, what stays in host
memory by choice (``offload_*.device: cpu``, ``max_in_cpu``), and the gathered
parameters (at least the largest unit, at most ``stage3_max_live_parameters``).
When their sum exceeds ``MemAvailable``, or the locked part the memlock limit,
the error lists every part with its bytes and names the setting that shrinks
the largest one, instead of an OOM kill halfway through the first step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from swapper import ActivationSwapper
from swapper.host_memory import HostMemory, align_up, format_bytes

from ..config import ConfigError, DeepSpeedConfig, Problem
from ..config.activation_checkpointing import spill_offload
from .optimizer_store import nvme_buffer_count
from .param_store import swap_buffer_count
from .layouts import RankLayout

# Sub-group gradient buffers open at once during backward (grad_stash.py): the one with
# the tied embedding, whose gradient completes last, and the one being filled.
OPEN_GRAD_SUB_GROUPS = 2


@dataclass(frozen=True)
class MemoryPart:
    what: str
    nbytes: int
    setting: str  # the config key that shrinks it
    locked: bool = False


def host_memory_parts(config: DeepSpeedConfig, rank_layout: RankLayout, itemsize: int,
                      state_count: int, has_optimizer: bool, steps_in_backward: bool = False) -> List[MemoryPart]:
    """The engine's host memory, part by part, for this rank."""
    zc = config.zero_optimization
    numel = rank_layout.numel
    parts: List[MemoryPart] = []
    largest_shard = max((u.shard_numel for u in rank_layout.units), default=0)
    largest_unit = max((u.padded_numel for u in rank_layout.units), default=0)
    total_numel = sum(u.padded_numel for u in rank_layout.units)
    par = zc.offload_param
    if par.device == "nvme":
        in_cpu = min(par.max_in_cpu, numel)
        if in_cpu:
            parts.append(MemoryPart("parameters kept in host memory (max_in_cpu)", in_cpu * itemsize,
                                    "zero_optimization.offload_param.max_in_cpu"))
        count = swap_buffer_count(par, largest_shard, numel)
        parts.append(MemoryPart(
            f"parameter swap buffers ({count} x {format_bytes(largest_shard * itemsize)})",
            count * largest_shard * itemsize, "zero_optimization.offload_param.buffer_count",
            locked=par.pin_memory))
    elif par.device == "cpu":
        parts.append(MemoryPart("parameter partitions in host memory (offload_param.device cpu)",
                                numel * itemsize, "zero_optimization.offload_param.device"))
    opt = zc.offload_optimizer
    if has_optimizer and opt.device == "nvme":
        sg = max((g.numel for g in rank_layout.sub_groups), default=0)
        per_buffer = (1 + state_count) * align_up(sg * 4) + sg * 4
        count = nvme_buffer_count(opt, steps_in_backward)
        parts.append(MemoryPart(f"optimizer swap buffers ({count} x {format_bytes(per_buffer)})",
                                count * per_buffer, "zero_optimization.sub_group_size", locked=opt.pin_memory))
        parts.append(MemoryPart(f"gradient buffers of the sub-groups being filled ({OPEN_GRAD_SUB_GROUPS} x "
                                f"{format_bytes(sg * 4)})", OPEN_GRAD_SUB_GROUPS * sg * 4,
                                "zero_optimization.sub_group_size"))
    elif has_optimizer and opt.device == "cpu":
        parts.append(MemoryPart(
            "fp32 master weights, optimizer states and gradients in host memory (offload_optimizer.device cpu)",
            (2 + state_count) * numel * 4, "zero_optimization.offload_optimizer.device"))
    spill = spill_offload(zc) if config.activation_checkpointing.cpu_checkpointing else None
    if spill is not None:
        count, size = ActivationSwapper.BUFFER_COUNT, ActivationSwapper.BUFFER_BYTES
        parts.append(MemoryPart(f"activation swap buffers ({count} x {format_bytes(size)})", count * size,
                                "activation_checkpointing.cpu_checkpointing", locked=spill.pin_memory))
    if par.device != "none":  # gathered parameters live in host memory when computing on the CPU
        live = max(largest_unit, min(zc.stage3_max_live_parameters, total_numel))
        parts.append(MemoryPart(
            f"gathered parameters (largest unit {format_bytes(largest_unit * itemsize)}, up to "
            f"stage3_max_live_parameters)", live * itemsize, "zero_optimization.stage3_max_live_parameters"))
    return parts


def check_host_memory(parts: List[MemoryPart], memory: HostMemory) -> None:
    """Raise a ConfigError naming the setting to change when ``parts`` cannot fit."""
    total = sum(p.nbytes for p in parts)
    listing = "; ".join(f"{p.what}: {format_bytes(p.nbytes)}" for p in parts)
    if total > memory.available_bytes:
        worst = max(parts, key=lambda p: p.nbytes)
        raise ConfigError([Problem(worst.setting, (
            f"the engine needs {format_bytes(total)} of host memory on this rank but MemAvailable is "
            f"{format_bytes(memory.available_bytes)} ({listing}); the largest part is the {worst.what}: "
            f"{_fix(worst.setting)}"))])
    locked = [p for p in parts if p.locked]
    if locked and memory.memlock_limit_bytes is not None:
        need = sum(p.nbytes for p in locked)
        room = memory.memlock_limit_bytes - memory.locked_bytes
        if need > room:
            worst = max(locked, key=lambda p: p.nbytes)
            raise ConfigError([Problem(worst.setting, (
                f"the swap buffers need {format_bytes(need)} of locked memory (pin_memory) but the memlock "
                f"limit leaves {format_bytes(max(0, room))} (ulimit -l {memory.memlock_limit_bytes // 1024} "
                f"KiB, {format_bytes(memory.locked_bytes)} locked already); raise it with ulimit -l, set "
                f"pin_memory false, or lower {worst.setting}"))])


def headroom_bytes(parts: List[MemoryPart], memory: HostMemory) -> int:
    """What the engine may use beyond its planned parts for opportunistic caches (gradient
    sums held between micro-batches, grad_stash.py): half of what MemAvailable leaves, the
    other half for activations and everything else in the process."""
    return max(0, memory.available_bytes - sum(p.nbytes for p in parts)) // 2


def activation_budget_bytes(parts: List[MemoryPart], memory: HostMemory) -> int:
    """The default ``activation_checkpointing.max_in_cpu_bytes``: half of the half that
    :func:`headroom_bytes` leaves to activations and everything else, so that the forward's and
    backward's working tensors keep the other quarter of what MemAvailable leaves."""
    return headroom_bytes(parts, memory) // 2


def _fix(setting: str) -> str:
    if setting.endswith(".device"):
        return f"set {setting} to 'nvme'"
    if setting.endswith("cpu_checkpointing"):
        return f"set {setting} to false (its buffers stage the saved activations written to NVMe)"
    if setting.endswith("max_in_cpu"):
        return f"lower {setting} (0 keeps every partition on NVMe)"
    return f"lower {setting}"


def probe() -> HostMemory:
    """This machine now (a function, so that tests can stand in a smaller one)."""
    return HostMemory.probe()
