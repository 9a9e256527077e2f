"""How much memory ZeRO stage 3 needs per CPU (node), per GPU and per NVMe, for each offload choice.

The table DeepSpeed users know, computed from this engine's own layout, with
the NVMe bytes and the pinned staging buffers counted (DeepSpeed's estimator
leaves both out). Per rank, with ``P`` parameters, ``L`` in the largest layer
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
from typing import List, Tuple

import torch.nn as nn

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
