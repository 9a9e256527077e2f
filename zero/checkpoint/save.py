"""``save_checkpoint``: every rank writes its part under a partial directory that rank 0
then publishes (publish.py); load.py reads it back. With node-local storage each node's
first rank does rank 0's part in its node's copy (storage.py, [Note: node-local storage]).

NVMe-resident state is part of the checkpoint: each sub-group's swap file
becomes its shard by a hard link, or is copied file to file where no link
can be made (see [Note: sub-group shards are safetensors in the swap files'
layout] in shard_io.py, which moves all the bytes of a save or load).
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import tempfile
from typing import Optional

import torch

from nvmeio.atomic_file import fsync_directory, write_atomically

from ..runtime.timers import log_rank0
from .format import (BUFFERS, LATEST, META, QUANTIZED, check_tag, engine_file, meta_dict, quantized_meta, rank_dir,
                     resolve_tag, sub_group_file)
from .publish import PARTIAL, create_file, make_dir, publish, remove_leftovers, set_file_modes
from .shard_io import CheckpointIO
from .storage import SaveRoles, gather_checked, save_roles


def _agreed_tag(engine, tag: str) -> str:
    """Rank 0's tag; ``checkpoint.tag_validation`` says what a rank with another tag does."""
    comm = engine.comm
    first = comm.broadcast_object(tag, 0)
    policy = engine.config.checkpoint.tag_validation
    if policy == "Ignore":
        return first
    if policy == "Fail" and comm.any(first != tag):  # every rank raises, none waits
        raise ValueError(f"ranks save different checkpoint tags (rank {comm.rank}: {tag!r}, rank 0: "
                         f"{first!r}) and checkpoint.tag_validation is Fail")
    if first != tag:
        logging.getLogger("zero").warning("rank %d saves checkpoint tag %r but rank 0 saves %r; using rank 0's",
                                          comm.rank, tag, first)
    return first


def _check_loadable(client_state: dict) -> None:
    """Warn at save time when ``client_state`` holds types a load (weights_only) will refuse."""
    if not client_state:
        return
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [l.strip() for l in str(error).splitlines() if "GLOBAL" in l or "Unsupported" in l]
        logging.getLogger("zero").warning(
            "client_state holds types that load_checkpoint refuses by default (%s): checkpoints are loaded "
            "with weights_only=True so that they cannot run code; store plain types, or call "
            "torch.serialization.add_safe_globals([...]) with your types before loading",
            lines[0] if lines else "not tensors and plain containers")


# [Note: checkpoints without the frozen units]
# save_checkpoint(exclude_frozen_parameters=True), as DeepSpeed's (the Trainer passes it for a
# peft model, Lightning's strategy takes it), leaves out the shards of the frozen units (those
# with no parameter that requires grad: stores/layouts.py): a LoRA checkpoint is then the size of
# its adapters and their optimizer states, not of the base model. The meta names them
# (EXCLUDED_UNITS). A load needs load_module_strict=False to take such a checkpoint (the HF
# Trainer loads a peft model's that way): those units keep the values the model has, which a
# resumed LoRA run has anyway (the pretrained base it was built from). zero_to_fp32 writes the
# parameters that are there and says which are not. A parameter with requires_grad=False in a
# unit that trains (its module owns a trainable one too) shares that unit's shard and is saved.

def _save_shards(engine, cio: CheckpointIO, partial: str, exclude_frozen: bool) -> None:
    """Each sub-group of this rank, written by the store that holds it (the frozen ones left out
    with ``exclude_frozen``: [Note: checkpoints without the frozen units])."""
    state = engine.checkpointed_state
    for sg in engine.rank_layout.sub_groups:
        if not (exclude_frozen and sg.frozen):
            state.save_shard(sg, cio, sub_group_file(partial, engine.comm.rank, sg.index))


def _frozen_param_names(engine) -> list:
    """Every name of every parameter with ``requires_grad=False``, in the layout's order."""
    trains = {n: p.requires_grad for n, p in engine.module.named_parameters(remove_duplicate=False)}
    return [name for u in engine.rank_layout.units for s in u.slots if not trains.get(s.name, True)
            for name in s.names]


