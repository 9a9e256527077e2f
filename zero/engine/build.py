"""Turn a module and a validated config into the engine's parts.

Order matters and is the whole point of this file: plan the units; build the
optimizer store (fp32 master, states, gradient partition) and the parameter
store (which may alias the master, see stores/param_store.py); fill both from the
model's values one unit at a time, releasing each unit's full parameters as
soon as its shard is stored, so the model is never held twice; then the
gradient reducer, the optimizer and the hooks.

[Note: the ZeRO ladder]
Stages 0, 1 and 2 are stage 3 with every unit persistent: each rank keeps every
parameter whole (gathered once after each step or load, never released, so a
forward and backward run at plain PyTorch speed with no gather), while the fp32
master and optimizer states stay partitioned over the ranks (host or NVMe with
``offload_optimizer``: ZeRO-Offload) and each unit's gradients are reduced into
their owners' partitions as backward completes the unit, never a whole-model
gradient per rank. That is DeepSpeed's stage 2 for stages 1 and 2 alike (stage
1's whole gradients before a reduce-scatter would only cost memory: the values
are the same), and for stage 0 too: a data-parallel step reduce-scatters the
gradients and all-gathers the updated parameters, the same bytes on the wire as
DDP's all-reduce (under gloo by exchanging slices: runtime/_slice_exchange.py),
and every rank's parameters equal DDP's. What differs from
DeepSpeed's stage 0 is memory: the optimizer states are partitioned, not
replicated. One layout for every stage also makes checkpoints move between
stages and rank counts as they are (checkpoint/load.py reshards).

[Note: a failed build gives back what it took]
Each step that takes something (a job id, a store with its swap directory,
files, handles and locked pool, the parameters' link to their units, the
hooks) pushes its release onto ``EngineParts.release``, an ExitStack, right
after taking it. A step that raises has the stack closed, last taken first,
and the error goes on unchanged (a release that fails too is noted on it,
never raised in its place), so ``zero.initialize`` can be called again in the
same process with the same ``nvme_path``. A built engine closes the same
stack when it is destroyed or collected. Everything that can refuse the
model or the config without I/O runs before the stores are filled, and so
does the free-space check: a failure there leaves the model as it was given.
From the fill on, the model's values live only in the stores; a failure then
says so on the error, and a later ``zero.initialize`` of that model refuses
its emptied parameters by name (:func:`check_has_values`) instead of
training zeros.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
import torch.nn as nn

from nvmeio import AioSettings, require_gds
from nvmeio import env

from ..runtime.comm import Comm
from ..config import ConfigError, DeepSpeedConfig, Problem
from ..config.activation_checkpointing import spill_offload
from ..runtime.hooks import Coordinator
from ..stores import memory_check
from ..runtime.grad_stash import NO_STASH, GradStash
from ..runtime.grad_reducer import GradReducer
from ..runtime import host_to_device
from ..runtime.write_back import StagedWrites
from ..runtime.activation_spill import SavedActivations
from ..stores.malloc_trim import return_freed_heap
from ..stores import malloc_settings
from ..partitioning.active_context import meta_parameter_names
from ..partitioning.init_store import forget_init_shard, full_param_value, init_shard_lost, is_init_partitioned
from ..runtime.timers import Timers, log_rank0
from .loss_scaler import make_loss_scaler
from .optimizer import AdamKind, ZeroOptimizer, stash_norm_ranges, step_in_backward_blocker
from ..stores.optimizer_store import FlatOptimizerStore, NvmeOptimizerStore, OptimizerStore
from ..stores.pinned_host import for_gpu_copies, makes_write_back_ring
from ..stores.param_store import FlatParamStore, NvmeParamStore, ParamStore, swap_checksum
from ..stores.quantized import GROUP_SIZE, NOT_QUANTIZED, FrozenShards
from ..stores.layouts import RankLayout, build_rank_layout
from ..runtime.unit import ParamUnit, plan_units

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_JOBS_IN_USE: Set[str] = set()  # job ids of this process's live engines


@dataclass
class OptimizerSpec:
    """What to optimize and how, decided by initialize() from the config or the script's optimizer."""

    groups: List[dict]  # {"params": [...], hyper-parameters...}
    adam: Optional[AdamKind]  # None: a torch optimizer type, below
    torch_type: Optional[type] = None
    torch_defaults: Optional[dict] = None


