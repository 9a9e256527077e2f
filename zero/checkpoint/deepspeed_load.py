"""A DeepSpeed ZeRO checkpoint loaded into this engine: ``engine.load_checkpoint(dir)`` continues
a DeepSpeed run.

load.py hands a checkpoint directory here when it holds DeepSpeed's files
(deepspeed_files.py), so there is no converter step: the same call loads our
checkpoints and DeepSpeed's, saved at any ZeRO stage (1-3) and world size, into
an engine of any stage and world size. What DeepSpeed's own
``load_checkpoint`` restores is restored: the fp32 master weights (and so the
parameters), the optimizer's states (``exp_avg``, ``exp_avg_sq``) and step
count, its settings (lr, betas, eps, weight_decay), the fp16 dynamic loss
scale, the step counters (``global_steps``, ``global_samples``,
``skipped_steps``; ``micro_steps`` = ``global_steps`` times this engine's
gradient accumulation, DeepSpeed keeps none), the LR schedule
(``lr_scheduler.load_state_dict``), the module's buffers, and the client
state, returned as DeepSpeed returns it (every key of the model states file
that is not DeepSpeed's own). DeepSpeed's torch_adam runs torch's AdamW and
this engine runs torch's fused AdamW kernel on the same values, so the steps
that follow equal DeepSpeed's continuation to float rounding
(tests/test_zero_checkpoint_deepspeed.py states the tolerance).

As for our own checkpoints, everything is checked on every rank before
anything changes (load.py's protocol): each file's bytes against its CRCs,
each pickle through the allow-list, that the checkpoint holds exactly this
model's parameters with their shapes (tied parameters under any of their
names; with ``load_module_strict=False`` those it lacks, as DeepSpeed's
``exclude_frozen_parameters`` leaves them out, keep their values), every element range the load will read, the optimizer states this
engine's optimizer needs, and the schedule's state. Only then are the
sub-groups filled, each from the ranges of DeepSpeed's flat tensors that hold
it (deepspeed_layout.py), one sub-group at a time.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from ..runtime.timers import log_rank0
from .deepspeed_files import find_files, load_file, verify_archive
from .deepspeed_layout import DeepSpeedCheckpoint, read_checkpoint


def _match_parameters(engine, ds: DeepSpeedCheckpoint, strict: bool = True) -> Dict[Tuple[int, int], str]:
    """(unit, slot) of each of this engine's parameters -> the name DeepSpeed saved it under; with
    ``strict`` False a parameter the checkpoint lacks (DeepSpeed's ``exclude_frozen_parameters``)
    is left out of the plan and keeps its value."""
    plan: Dict[Tuple[int, int], str] = {}
    missing, wrong, trains = [], [], []
    used = set()
    for unit in engine.rank_layout.units:
        for index, slot in enumerate(unit.slots):
            names = [ds.aliases.get(n, n) for n in slot.names]
            found = [n for n in dict.fromkeys(names) if n in ds.params]
            if not found:
                missing.append(slot.name)
                if engine.parts.units[unit.index].params[index].requires_grad:
                    trains.append(slot.name)
                continue
            name = found[0]
            if ds.params[name].shape != tuple(slot.shape):
                wrong.append(f"{slot.name}: {list(ds.params[name].shape)} in the checkpoint, {list(slot.shape)} here")
            plan[(unit.index, index)] = name
            used.add(name)
    extra = sorted(set(ds.params) - used)
    if (missing and strict) or wrong or extra:
        parts = []
        if missing:
            parts.append(f"parameters missing from it: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
                         + ("" if trains else " (saved with exclude_frozen_parameters=True? load_module_strict=False "
                                              "keeps this model's values for them)"))
        if extra:
            parts.append(f"parameters this model lacks: {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else ""))
        if wrong:
            parts.append(f"shapes that differ: {'; '.join(wrong[:5])}")
        raise ValueError(f"the DeepSpeed checkpoint {ds.path} was saved from a different model ({'; '.join(parts)})")
    if trains:
        log_rank0(engine.comm.rank, f"load_checkpoint(load_module_strict=False): the DeepSpeed checkpoint {ds.path} lacks "
                  f"{len(trains)} parameter(s) this engine trains ({', '.join(trains[:5])}"
                  f"{' ...' if len(trains) > 5 else ''}): they keep this model's values, their optimizer states start "
                  f"at zero", logging.WARNING)
    return plan


def _hyper_state(engine, ds: DeepSpeedCheckpoint) -> Optional[dict]:
    """The optimizer's hyper state (engine/optimizer.py's ``hyper_state`` form) continued from DeepSpeed's."""
    optimizer = engine.optimizer
    if optimizer.inner is not None:
        raise ValueError("this engine runs the script's own torch optimizer, whose state a DeepSpeed checkpoint "
                         "does not map onto; load it with load_optimizer_states=False")
    state = optimizer.hyper_state()
    groups = state["param_groups"]
    if ds.param_groups:
        if len(ds.param_groups) == 1:
            saved = ds.param_groups * len(groups)
        elif len(ds.param_groups) == len(groups):
            saved = ds.param_groups
        else:
            raise ValueError(f"the DeepSpeed checkpoint {ds.path} has {len(ds.param_groups)} optimizer param "
                             f"groups, this engine {len(groups)}: their settings cannot be matched")
        for group, values in zip(groups, saved):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in values.items() if k in group})
    state["adam_step"] = ds.adam_step if ds.adam_step is not None else ds.global_steps - ds.skipped_steps
    state["skipped_steps"] = ds.skipped_steps
    record = ds.loss_scaler
    if optimizer.scaler.dynamic and record is not None and record.dynamic:
        state["loss_scaler"] = {
            "loss_scale": float(record.field("cur_scale")),
            "cur_hysteresis": int(record.field("cur_hysteresis", record.field("delayed_shift", 1))),
            "cur_iter": int(record.field("cur_iter", 0)),
            "last_overflow_iter": int(record.field("last_overflow_iter", -1)),
        }
    return state