def _save_rest(engine, cio: CheckpointIO, partial: str, client_state: dict, roles: SaveRoles,
               exclude_frozen: bool) -> None:
    """Counters, optimizer settings, schedule, client state (every rank); meta and buffers (the
    leader of each copy: rank 0, or each node's first rank with node-local storage)."""
    comm = engine.comm
    mine = rank_dir(partial, comm.rank)
    state = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "optimizer": engine.optimizer.hyper_state() if engine.optimizer is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
    }
    cio.save_object(state, engine_file(partial, comm.rank))
    file_mode = engine.config.checkpoint.file_mode
    set_file_modes(mine, file_mode)
    fsync_directory(mine)
    if roles.leads:
        zc = engine.config.zero_optimization
        meta = meta_dict(list(engine.rank_layout.units), comm.world_size, zc.sub_group_size, engine.config.precision,
                         engine.rank_layout.frozen, _frozen_param_names(engine), exclude_frozen)
        meta["state_names"] = list(engine.checkpointed_state.state_names)
        if engine.frozen_shards and not exclude_frozen:  # the quantized units are frozen ones
            meta[QUANTIZED] = quantized_meta(engine.frozen_shards)
        with create_file(os.path.join(partial, META), file_mode) as f:
            f.write(json.dumps(meta, indent=1).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        buffers = {name: b.detach().cpu() for name, b in engine.module.named_buffers()}
        cio.save_object(buffers, os.path.join(partial, BUFFERS))
        set_file_modes(partial, file_mode)
        fsync_directory(partial)


def _prepare(save_dir: str, tag: str, dir_mode: int) -> str:
    """The partial directory a copy's leader makes for this save (see publish.py)."""
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)):
        raise FileExistsError(f"cannot save checkpoint {tag!r}: {final} exists and is not a checkpoint "
                              f"directory")
    os.makedirs(save_dir, mode=dir_mode, exist_ok=True)
    remove_leftovers(save_dir)
    # A fixed-length name, not ".<tag>.partial-...": any tag a directory can be named (255 bytes) saves.
    name = os.path.basename(tempfile.mkdtemp(prefix=PARTIAL, dir=save_dir))
    os.chmod(os.path.join(save_dir, name), dir_mode)
    return name


def save_checkpoint(engine, save_dir: str, tag: Optional[str], client_state: dict, save_latest: bool,
                    exclude_frozen_parameters: bool = False) -> bool:
    comm = engine.comm
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tag = _agreed_tag(engine, tag)
    checkpoint = engine.config.checkpoint
    file_mode, dir_mode = checkpoint.file_mode, checkpoint.dir_mode
    _check_loadable(client_state)
    # One copy of the directory (rank 0 leads it), or one per node's storage ([Note: node-local storage]).
    roles = save_roles(comm, save_dir, checkpoint.use_node_local_storage, dir_mode)
    names = gather_checked(comm, lambda: _prepare(save_dir, tag, dir_mode) if roles.leads else None,
                           f"preparing to save checkpoint {tag!r}")
    partial = os.path.join(save_dir, names[roles.leader])

    make_dir(rank_dir(partial, comm.rank), dir_mode)
    cio = CheckpointIO(checkpoint.writer)
    try:
        _save_shards(engine, cio, partial, exclude_frozen_parameters)
        _save_rest(engine, cio, partial, client_state, roles, exclude_frozen_parameters)
    except BaseException as exc:
        # Free what this save wrote (a full disk most of all); the checkpoints saved before stay.
        shutil.rmtree(partial if roles.leads else rank_dir(partial, comm.rank), ignore_errors=True)
        if isinstance(exc, OSError):
            try:
                latest = repr(resolve_tag(save_dir, None))
            except ValueError as bad:
                latest = f"unreadable: {bad}"
            exc.add_note(f"saving checkpoint {tag!r} into {save_dir} failed on rank {comm.rank}; what it had "
                         f"written is removed and the checkpoints saved before are untouched (latest: "
                         f"{latest})")
        raise
    finally:
        cio.close("saved", comm.rank)
    comm.barrier()

    if roles.leads:
        publish(save_dir, partial, tag)
        if save_latest:
            write_atomically(os.path.join(save_dir, LATEST), tag.encode("utf-8"), mode=file_mode)
    comm.barrier()
    log_rank0(comm.rank, f"saved checkpoint {os.path.join(save_dir, tag)}")
    return True