@dataclass
class EngineParts:
    dtype: torch.dtype
    units: List[ParamUnit]
    rank_layout: RankLayout
    param_store: ParamStore
    optimizer_store: Optional[OptimizerStore]
    reducer: Optional[GradReducer]
    optimizer: Optional[ZeroOptimizer]
    coordinator: Coordinator
    job_id: str
    release: contextlib.ExitStack  # gives back everything above (see the module's note)
    activations: Optional[SavedActivations] = None  # train_batch's saved-tensor store (cpu_checkpointing)


def _aio(config: DeepSpeedConfig) -> AioSettings:
    """The handle settings for the swappers (``use_gds``: refused here unless it can run)."""
    settings = config.aio.settings()
    if settings.use_gds:
        require_gds()
    return settings


def _cast_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            b = b.to(device)
            if b.is_floating_point() and dtype != torch.float32:
                b = b.to(dtype)
            m._buffers[name] = b


def _unit_shard(params: List[nn.Parameter], layout, comm: Comm) -> torch.Tensor:
    """This rank's fp32 shard of a unit, from the full parameter values: rank 0's, as DDP and
    DeepSpeed start every rank from (a model built outside zero.Init holds each rank's own
    initial values, which would otherwise train as a silent mix)."""
    flat = torch.cat([full_param_value(p, comm).detach().reshape(-1).to(torch.float32) for p in params]) \
        if params else torch.empty(0)
    if comm.distributed and params and not all(is_init_partitioned(p) for p in params):
        flat = comm.broadcast(flat, src=0)  # on the device the backend takes (runtime/comm.py)
    start = layout.shard_start(comm.rank)
    shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=flat.device)
    piece = flat[start:start + layout.shard_numel]
    shard[:piece.numel()].copy_(piece)
    return shard


JOB_ID_ENV = "NVMEIO_JOB_ID"


def _job_id(zc) -> str:
    """``zero_optimization.nvme_job_id``, else $NVMEIO_JOB_ID, else "zero_stage_3"; an engine made
    while another of the same process holds that id gets ".1", ".2", ..."""
    base = zc.nvme_job_id or env.get(JOB_ID_ENV)
    n = 0
    while (job_id := base if n == 0 else f"{base}.{n}") in _JOBS_IN_USE:
        n += 1
    _JOBS_IN_USE.add(job_id)
    return job_id


def release_job_id(job_id: str) -> None:
    """The engine holding ``job_id`` is gone (destroyed or collected)."""
    _JOBS_IN_USE.discard(job_id)


def _swap_store(make):
    """Build an NVMe store; a swap directory another job may own gets a note on how to set the job id."""
    from swapper import StaleSwapDirectoryError, SwapDirectoryInUseError

    try:
        return make()
    except (SwapDirectoryInUseError, StaleSwapDirectoryError) as error:
        error.message += (f" (set the job id with zero_optimization.nvme_job_id in the config or the "
                          f"{JOB_ID_ENV} environment variable)")
        raise


def release_after_failure(release: contextlib.ExitStack, error: BaseException) -> None:
    """Close ``release`` because ``error`` is being raised: every release runs, last taken first,
    and one that fails is noted on ``error``, never raised in its place."""
    try:
        release.__exit__(type(error), error, error.__traceback__)  # exit callbacks see the error
    except BaseException as other:  # noqa: BLE001 - noted; the build's own error is the one to raise
        error.add_note(f"giving back what the failed build had taken also failed: {type(other).__name__}: {other}")


def _note_values_taken(units: List[ParamUnit]):
    """Pushed when the fill starts: a failure from then on says where the model's values went
    (unless every parameter still views its shard: one rank, resident stores)."""
    def on_exit(exc_type, error, tb) -> bool:
        if error is not None and any(_has_no_values(p) for u in units for p in u.params):
            error.add_note("the model's parameter values had been moved into the engine's stores (the model is "
                           "never held twice) and went with them: build or load the model again before the "
                           "next zero.initialize")
        return False
    return on_exit


def _unlink_units(units: List[ParamUnit]) -> None:
    """The parameters no longer belong to these units (a failed build, a destroyed engine)."""
    for u in units:
        for p in u.params:
            if getattr(p, "_zero_unit", None) is u:
                p._zero_unit = None


def build_parts(module: nn.Module, config: DeepSpeedConfig, comm: Comm, device: torch.device,
                spec: Optional[OptimizerSpec], timers: Timers) -> EngineParts:
    release = contextlib.ExitStack()
    try:
        job_id = _job_id(config.zero_optimization)
        release.callback(release_job_id, job_id)
        return _build_parts(module, config, comm, device, spec, timers, job_id, release)
    except BaseException as error:
        release_after_failure(release, error)
        raise