def _check_scheduler(engine, ds: DeepSpeedCheckpoint) -> Optional[dict]:
    """DeepSpeed's schedule state, when this engine has a schedule to continue (else None)."""
    if engine.lr_scheduler is None or ds.lr_scheduler is None:
        return None
    state = ds.lr_scheduler
    if hasattr(engine.lr_scheduler, "last_batch_iteration") and not isinstance(
            state.get("last_batch_iteration"), int):
        raise ValueError(f"the DeepSpeed checkpoint {ds.path} holds an LR schedule state without "
                         f"'last_batch_iteration' ({sorted(state)}): not one of DeepSpeed's schedules; load it "
                         f"with load_lr_scheduler_states=False")
    return state


def _read(engine, ds: DeepSpeedCheckpoint, load_optimizer_states: bool, load_lr_scheduler_states: bool,
          strict: bool):
    """Everything checked (see the module's docstring); returns (plan, keys, hyper state, schedule state)."""
    plan = _match_parameters(engine, ds, strict)
    names = tuple(engine.checkpointed_state.state_names)
    load_states = load_optimizer_states and engine.optimizer is not None
    if load_states:
        lacking = [n for n in names if n not in ds.state_keys]
        if lacking:
            raise ValueError(f"the DeepSpeed checkpoint {ds.path} holds the optimizer states "
                             f"{list(ds.state_keys)}, this engine's optimizer needs {list(names)}: load it with "
                             f"load_optimizer_states=False to take the weights only")
    keys = ["master"] + (list(names) if load_states else [])
    for name in dict.fromkeys(plan.values()):
        ds.check(name, keys)
    hyper = _hyper_state(engine, ds) if load_states else None
    schedule = _check_scheduler(engine, ds) if load_lr_scheduler_states else None
    return plan, keys, hyper, schedule


