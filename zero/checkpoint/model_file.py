"""``save_16bit_model``: the whole model in its compute dtype, one unit gathered at a time; and
``fp32_state_dict``: the whole model in fp32 from the optimizer's master weights."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch

from nvmeio import FastFileWriter, SafetensorsWriter

from ..partitioning.full_state_dict import full_state_dict
from ..runtime.timers import log_rank0


def save_16bit_model(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Gather every unit (one at a time) and save the module's state_dict in the compute dtype (rank 0).

    A ``save_filename`` ending in ``.safetensors`` is written streaming: each unit's
    parameters go to the file as soon as they are gathered, so the model is never
    whole in memory. Otherwise the state_dict is assembled and written with
    ``torch.save``. Either way through nvmeio's FastFileWriter, atomically.

    At stage 3 it saves only with ``stage3_gather_16bit_weights_on_model_save``
    (else it logs why and returns False); below stage 3 every rank holds the
    whole parameters, so it saves without that flag, as DeepSpeed does.
    """
    comm = engine.comm
    zc = engine.config.zero_optimization
    if zc.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
        log_rank0(comm.rank, (
            "did not save the model: zero_optimization.stage3_gather_16bit_weights_on_model_save is false at "
            "ZeRO stage 3; set it to true, or consolidate a checkpoint with zero_to_fp32"), logging.WARNING)
        return False
    path = os.path.join(save_dir, save_filename)
    param_names = {n for u in engine.rank_layout.units for s in u.slots for n in s.names}
    buffers, writer = {}, None
    if comm.rank == 0:
        os.makedirs(save_dir, mode=engine.config.checkpoint.dir_mode, exist_ok=True)
        buffers = {name: t.detach().cpu() for name, t in engine.module.state_dict(keep_vars=True).items()
                   if name not in param_names}
        if save_filename.endswith(".safetensors"):
            spec = {name: (p.dtype, tuple(slot.shape)) for unit in engine.units
                    for slot, p in zip(unit.layout.slots, unit.params)
                    if not (exclude_frozen_parameters and not p.requires_grad) for name in slot.names}
            spec.update({name: (b.dtype, tuple(b.shape)) for name, b in buffers.items()})
            writer = SafetensorsWriter(path, spec, {"format": "pt"})
    values = {}
    try:
        with torch.no_grad():
            for unit in engine.each_unit_gathered(trainable_only=exclude_frozen_parameters):
                if comm.rank == 0:
                    for slot, p in zip(unit.layout.slots, unit.params):
                        if exclude_frozen_parameters and not p.requires_grad:
                            continue
                        tensor = p.detach().to("cpu", copy=True)
                        for name in slot.names:
                            if writer is not None:
                                writer.write(name, tensor)
                            else:
                                values[name] = tensor
        if writer is not None:
            for name, b in buffers.items():
                writer.write(name, b)
            writer.close()
        elif comm.rank == 0:
            state = {}
            for name in engine.module.state_dict(keep_vars=True):
                if name in values:
                    state[name] = values[name]
                elif name in buffers:
                    state[name] = buffers[name]
            with FastFileWriter(path) as f:
                torch.save(state, f)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if comm.rank == 0 and engine.config.checkpoint.file_mode != 0o600:  # the writers create 0600
        os.chmod(path, engine.config.checkpoint.file_mode)
    comm.barrier()
    return True


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def fp32_state_dict(engine, exclude_frozen: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The module's ``state_dict`` with every parameter whole, in fp32 from the optimizer's master
    weights (what ``zero_to_fp32`` makes of a checkpoint, without writing one); floating-point
    buffers upcast. Each unit's master shards are all-gathered in turn, so every rank must call it;
    each gets the whole dict in host memory. Without an optimizer (no master weights) the gathered
    parameters are upcast instead. ``exclude_frozen``: without the parameters that have
    ``requires_grad=False`` (the frozen sub-groups are not read).
    """
    if engine.parts.optimizer_store is None:
        return OrderedDict((name, _fp32(t)) for name, t in full_state_dict(engine.module, exclude_frozen).items())
    frozen = {n for n, p in engine.module.named_parameters(remove_duplicate=False)
              if exclude_frozen and not p.requires_grad}
    store = engine.checkpointed_state  # frozen sub-groups: their parameters' values
    comm, layout = engine.comm, engine.rank_layout
    device = comm.collective_device  # NCCL gathers device tensors, gloo host tensors
    values = {}
    for sg in layout.sub_groups:
        if exclude_frozen and sg.frozen:
            continue
        with store.viewed(sg) as (master, _):
            for index in sg.units:
                unit = layout.units[index]
                start, stop = layout.unit_range(index)
                shard = master[start - sg.start:stop - sg.start]
                full = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
                comm.all_gather_into(full, shard)  # copied to the collective device by Comm
                full = full.cpu()
                for slot in unit.slots:
                    value = full[slot.offset:slot.stop].view(slot.shape).clone()
                    for name in slot.names:
                        values[name] = value
    state = OrderedDict()
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if name not in frozen:
            state[name] = values[name] if name in values else _fp32(tensor.detach().cpu())
    return state