def _build_parts(module: nn.Module, config: DeepSpeedConfig, comm: Comm, device: torch.device,
                 spec: Optional[OptimizerSpec], timers: Timers, job_id: str,
                 release: contextlib.ExitStack) -> EngineParts:
    """The build, step by step; each step that takes something pushes its release."""
    zc = config.zero_optimization
    aio = _aio(config)  # before anything is built: use_gds is refused, never dropped
    dtype = DTYPES[config.precision]
    check_no_meta(module)
    check_has_values(module)
    if device.type == "cpu" and spec is not None and malloc_settings.hold():
        release.callback(malloc_settings.let_go)  # gradients and activations are host tensors
    module_units, rank_layout, units, (headroom, activation_budget) = _plan(module, config, comm, device, dtype, spec)
    frozen = _frozen_shards(config, units, spec, comm, device)
    opt_store = _make_optimizer_store(config, rank_layout, spec, aio, job_id, comm, device, dtype, release, frozen)
    param_store = _make_param_store(config, rank_layout, dtype, opt_store, aio, job_id, comm, device, release,
                                    frozen)
    _link_units(units, rank_layout, param_store, opt_store, release)
    _fill_stores(units, param_store, comm, release)
    _cast_buffers(module, device, dtype)  # here, so that a failure before the fill leaves the model as given
    _choose_persistent(units, zc)
    reducer, optimizer = _make_optimizer(config, spec, rank_layout, units, opt_store, param_store, comm, device,
                                         dtype, headroom, release)
    coordinator = _install_hooks(module, units, module_units, reducer, param_store, zc, timers, release)
    activations = _make_activation_store(config, aio, job_id, comm, device, activation_budget, release) \
        if optimizer is not None else None  # train_batch needs an optimizer
    # The engine owns the releases now: its destroy() closes them, a failure before it is returned too.
    return EngineParts(dtype, units, rank_layout, param_store, opt_store, reducer, optimizer, coordinator, job_id,
                       release.pop_all(), activations)


def _plan(module, config, comm, device, dtype, spec):
    """Units (one per module owning parameters), this rank's layout, and the host-memory check
    (with the headroom it leaves for the gradient stash and the default activation budget, in bytes)."""
    layouts, params_per_unit, module_units = plan_units(module, comm.world_size, split_frozen=spec is not None)
    # Units with no parameter to train: no master, states or gradient (stores/layouts.py [Note: the
    # optimizer covers the trainable units only]); without an optimizer there are none of those.
    frozen = {l.index for l, ps in zip(layouts, params_per_unit)
              if spec is not None and not any(p.requires_grad for p in ps)}
    rank_layout = build_rank_layout(layouts, comm.rank, config.zero_optimization.sub_group_size, frozen)
    units = [ParamUnit(l, ps, comm, device, dtype) for l, ps in zip(layouts, params_per_unit)]
    adam_states = len(spec.adam.state_names) if spec is not None and spec.adam is not None else 2
    parts = memory_check.host_memory_parts(config, rank_layout, dtype.itemsize,
                                           adam_states, spec is not None, _steps_in_backward(config, spec),
                                           compute_device=device, quantized=_quantized_units(config, units, spec))
    memory = memory_check.probe()
    memory_check.check_host_memory(parts, memory)
    return module_units, rank_layout, units, (memory_check.headroom_bytes(parts, memory),
                                              memory_check.activation_budget_bytes(parts, memory))


def _steps_in_backward(config, spec) -> bool:
    """Whether the engine will step NVMe sub-groups during backward (the store reads further
    ahead then): what ZeroOptimizer.why_not_step_in_backward answers, from the config."""
    offload = config.zero_optimization.offload_optimizer
    return (spec is not None and offload.device == "nvme" and offload.step_in_backward
            and step_in_backward_blocker(config.gradient_clipping, make_loss_scaler(config).dynamic, spec.adam,
                                         spec.torch_type is not None) is None)


def _param_home(config, device: torch.device) -> torch.device:
    """Where flat parameter shards live (offload_param device none: the compute device)."""
    return device if config.zero_optimization.offload_param.device == "none" else torch.device("cpu")