def load_deepspeed_checkpoint(engine, checkpoint: str, load_optimizer_states: bool,
                              load_lr_scheduler_states: bool, load_module_strict: bool = True) -> Tuple[str, dict]:
    """Load the DeepSpeed checkpoint in ``checkpoint`` (a tag's directory) into ``engine``;
    returns (checkpoint, client_state) as load.py does."""
    comm = engine.comm
    ds: Optional[DeepSpeedCheckpoint] = None
    error = None
    try:
        files = find_files(checkpoint)
        for path in files.all[comm.rank::comm.world_size]:  # each file's CRCs checked by one rank
            verify_archive(path)
        ds = read_checkpoint(files, load_file)
        plan, keys, hyper, schedule = _read(engine, ds, load_optimizer_states, load_lr_scheduler_states,
                                            load_module_strict)
    except Exception as exc:  # noqa: BLE001 - every rank must learn that one failed, so that none loads
        error = exc
    try:
        if comm.any(error is not None):
            if error is not None:
                raise error
            raise RuntimeError(f"load_checkpoint({checkpoint}) failed on another rank; nothing was loaded")
        try:
            _apply(engine, ds, plan, keys, hyper, schedule)
        except BaseException as exc:
            engine.mark_unusable(f"load_checkpoint({checkpoint}) failed while writing the checked state into "
                                 f"the engine ({type(exc).__name__}: {exc}); the engine holds a mix of states. "
                                 f"Load a checkpoint again (engine.load_checkpoint) before using it")
            raise
        client_state = ds.client_state
    finally:
        if ds is not None:
            ds.close()
    engine.mark_usable()
    log_rank0(comm.rank, f"loaded DeepSpeed checkpoint {checkpoint} (ZeRO stage {ds.stage}, {ds.world_size} "
                         f"ranks, step {ds.global_steps})", logging.INFO)
    return checkpoint, client_state


def _apply(engine, ds: DeepSpeedCheckpoint, plan: Dict[Tuple[int, int], str], keys: List[str],
           hyper: Optional[dict], schedule: Optional[dict]) -> None:
    layout, rank = engine.rank_layout, engine.comm.rank
    store = engine.checkpointed_state
    engine.begin_load()
    with torch.no_grad():
        for sg in layout.sub_groups:
            missing = [(i, s) for i in sg.units for s in range(len(layout.units[i].slots)) if (i, s) not in plan]
            if sg.frozen and len(missing) == sum(len(layout.units[i].slots) for i in sg.units):
                continue  # all left out of the checkpoint: nothing changes
            sg_keys = keys[:1] if sg.frozen else keys  # a frozen sub-group has no states here
            values = {k: torch.zeros(sg.numel, dtype=torch.float32) for k in sg_keys}
            if missing:  # what the checkpoint lacks keeps its values (and zero states)
                values["master"] = engine.current_master(sg)
            for index in sg.units:
                base = layout.offsets[index] - sg.start
                for piece in layout.units[index].pieces(rank):
                    name = plan.get((index, piece.slot))
                    if name is None:
                        continue
                    at = base + piece.shard_offset
                    for k in sg_keys:
                        ds.read(name, piece.param_start, piece.param_stop, k, values[k][at:at + piece.numel])
            master = values.pop("master")
            store.load(sg, master, values if len(sg_keys) > 1 else None)
            engine.load_parameters(sg, master)
        engine.finish_load()
    engine.global_steps = ds.global_steps
    if ds.global_samples is not None:
        engine.global_samples = ds.global_samples
    engine.micro_steps = ds.global_steps * engine.gradient_accumulation_steps()
    if hyper is not None:
        engine.optimizer.load_hyper_state(hyper)
    if schedule is not None:
        engine.lr_scheduler.load_state_dict(schedule)
    for name, buffer in engine.module.named_buffers():
        if name in ds.buffers:
            buffer.copy_(ds.buffers[name])
