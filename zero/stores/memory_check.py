"""Will the engine's host memory fit? Checked by ``initialize`` before anything is allocated.

The engine's memory is known from the config and the partition layout before
the first buffer exists: :func:`rank_memory.rank_memory_parts` lists it part
by part, at every stage (rank_memory.py [Note: what a rank holds at each
stage]), and this check takes the parts that live in host memory (on a CPU
machine, the compute device's parts too: the whole model's parameters below
stage 3, the gathered ones in stage 3, the optimizer without offload). When
their sum exceeds ``MemAvailable``, or the locked part the memlock limit, the
error lists every part with its bytes and names the setting that shrinks the
largest one at this stage, instead of an OOM kill halfway through the first
step.
"""
from __future__ import annotations

from typing import List

from swapper.host_memory import HostMemory, format_bytes

from ..config import ConfigError, DeepSpeedConfig, Problem
from ..config.activation_checkpointing import spill_offload
from ..config.offload import min_swap_bytes
from .layouts import RankLayout
from .param_store import gds_pool
from .rank_memory import HOST, MemoryPart, RankSizes, location, rank_memory_parts


def host_memory_parts(config: DeepSpeedConfig, rank_layout: RankLayout, itemsize: int,
                      state_count: int, has_optimizer: bool, steps_in_backward: bool = False, *,
                      compute_device, quantized=frozenset()) -> List[MemoryPart]:
    """The engine's host memory, part by part, for this rank computing on ``compute_device``;
    ``quantized``: the units stored int8."""
    zc = config.zero_optimization
    spill = spill_offload(zc) if config.activation_checkpointing.cpu_checkpointing else None
    small = 0
    if zc.stage == 3 and zc.offload_param.device == "nvme":
        small = -(-min_swap_bytes(zc.offload_param, config.aio.block_size) // itemsize)
    parts = rank_memory_parts(RankSizes.of_layout(rank_layout, small, quantized), stage=zc.stage, offload_param=zc.offload_param,
                              offload_optimizer=zc.offload_optimizer, itemsize=itemsize,
                              compute_device=location(compute_device), state_count=state_count,
                              has_optimizer=has_optimizer, steps_in_backward=steps_in_backward,
                              max_live_parameters=zc.stage3_max_live_parameters, activation_spill=spill,
                              gds_param_pool=gds_pool(config.aio.settings(), compute_device))
    return [p for p in parts if p.where == HOST]


def check_host_memory(parts: List[MemoryPart], memory: HostMemory) -> None:
    """Raise a ConfigError naming the setting to change when ``parts`` cannot fit."""
    total = sum(p.nbytes for p in parts)
    listing = "; ".join(f"{p.what}: {format_bytes(p.nbytes)}" for p in parts)
    if total > memory.available_bytes:
        worst = max(parts, key=lambda p: p.nbytes)
        raise ConfigError([Problem(worst.setting, (
            f"the engine needs {format_bytes(total)} of host memory on this rank but MemAvailable is "
            f"{format_bytes(memory.available_bytes)} ({listing}); the largest part is the {worst.what}: "
            f"{worst.fix}"))])
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
    sums held between micro-batches, runtime/grad_stash.py): half of what MemAvailable leaves, the
    other half for activations and everything else in the process."""
    return max(0, memory.available_bytes - sum(p.nbytes for p in parts)) // 2


def activation_budget_bytes(parts: List[MemoryPart], memory: HostMemory) -> int:
    """The default ``activation_checkpointing.max_in_cpu_bytes``: half of the half that
    :func:`headroom_bytes` leaves to activations and everything else, so that the forward's and
    backward's working tensors keep the other quarter of what MemAvailable leaves."""
    return headroom_bytes(parts, memory) // 2


def probe() -> HostMemory:
    """This machine now (a function, so that tests can stand in a smaller one)."""
    return HostMemory.probe()