def _make_optimizer_store(config, rank_layout, spec, aio, job_id, comm, device, dtype, release,
                          frozen: FrozenShards):
    """The fp32 master and optimizer states of the trainable units: on NVMe, or flat on the device
    or the host (where fp32 parameter shards share its home, its master holds every unit's not
    stored quantized: the parameter store's flat tensor)."""
    if spec is None:
        return None
    offload = config.zero_optimization.offload_optimizer
    state_names = spec.adam.state_names if spec.adam is not None else ()
    if offload.device == "nvme":
        steps = _steps_in_backward(config, spec)
        store = _swap_store(lambda: NvmeOptimizerStore(rank_layout, state_names, offload, aio, job_id, comm.rank,
                                                       steps_in_backward=steps))
    else:
        home = device if offload.device == "none" else torch.device("cpu")
        holds_params = (dtype == torch.float32 and config.zero_optimization.offload_param.device != "nvme"
                        and _param_home(config, device) == home)
        # pinned host memory speeds copies to and from a GPU only: computing on the CPU, it is not taken
        store = FlatOptimizerStore(rank_layout, state_names, home, offload.pin_memory and device.type == "cuda",
                                   holds_params=holds_params, packed=frozen.units)
    release.callback(store.close)
    return store


def _quantized_units(config, units: List[ParamUnit], spec: Optional[OptimizerSpec]) -> set:
    """The units ``zero_quantized_nontrainable_weights`` stores int8 (stage 3): those whose parameters
    are all frozen, every one in an engine without an optimizer (see stores/quantized.py)."""
    zc = config.zero_optimization
    if not zc.zero_quantized_nontrainable_weights or zc.stage < 3:
        return set()
    return {u.index for u in units if spec is None or not any(p.requires_grad for p in u.params)}


def _frozen_shards(config, units: List[ParamUnit], spec: Optional[OptimizerSpec],
                   comm: Comm, device: torch.device) -> FrozenShards:
    """The units stored quantized with ``zero_quantized_nontrainable_weights`` (stage 3): those
    whose parameters are all frozen, every one in an engine without an optimizer (see
    stores/quantized.py, [Note: frozen weights stored quantized])."""
    zc = config.zero_optimization
    if not zc.zero_quantized_nontrainable_weights or zc.stage < 3:
        return NOT_QUANTIZED  # below stage 3 the config warned that it has no effect
    frozen = _quantized_units(config, units, spec)  # the layout's frozen units, with an optimizer
    numel = sum(u.layout.numel for u in units if u.index in frozen)
    log_rank0(comm.rank, f"zero_quantized_nontrainable_weights: {len(frozen)} of {len(units)} units "
                         f"({numel} elements) stored int8 with an fp32 scale per {GROUP_SIZE} elements")
    if not frozen:
        logging.getLogger("zero").warning(
            "zero_quantized_nontrainable_weights is set but every unit has a parameter that requires grad: "
            "nothing is stored quantized (freeze parameters with requires_grad_(False) before zero.initialize)")
    return FrozenShards(frozen, to_device=host_to_device.copy_then_reuse if device.type == "cuda" else None)


def _make_param_store(config, rank_layout, dtype, opt_store, aio, job_id, comm, device, release,
                      frozen: FrozenShards) -> ParamStore:
    """The parameter shards: on NVMe (fp32 ones homed in the optimizer's master), else flat (fp32
    ones the master itself where both live in one place), ``frozen`` ones quantized; free space
    checked before the fill, which hands the model's values over for good."""
    offload = config.zero_optimization.offload_param
    if offload.device == "nvme":
        shared = opt_store if dtype == torch.float32 and isinstance(opt_store, NvmeOptimizerStore) else None
        store: ParamStore = _swap_store(lambda: NvmeParamStore(
            rank_layout, dtype, offload, aio, job_id, comm.rank, master=shared, frozen=frozen,
            compute_device=device))
    else:
        home = _param_home(config, device)
        alias = opt_store.master if isinstance(opt_store, FlatOptimizerStore) and opt_store.holds_params else None
        # pageable memory would make each copy a blocking one: read ahead only from pinned memory, which
        # for shards in the optimizer's master is the optimizer's pin_memory
        pin_memory = device.type == "cuda" and (offload.pin_memory if alias is None else opt_store.pinned)
        ahead = host_to_device.AheadCopy if home.type == "cpu" and pin_memory else None
        # a step on the host writes shards on the GPU through registered staging (runtime/write_back.py),
        # pinned memory as the optimizer's pin_memory allows
        zc = config.zero_optimization
        staged = (StagedWrites(for_gpu_copies(True)) if opt_store is not None and makes_write_back_ring(
            zc.offload_param, zc.offload_optimizer, device.type == "cuda") else None)
        store = FlatParamStore(rank_layout, dtype, home, pin_memory, flat=alias,
                               frozen=frozen, compute_device=device, copy_ahead=ahead,
                               ahead_bytes=config.zero_optimization.stage3_prefetch_bucket_size * dtype.itemsize,
                               staged_writes=staged)
    release.callback(store.close)
    store.check_free_space()
    if opt_store is not None:
        opt_store.check_free_space()
    return store


