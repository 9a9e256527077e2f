"""What one rank holds, part by part, and where: the one model of the engine's memory.

The host-memory check (memory_check.py) and the per-rank estimate
(estimator.py's ``estimate_rank_bytes``) are both sums of :func:`rank_memory_parts`:
the check feeds it this rank's exact layout and the config's sections, the
estimate a parameter count and the sections' defaults.

[Note: what a rank holds at each stage]
With ``b`` bytes per value of the compute dtype, ``k`` optimizer states
(Adam: 2), ``P`` parameters (each unit padded to a multiple of the world
size ``W``) and ``S`` this rank's partition (``P/W``):

- fp32 master, ``k`` states and the fp32 gradient partition, ``(2 + k)·4·S``,
  at ``offload_optimizer`` (compute device, host memory, or NVMe files with
  host-memory swap buffers of a few sub-groups), at every stage: below stage 3
  too, gradients are reduced per unit into their owners' partitions, never
  held whole (engine/build.py [Note: the ZeRO ladder]);
- the parameter partition, ``b·S``, at ``offload_param`` (compute device,
  host memory, or NVMe with ``max_in_cpu`` and swap buffers in host memory),
  except where the fp32 master in the same place is that partition
  (param_store.py's notes); frozen units stored int8
  (``zero_quantized_nontrainable_weights``) take their packed bytes instead,
  about one a value, outside that master;
- the gathered parameters on the compute device: stage 3 holds at least the
  largest unit and at most ``stage3_max_live_parameters``; stages 0-2 hold
  every unit whole, ``b·P`` (no stage-3 bound applies). On one rank, with the
  partition on the compute device in the compute dtype, the gathered units
  view the partition and cost nothing more (runtime/unit.py ``free_gather``).

On a CPU machine the compute device's memory is host memory, so a part on
the compute device is counted as host memory there. Working memory (a unit's
gradient before it is reduced, activations) is not a part: it is what the
check's headroom leaves (memory_check.py :func:`headroom_bytes`); but for the
host memory a GPU's copies stage through, bounded by design: the gradient
crossing's slabs (runtime/device_to_host.py) and the write-back ring
(runtime/write_back.py), at their size (where CUDA refuses to register host
memory they come from torch's pinned allocator, rounded up to powers of two:
nvmeio/_cuda.py [Note: staging memory where CUDA refuses registration]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from swapper import ActivationSwapper
from swapper.host_memory import align_up
from swapper.host_memory import format_bytes

from .layouts import RankLayout
from .optimizer_store import nvme_buffer_count
from .quantized import packed_nbytes
from .param_store import several_drives, swap_buffer_count
from .pinned_host import MAX_IN_FLIGHT, RING_BYTES, crossing_slab_bytes, makes_write_back_ring

HOST, DEVICE, NVME = "host", "device", "nvme"  # where a part lives; DEVICE: the compute device

# Sub-group gradient buffers open at once during backward (runtime/grad_stash.py): the one with
# the tied embedding, whose gradient completes last, and the one being filled.
OPEN_GRAD_SUB_GROUPS = 2


@dataclass(frozen=True)
class MemoryPart:
    what: str
    nbytes: int
    setting: str  # the config key that shrinks it
    fix: str  # what to do about it, at this stage
    where: str = HOST
    locked: bool = False


@dataclass(frozen=True)
class RankSizes:
    """The element counts the parts are made of."""

    world_size: int
    shard: int  # this rank's partition (its rank space)
    total: int  # every unit whole (padded to the world size)
    largest_unit: int
    largest_shard: int
    largest_sub_group: int  # of the optimizer's sub-groups
    small_shards: int = 0  # elements of this rank's shards under min_swap_bytes (kept in host memory)
    trainable: Optional[int] = None  # the optimizer's partition (layouts.py): None, all of ``shard``
    quantized: int = 0  # elements of ``shard`` stored int8 (stores/quantized.py)
    quantized_bytes: int = 0  # their packed bytes (codes and scales)
    trained_shard: Optional[int] = None  # the largest shard of a unit that is not frozen: None, largest_shard

    @property
    def largest_trained_shard(self) -> int:
        return self.largest_shard if self.trained_shard is None else self.trained_shard

    def param_bytes(self, itemsize: int) -> int:
        """The partition's parameters as stored: the quantized ones packed."""
        return (self.shard - self.quantized) * itemsize + self.quantized_bytes

    @property
    def optimized(self) -> int:
        """Elements with a master, optimizer states and a gradient."""
        return self.shard if self.trainable is None else self.trainable

    @classmethod
    def of_layout(cls, rank_layout: RankLayout, small_below: int = 0, quantized=frozenset()) -> "RankSizes":
        """This rank's exact sizes; ``small_below``: shards of fewer elements count in ``small_shards``;
        ``quantized``: the units stored int8."""
        units = rank_layout.units
        packed = [u.shard_numel for u in units if u.index in quantized]
        return cls(units[0].world_size if units else 1, rank_layout.numel,
                   sum(u.padded_numel for u in units), max((u.padded_numel for u in units), default=0),
                   max((u.shard_numel for u in units), default=0),
                   max((g.numel for g in rank_layout.trainable_sub_groups), default=0),
                   sum(u.shard_numel for u in units if u.shard_numel < small_below), rank_layout.trainable_numel,
                   sum(packed), sum(packed_nbytes(n) for n in packed),
                   rank_layout.largest_trainable_shard)

    @classmethod
    def of_counts(cls, total_params: int, largest_layer_params: int, world_size: int,
                  sub_group_size: int, trainable_params: Optional[int] = None) -> "RankSizes":
        """Sizes by formula, without a layout: the partition is ``⌈P/W⌉`` (a layout pads each unit),
        the optimizer's ``⌈T/W⌉`` of the ``trainable_params`` (all by default)."""
        shard = -(-total_params // world_size)
        trainable = shard if trainable_params is None else -(-trainable_params // world_size)
        return cls(world_size, shard, total_params, largest_layer_params, -(-largest_layer_params // world_size),
                   min(sub_group_size, trainable), trainable=trainable)


@dataclass(frozen=True)
class RankBytes:
    """A rank's parts summed by where they live (nothing is on the device when computing on the CPU)."""

    host_bytes: int
    device_bytes: int
    nvme_bytes: int
    locked_bytes: int  # the part of host_bytes that is pinned
    parts: Tuple[MemoryPart, ...]

    @classmethod
    def of(cls, parts: Sequence[MemoryPart]) -> "RankBytes":
        def total(where: str) -> int:
            return sum(p.nbytes for p in parts if p.where == where)

        return cls(total(HOST), total(DEVICE), total(NVME), sum(p.nbytes for p in parts if p.locked), tuple(parts))


def rank_memory_parts(sizes: RankSizes, *, stage: int, offload_param, offload_optimizer, itemsize: int,
                      compute_device: str, state_count: int = 2, has_optimizer: bool = True,
                      steps_in_backward: bool = False, max_live_parameters: int = 1_000_000_000,
                      activation_spill=None, gds_param_pool: bool = False) -> List[MemoryPart]:
    """Every part of one rank's memory (see the module's note); ``offload_*`` are the config's
    sections, ``compute_device`` ``"cpu"`` or an accelerator's type, ``activation_spill`` the
    offload section activations spill under (``cpu_checkpointing``), or None;
    ``gds_param_pool``: ``aio.use_gds`` would put the parameter swap buffers in the compute
    device's memory (param_store.py ``gds_pool``), as it does unless their files are striped
    (their own, or the master's they are homed in)."""
    on_cpu = compute_device == "cpu"
    compute = HOST if on_cpu else DEVICE
    home = {"none": compute, "cpu": HOST, "nvme": NVME}
    par, opt = offload_param, offload_optimizer
    param_home, opt_home = home[par.device], home[opt.device]
    # An fp32 partition in the master's place is the master (param_store.py's notes).
    is_master = itemsize == 4 and has_optimizer and param_home == opt_home
    whole = stage < 3
    shard_bytes = sizes.param_bytes(itemsize)
    parts: List[MemoryPart] = []

    def add(what, nbytes, setting, where, locked=False, fix=None):
        if nbytes:
            fixed = fix or _fix(setting, stage, sizes.total)
            parts.append(MemoryPart(what, int(nbytes), setting, fixed, where, locked))

    if par.device == "nvme":
        add("parameter partitions too small for NVMe kept in host memory (min_swap_bytes)",
            sizes.small_shards * itemsize, "zero_optimization.offload_param.min_swap_bytes", HOST)
        in_cpu = min(par.max_in_cpu, sizes.shard - sizes.small_shards)
        if in_cpu:
            add("parameters kept in host memory (max_in_cpu)", in_cpu * itemsize,
                "zero_optimization.offload_param.max_in_cpu", HOST)
        in_cpu += sizes.small_shards
        count = swap_buffer_count(par, sizes.largest_shard, sizes.shard)
        on_device = gds_param_pool and not (several_drives(par) or (is_master and several_drives(opt)))
        add(f"parameter swap buffers ({count} x {format_bytes(sizes.largest_shard * itemsize)})",
            count * sizes.largest_shard * itemsize, "zero_optimization.offload_param.buffer_count",
            compute if on_device else HOST, locked=par.pin_memory and not on_device)
        # homed in the master: the trainable units' shards; the frozen ones have swap files of their own
        own = sizes.shard - in_cpu if not is_master else min(sizes.shard - sizes.optimized, sizes.shard - in_cpu)
        packed = min(own, sizes.quantized)  # frozen units' files, int8 (none is homed in the master)
        add("parameter swap files", (own - packed) * itemsize + packed * sizes.quantized_bytes // max(1, sizes.quantized),
            "zero_optimization.offload_param.nvme_path", NVME)
    elif not is_master:
        if whole:
            what = ("parameters, whole (one rank: its partition is the whole model)" if sizes.world_size == 1
                    else "parameter partition of this rank (written by the step, then gathered)")
            add(f"{what} on the compute device (zero_optimization.stage {stage})", shard_bytes,
                "zero_optimization.stage", compute)
        elif par.device == "cpu":
            add("parameter partitions in host memory (offload_param.device cpu)", shard_bytes,
                "zero_optimization.offload_param.device", HOST)
        else:
            add("parameter partitions on the compute device (offload_param.device none)", shard_bytes,
                "zero_optimization.offload_param.device", compute)

    if is_master and par.device != "nvme" and sizes.quantized:
        add("frozen parameter partitions stored int8 (zero_quantized_nontrainable_weights)", sizes.quantized_bytes,
            "zero_optimization.offload_param.device", param_home)
    if has_optimizer:
        # fp32 shards in the master's flat home are the master, frozen units' included (engine/build.py),
        # but for those stored int8 (outside it)
        master = sizes.shard - sizes.quantized if is_master and par.device != "nvme" else sizes.optimized
        states = (1 + state_count) * 4 * sizes.optimized + 4 * master
        if opt.device == "nvme":
            sg = sizes.largest_sub_group
            per_buffer = (1 + state_count) * align_up(sg * 4) + sg * 4
            count = nvme_buffer_count(opt, steps_in_backward)
            add(f"optimizer swap buffers ({count} x {format_bytes(per_buffer)})", count * per_buffer,
                "zero_optimization.sub_group_size", HOST, locked=opt.pin_memory)
            add(f"gradient buffers of the sub-groups being filled ({OPEN_GRAD_SUB_GROUPS} x "
                f"{format_bytes(sg * 4)})", OPEN_GRAD_SUB_GROUPS * sg * 4, "zero_optimization.sub_group_size", HOST)
            add("optimizer swap files (fp32 master weights, optimizer states, gradients)", states,
                "zero_optimization.offload_optimizer.nvme_path", NVME)
        elif opt.device == "cpu":
            add("fp32 master weights, optimizer states and gradients in host memory (offload_optimizer.device "
                "cpu)", states, "zero_optimization.offload_optimizer.device", HOST)
        else:
            setting = "zero_optimization.stage" if stage == 0 else "zero_optimization.offload_optimizer.device"
            add("fp32 master weights, optimizer states and gradients on the compute device "
                "(offload_optimizer.device none)", states, setting, compute,
                fix=_STAGE_0_OPTIMIZER_FIX if stage == 0 else None)

    if has_optimizer and not on_cpu and opt_home != compute:
        # the working memory of a GPU's copies to and from the host-side optimizer (runtime notes)
        slab = crossing_slab_bytes(sizes.largest_trained_shard)
        add(f"gradient crossing's host slabs ({MAX_IN_FLIGHT} x {format_bytes(slab)})", MAX_IN_FLIGHT * slab,
            "zero_optimization.offload_optimizer.device", HOST,
            fix="set zero_optimization.offload_optimizer.device to 'none' (gradients then stay on the GPU)")
    if has_optimizer and makes_write_back_ring(par, opt, not on_cpu):
        add(f"write-back staging ring ({format_bytes(RING_BYTES)})", RING_BYTES,
            "zero_optimization.offload_optimizer.pin_memory", HOST,
            fix="set zero_optimization.offload_optimizer.pin_memory to false (each write-back then waits "
                "for its copy)")

    if activation_spill is not None:
        count, size = ActivationSwapper.BUFFER_COUNT, ActivationSwapper.BUFFER_BYTES
        add(f"activation swap buffers ({count} x {format_bytes(size)})", count * size,
            "activation_checkpointing.cpu_checkpointing", HOST, locked=activation_spill.pin_memory)

    free = sizes.world_size == 1 and param_home == compute  # the gathered units view the partition
    if not free:
        if whole:
            add(f"parameters, whole on every rank (zero_optimization.stage {stage} keeps every unit gathered)",
                sizes.total * itemsize, "zero_optimization.stage", compute)
        else:
            live = max(sizes.largest_unit, min(max_live_parameters, sizes.total))
            add(f"gathered parameters (largest unit {format_bytes(sizes.largest_unit * itemsize)}, up to "
                f"stage3_max_live_parameters)", live * itemsize, "zero_optimization.stage3_max_live_parameters",
                compute)
    return parts


_STAGE_0_OPTIMIZER_FIX = ("set zero_optimization.stage to 1 or 2 with zero_optimization.offload_optimizer.device "
                          "'nvme' (offload_optimizer needs stage 1 or more)")


def _fix(setting: str, stage: int, total: int) -> str:
    """What to do about the part ``setting`` shrinks, in words that hold at ``stage`` (``total``:
    the model's parameters)."""
    if setting == "zero_optimization.stage":
        return (f"set zero_optimization.stage to 3 with zero_optimization.offload_param.device 'nvme' and "
                f"stage3_max_live_parameters below the model's {total} parameters (stage {stage} keeps every "
                f"parameter whole on each rank; stage 3 gathers at most that many at once and keeps the rest on "
                f"NVMe), or train a smaller model")
    if setting.endswith(".device"):
        return f"set {setting} to 'nvme'"
    if setting.endswith("cpu_checkpointing"):
        return f"set {setting} to false (its buffers stage the saved activations written to NVMe)"
    if setting.endswith("max_in_cpu"):
        return f"lower {setting} (0 keeps every partition on NVMe)"
    if setting.endswith("nvme_path"):
        return f"point {setting} at a drive with more free space"
    return f"lower {setting}"


def location(compute_device) -> str:
    """``"cpu"`` or the accelerator's type, from a torch.device or its name."""
    return str(getattr(compute_device, "type", compute_device)).split(":")[0]

