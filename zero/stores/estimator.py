"""How much memory ZeRO needs: DeepSpeed's estimators (stage 2 and stage 3) and this engine's per-rank bytes.

- ``estimate_zero2_model_states_mem_needs*``: DeepSpeed's stage-2 table, its
  documented formula exactly (see :func:`estimate_zero2_model_states_mem_needs`),
  so that its numbers can be compared with DeepSpeed's.
- ``estimate_zero3_model_states_mem_needs*``: DeepSpeed's stage-3 table, computed
  from this engine's layout with the NVMe bytes and pinned staging buffers
  counted (below).
- :func:`estimate_rank_bytes`: this engine's own host, device and NVMe bytes per
  rank at any stage, the sum of rank_memory.py's parts, the same parts the
  host-memory check (memory_check.py) refuses a config by.

The stage-3 table, per rank, with ``P`` parameters, ``L`` in the largest layer
(a module's own parameters), ``W`` ranks, ``b`` bytes per 16-bit value:

- parameter shard ``b·P/W`` at ``offload_param`` (GPU, host or NVMe; nothing
  more when fp32 parameters and the optimizer are both on NVMe: the shards are
  read from the fp32 master, see param_store.py);
- fp32 master, exp_avg, exp_avg_sq ``12·P/W`` at ``offload_optimizer``;
- fp32 gradient partition ``4·P/W``: on the GPU without optimizer offload, in
  host memory with ``cpu``, on NVMe with ``nvme`` (written sub-group by
  sub-group during backward; host memory holds the two sub-groups being
  filled, ``2 × 4 × min(sub_group_size, P/W)``);
- on the GPU, the gathered largest layer and its full gradient ``2·b·L``;
- pinned buffers: ``buffer_count × b·⌈L/W⌉`` for NVMe parameters, one
  sub-group with its gradient (``16 × min(sub_group_size, P/W)``) per pipeline
  slot for NVMe optimizer states;
- ``zero_init=0``: each process first builds the whole fp32 model in host
  memory (``4·P`` bytes per process).

Host memory is per node (``num_gpus_per_node`` ranks) and multiplied by
``additional_buffer_factor``, as in DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..config.offload import OffloadOptimizerConfig, OffloadParamConfig
from .rank_memory import RankBytes, RankSizes, location, rank_memory_parts

GB = 1024 ** 3
DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Estimate:
    offload_param: str
    offload_optimizer: str
    zero_init: bool
    cpu_bytes: float  # per node
    gpu_bytes: float  # per GPU
    nvme_bytes: float  # per node


def model_sizes(model: nn.Module) -> Tuple[int, int]:
    """(total parameters, parameters of the largest layer), counting partitioned ones by ``ds_numel``."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    total = sum(numel(p) for p in model.parameters())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def optimized_params(model: nn.Module) -> int:
    """The parameters the engine keeps optimizer state for: those that require grad (layouts.py
    [Note: the optimizer covers the trainable units only]; a module's frozen parameters beside
    trainable ones are a unit of their own: runtime/unit.py)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def estimate_zero3(total_params: int, largest_layer_params: int, offload_param: str, offload_optimizer: str,
                   zero_init: bool = True, num_gpus_per_node: int = 1, num_nodes: int = 1,
                   additional_buffer_factor: float = 1.5, bytes_per_param: int = 2, param_buffer_count: int = 5,
                   sub_group_size: int = 1_000_000_000, optimizer_pipeline_slots: int = 1) -> Estimate:
    """One row of the table (see the module docstring for the terms)."""
    world = num_gpus_per_node * num_nodes
    shard = total_params / world
    b = bytes_per_param
    gpu = 2 * b * largest_layer_params
    cpu = nvme = 0.0
    homes = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}
    per = {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0}
    if not (b == 4 and offload_param == offload_optimizer == "nvme"):
        per[homes[offload_param]] += b * shard
    per[homes[offload_optimizer]] += 16 * shard  # fp32 master, exp_avg, exp_avg_sq, gradient
    if offload_param == "nvme":
        per["cpu"] += param_buffer_count * b * -(-largest_layer_params // world)
    if offload_optimizer == "nvme":
        sub_group = min(sub_group_size, shard)
        per["cpu"] += optimizer_pipeline_slots * 16 * sub_group + 2 * 4 * sub_group
    gpu += per["gpu"]
    cpu = per["cpu"] * num_gpus_per_node
    if not zero_init:
        cpu = max(cpu, 4 * total_params * num_gpus_per_node)
    cpu *= additional_buffer_factor
    nvme = per["nvme"] * num_gpus_per_node
    return Estimate(offload_param, offload_optimizer, zero_init, cpu, gpu, nvme)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5,
                                                   **kwargs) -> List[Estimate]:
    """Print the table for a model of the given sizes; returns its rows."""
    rows = [estimate_zero3(total_params, largest_layer_params, p, o, zero_init, num_gpus_per_node, num_nodes,
                           additional_buffer_factor, **kwargs)
            for zero_init in (True, False) for p in DEVICES for o in DEVICES]
    nodes = "node" if num_nodes == 1 else "nodes"
    gpus = "GPU" if num_gpus_per_node == 1 else "GPUs"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: Model with {int(total_params / 1e6)}M total params, {int(largest_layer_params / 1e6)}M largest "
        f"layer params.",
        "  per CPU  |  per GPU |  per NVMe |   Options",
    ]
    for r in rows:
        lines.append(f"  {r.cpu_bytes / GB:7.2f}GB | {r.gpu_bytes / GB:6.2f}GB | {r.nvme_bytes / GB:7.2f}GB | "
                     f"offload_param={r.offload_param:<4}, offload_optimizer={r.offload_optimizer:<4}, "
                     f"zero_init={int(r.zero_init)}")
    lines.append("(per CPU and per NVMe are per node; per CPU includes the pinned NVMe staging buffers)")
    print("\n".join(lines))
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5,
                                                   **kwargs) -> List[Estimate]:
    """Print the table for ``model`` (sizes read from it, partitioned or not); returns its rows."""
    total, largest = model_sizes(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor, **kwargs)


# -- stage 2: DeepSpeed's formula ---------------------------------------------------------------------

@dataclass(frozen=True)
class Zero2Estimate:
    offload_optimizer: str  # "cpu" or "none"
    cpu_bytes: int  # per node
    gpu_bytes: int  # per GPU


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> Tuple[int, int]:
    """``(cpu_bytes per node, gpu_bytes per GPU)`` for ZeRO stage 2, by DeepSpeed's documented formula.

    DeepSpeed's documented "Memory Requirements", with
    ``Ψ = total_params``, ``n = num_gpus_per_node``, ``N = n × num_nodes`` and
    ``f = additional_buffer_factor``:

    - ``offload_optimizer cpu``: GPU ``2Ψ`` (the fp16 parameters); CPU
      ``Ψ·max(4n, 16)·f`` (the fp32 model built on each process, or the 16
      bytes of fp32 parameter, gradient and two Adam states offloaded);
    - ``offload_optimizer none``: GPU ``4Ψ + 16Ψ/N`` (fp16 parameters and
      gradients, the partitioned fp32 parameter, gradient and Adam states);
      CPU ``Ψ·4n·f`` (the fp32 model each process builds first).

    This is the formula the page documents and whose printed numbers it shows
    (2851M parameters on 8 GPUs: 127.45 GB | 5.31 GB with cpu offload,
    127.45 GB | 15.93 GB without), so it is the one implemented. Two departures
    of DeepSpeed's code from its page are not followed: some releases take
    ``max(4N, 16)`` over all nodes' GPUs for the per-node CPU (the page says
    per node, which is what a node's RAM holds), and recent releases count
    ``2Ψ + 18Ψ/N`` on the GPU without offload (an fp32 gradient buffer
    besides the fp16 one). This engine's own per-rank bytes at stage 2 are
    :func:`estimate_rank_bytes` (fp32 gradient partition ``4Ψ/N``, no whole
    16-bit gradient).
    """
    total_gpus = num_gpus_per_node * num_nodes
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * num_gpus_per_node, 16) * additional_buffer_factor
    else:
        gpu = 4 * total_params + int(16 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Zero2Estimate]:
    """Print DeepSpeed's stage-2 table for a model of ``total_params`` parameters; returns its rows."""
    rows = []
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                         additional_buffer_factor)
        rows.append(Zero2Estimate("cpu" if cpu_offload else "none", cpu, gpu))
    nodes = "node" if num_nodes == 1 else "nodes"
    gpus = "GPU" if num_gpus_per_node == 1 else "GPUs"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: Model with {int(total_params / 1e6)}M total params.",
        "  per CPU  |  per GPU |   Options",
    ]
    lines += [f" {r.cpu_bytes / GB:7.2f}GB | {r.gpu_bytes / GB:6.2f}GB | offload_optimizer={r.offload_optimizer}"
              for r in rows]
    print("\n".join(lines))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> List[Zero2Estimate]:
    """Print DeepSpeed's stage-2 table for ``model`` (each shared parameter counted once); returns its rows."""
    total, _ = model_sizes(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


# -- this engine, per rank, at any stage ---------------------------------------------------------------

_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def estimate_rank_bytes(model: Union[nn.Module, int], stage: int = 3, offload_param: str = "none",
                        offload_optimizer: str = "none", dtype: Union[str, torch.dtype] = "bf16",
                        world_size: int = 1, largest_layer_params: Optional[int] = None,
                        compute_device: str = "cuda",
                        sub_group_size: int = 1_000_000_000, state_count: int = 2,
                        max_live_parameters: int = 1_000_000_000, has_optimizer: bool = True,
                        trainable_params: Optional[int] = None) -> RankBytes:
    """This engine's memory on each rank, by formula: host, device and NVMe bytes with their parts.

    The parts are rank_memory.py's (see its [Note: what a rank holds at each
    stage]), the ones ``zero.initialize`` checks host memory by, here with
    the config sections' defaults and the partition ``⌈P/W⌉`` (a real layout
    pads each unit to the world size, the check uses it). With
    ``compute_device="cpu"`` the compute device's parts are host memory and
    ``device_bytes`` is 0. ``dtype`` is the compute dtype: ``"fp32"``,
    ``"fp16"``, ``"bf16"`` or a torch dtype. ``model`` is a module (its sizes
    read as by the stage-3 table) or a parameter count; with a count,
    ``largest_layer_params`` (stage 3's smallest gathered set and its NVMe swap
    buffers, and the size of a GPU's gradient crossing slabs) is 0 unless given, which
    leaves those buffers out and counts the slabs at their least.
    ``trainable_params``: the parameters with a master and optimizer states (a LoRA
    model's adapters); by default, of a module those of its modules owning a
    parameter that requires grad (as the engine counts them), of a count all.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stages are 0, 1, 2 and 3 (got {stage})")
    for name, device in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        if device not in DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(DEVICES)} (got {device!r})")
    if offload_param != "none" and stage < 3:
        raise ValueError(f"offload_param (device '{offload_param}') needs ZeRO stage 3, but stage is {stage}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(f"offload_optimizer (device '{offload_optimizer}') needs ZeRO stage 1, 2 or 3, "
                         f"but stage is 0")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be fp32, fp16, bf16 or one of their torch dtypes (got {dtype!r})")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (got {world_size})")
    if isinstance(model, nn.Module):
        total_params, largest = model_sizes(model)
        trained = optimized_params(model) if trainable_params is None else int(trainable_params)
    else:
        total_params, largest = int(model), 0
        trained = total_params if trainable_params is None else int(trainable_params)
    if largest_layer_params is not None:
        largest = int(largest_layer_params)
    if not 0 <= trained <= total_params:
        raise ValueError(f"trainable_params must be between 0 and the model's {total_params} (got {trained})")
    sizes = RankSizes.of_counts(total_params, largest, world_size, int(sub_group_size), trained)
    # The sections' defaults, without the nvme_path check (nothing is written).
    param_section = OffloadParamConfig.model_construct(device=offload_param)
    optimizer_section = OffloadOptimizerConfig.model_construct(device=offload_optimizer)
    parts = rank_memory_parts(sizes, stage=stage, offload_param=param_section, offload_optimizer=optimizer_section,
                              itemsize=_DTYPE_BYTES[dtype], compute_device=location(compute_device),
                              state_count=state_count, has_optimizer=has_optimizer,
                              max_live_parameters=max_live_parameters)
    return RankBytes.of(parts)