def _link_units(units, rank_layout, param_store, opt_store, release) -> None:
    release.callback(_unlink_units, units)
    for u in units:
        u.attach(param_store, None if u.index in rank_layout.frozen else opt_store)
        for p in u.params:
            p._zero_unit = u


def _fill_stores(units, param_store, comm, release) -> None:
    """The stores get each unit's shard, one unit at a time; the model's full values go as
    soon as they are stored. The master of a quantized shard is its dequantized values."""
    release.push(_note_values_taken(units))
    for u in units:
        shard = param_store.as_stored(u.layout, _unit_shard(u.params, u.layout, comm))
        if u.optimizer_store is not None:
            u.optimizer_store.init_master(u.index, shard)
        param_store.init_shard(u.layout, shard)  # cast on copy into the compute dtype
        del shard
        for slot, p in zip(u.layout.slots, u.params):
            p.ds_shape = torch.Size(slot.shape)
            p.ds_numel = slot.numel
            forget_init_shard(p)
        u.release(force=True)
    param_store.flush()
    return_freed_heap()  # the model's full values, freed unit by unit (stores/malloc_trim.py)


def _choose_persistent(units, zc) -> None:
    """Units gathered for good: free ones, every one below stage 3 (see the [Note: the ZeRO
    ladder]), and in stage 3 small ones within the persistence thresholds."""
    threshold, budget = zc.stage3_param_persistence_threshold, zc.stage3_model_persistence_threshold
    for u in units:
        u.free = u.free_gather()
        if u.free or zc.stage < 3:
            u.persistent = True
        elif u.layout.numel <= threshold and u.layout.numel <= budget:
            u.persistent = True
            budget -= u.layout.numel


def _make_optimizer(config, spec, rank_layout, units, opt_store, param_store, comm, device, dtype, headroom,
                    release):
    """The gradient reducer (a stash to NVMe with the optimizer there, holding completed
    gradients in the memory ``headroom`` leaves; registered host memory for the gradients' copies
    from a GPU to an offloaded optimizer) and the optimizer."""
    if spec is None:
        return None, None
    comm_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else dtype
    group_ranges = _group_ranges(spec, units, rank_layout)
    scaler = make_loss_scaler(config)
    stash = NO_STASH
    if opt_store.stash_gradients:
        stash = GradStash(rank_layout, opt_store.swapper, {u.index for u in units if u.grad_count},
                          hold_budget=headroom, norm_ranges=stash_norm_ranges(rank_layout, group_ranges),
                          want_norms=config.gradient_clipping > 0 or scaler.dynamic,
                          defer_errors=comm.world_size > 1)  # see BackwardPass.raise_if_failed_anywhere
    zc = config.zero_optimization
    pinned = None
    if device.type == "cuda" and zc.offload_optimizer.device != "none":
        pinned = for_gpu_copies(True)  # the crossing's two slabs, whatever pin_memory says of the states
        if pinned is not None:
            release.callback(pinned.close)
    reducer = GradReducer(rank_layout, opt_store.grads, comm, device, dtype, comm_dtype,
                          predivide=config.gradient_predivide_factor, stash=stash, overlap=zc.overlap_comm,
                          bucket_numel=zc.reduce_bucket_size, pinned=pinned)
    optimizer = ZeroOptimizer(rank_layout, opt_store, param_store, reducer, comm,
                              hyper=[{k: v for k, v in g.items() if k != "params"} for g in spec.groups],
                              group_ranges=group_ranges,
                              clip=config.gradient_clipping, scaler=scaler, adam=spec.adam,
                              torch_optimizer_type=spec.torch_type, torch_defaults=spec.torch_defaults)
    return reducer, optimizer


def _install_hooks(module, units, module_units, reducer, param_store, zc, timers, release) -> Coordinator:
    coordinator = Coordinator(module, units, module_units, reducer, param_store,
                              zc.stage3_prefetch_bucket_size if zc.stage == 3 else 0, timers,
                              zc.memory_efficient_linear and zc.stage == 3, whole=zc.stage < 3,
                              max_live_numel=zc.stage3_max_live_parameters,
                              max_reuse_distance=zc.stage3_max_reuse_distance)
    release.callback(coordinator.remove)  # before install(): undoes a part-done one too
    coordinator.install()
    coordinator.gather_persistent()
    return coordinator


def _make_activation_store(config, aio, job_id, comm, device, default_budget, release) -> Optional[SavedActivations]:
    """With ``activation_checkpointing.cpu_checkpointing``: the store of the tensors train_batch
    windows save for backward, spilling past the budget under an offload section's nvme_path;
    without one, none on the CPU (they are in host memory already) and one that only moves
    them to host memory on CUDA."""
    ac = config.activation_checkpointing
    if not ac.cpu_checkpointing:
        return None
    offload = spill_offload(config.zero_optimization)
    if offload is None:
        log_rank0(comm.rank, "[zero] activation_checkpointing.cpu_checkpointing: saved activations stay in host "
                             "memory, all of them (no zero_optimization offload has device nvme to spill to)")
        return SavedActivations(None) if device.type == "cuda" else None
    from swapper import ActivationSwapper

    swapper = _swap_store(lambda: ActivationSwapper(
        offload.nvme_path, aio, job_id=job_id, rank=comm.rank, name="activations",
        checksum=swap_checksum(offload.checksum), pin_memory=offload.pin_memory, remove_stale=True))
    release.callback(swapper.close)
    budget = ac.max_in_cpu_bytes if ac.max_in_cpu_bytes is not None else default_budget
    return SavedActivations(budget, swapper)


def _group_ranges(spec: OptimizerSpec, units: List[ParamUnit], rank_layout: RankLayout):
    group_of: Dict[nn.Parameter, int] = {}
    for g, group in enumerate(spec.groups):
        for p in group["params"]:
            group_of.setdefault(p, g)
    ranges: List[List[tuple]] = [[] for _ in spec.groups]
    for unit_index, slot, start, stop in rank_layout.param_ranges():
        p = units[unit_index].params[slot]
        g = group_of.get(p)
        if g is not None and p.requires_grad:
            ranges[g].append((start, stop))
    return ranges


def check_no_meta(module: nn.Module) -> None:
    """Parameters still on the meta device have no values anywhere: refuse them by name."""
    meta = meta_parameter_names(module)
    if meta:
        shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise ValueError(
            f"{len(meta)} parameter(s) are on the meta device and have no values: {shown}. zero.Init "
            f"materialises meta parameters of modules with reset_parameters() only; load the values "
            f"first (zero.load_pretrained(model, checkpoint)) or build these modules off the meta device")
    buffers = [name for name, b in module.named_buffers() if b.is_meta]
    if buffers:
        shown = ", ".join(buffers[:5]) + (f" and {len(buffers) - 5} more" if len(buffers) > 5 else "")
        raise ValueError(
            f"{len(buffers)} buffer(s) are on the meta device and have no values: {shown}. Buffers a "
            f"constructor computes on the meta device are lost; build the model off the meta device (each "
            f"module is still partitioned as it is built), or, for Hugging Face models, with from_pretrained "
            f"under zero.Init, which computes them")


def _has_no_values(p: torch.Tensor) -> bool:
    """Emptied for an engine or a zero.Init context that failed, was destroyed or holds it still."""
    if is_init_partitioned(p):
        return init_shard_lost(p)
    return not p.is_meta and p.numel() == 0 and getattr(p, "ds_numel", 0) > 0


def check_has_values(module: nn.Module) -> None:
    """Parameters whose values went with a failed build, a destroyed engine or a failed zero.Init
    would train as zeros: refuse them by name."""
    gone = [name for name, p in module.named_parameters() if _has_no_values(p)]
    if gone:
        shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
        raise ValueError(
            f"{len(gone)} parameter(s) hold no values: {shown}. Their values were handed to a ZeRO engine or a "
            f"zero.Init context that failed, was destroyed or still holds them; build or load the model again")


def check_params_known(module: nn.Module, spec: OptimizerSpec) -> None:
    """Every parameter handed to the optimizer must belong to the model."""
    known = set(module.parameters())
    for g, group in enumerate(spec.groups):
        for p in group["params"]:
            if p not in known:
                raise ConfigError([Problem("model_parameters", (
                    f"parameter group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    f"parameter of the model; pass model.parameters() or groups of them"))])
