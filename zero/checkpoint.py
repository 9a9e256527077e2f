"""save_checkpoint / load_checkpoint / save_16bit_model for a ZeroEngine.

[Note: a checkpoint becomes visible only when complete]
Every rank writes into ``<save_dir>/.<tag>.partial/``; after a barrier rank 0
renames that directory to ``<tag>`` (an existing ``<tag>`` is moved aside
first and deleted after) and only then rewrites ``latest``, itself through a
temporary file and a rename. Each file is fsynced before the rename. A crash
at any point therefore leaves ``latest`` naming the previous complete
checkpoint; the partial directory is ignored by loads and removed by the next
save (which assumes one job saves into a directory at a time). Re-saving a tag never mixes old and new shards (a checkpoint saved
again with another world size has no stale rank files).

NVMe-resident state is part of the checkpoint: each sub-group is read back
from its swap file (one at a time, so saving needs one sub-group of host
memory) and written out with the rest.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional, Tuple

import torch

from .checkpoint_format import (BUFFERS, LATEST, META, ShardReader, engine_file, meta_dict, rank_dir,
                                read_meta, resolve_tag, sub_group_file)
from .checkpoint_io import CheckpointIO
from .logging import log_rank0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name, not starting with '.' nor 'latest'")
    return tag


def _agreed_tag(engine, tag: str) -> str:
    """Rank 0's tag; ``checkpoint.tag_validation`` says what a rank with another tag does."""
    comm = engine.comm
    first = comm.broadcast_object(tag, 0)
    policy = engine.config.checkpoint.tag_validation
    if policy == "Ignore":
        return first
    if policy == "Fail" and comm.any(first != tag, engine.device):  # every rank raises, none waits
        raise ValueError(f"ranks save different checkpoint tags (rank {comm.rank}: {tag!r}, rank 0: "
                         f"{first!r}) and checkpoint.tag_validation is Fail")
    if first != tag:
        logging.getLogger("zero").warning("rank %d saves checkpoint tag %r but rank 0 saves %r; using rank 0's",
                                          comm.rank, tag, first)
    return first


def _master_of(engine, sg):
    """(master, states) of one sub-group; from the parameter shards when there is no optimizer."""
    store = engine.parts.optimizer_store
    if store is not None:
        return store.read(sg)
    layout = engine.parts.rank_layout
    master = torch.empty(sg.numel, dtype=torch.float32)
    for index in sg.units:
        unit = layout.units[index]
        start, stop = layout.unit_range(index)
        master[start - sg.start:stop - sg.start].copy_(engine.parts.param_store.fetch(unit))
        engine.parts.param_store.fetched(unit)
    return master, {}


def _save_shards(engine, cio: CheckpointIO, partial: str) -> None:
    """Each sub-group of this rank: copied from its swap file when it has one, else from memory."""
    comm, parts = engine.comm, engine.parts
    store = parts.optimizer_store
    for sg in parts.rank_layout.sub_groups:
        path = sub_group_file(partial, comm.rank, sg.index)
        stored = store.stored_file(sg) if store is not None else None
        if stored is not None:
            cio.save_shard(path, sg.numel, ["master", *store.state_names], stored=stored)
        else:
            master, states = _master_of(engine, sg)
            cio.save_shard(path, sg.numel, ["master", *states], tensors={"master": master, **states})
            del master, states


def _save_rest(engine, cio: CheckpointIO, partial: str, client_state: dict) -> None:
    """Counters, optimizer settings, schedule, client state (every rank); meta and buffers (rank 0)."""
    comm, parts = engine.comm, engine.parts
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
    _fsync_dir(mine)
    if comm.rank == 0:
        zc = engine.config.zero_optimization
        meta = meta_dict(list(parts.rank_layout.units), comm.world_size, zc.sub_group_size, engine.config.precision)
        meta["state_names"] = list(parts.optimizer_store.state_names) if parts.optimizer_store else []
        with open(os.path.join(partial, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        buffers = {name: b.detach().cpu() for name, b in engine.module.named_buffers()}
        cio.save_object(buffers, os.path.join(partial, BUFFERS))
        _fsync_dir(partial)


def save_checkpoint(engine, save_dir: str, tag: Optional[str], client_state: dict, save_latest: bool) -> bool:
    comm, parts = engine.comm, engine.parts
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tag = _agreed_tag(engine, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    if comm.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        for entry in os.listdir(save_dir):  # left by saves that died
            if entry.startswith(".") and (entry.endswith(".partial") or ".old-" in entry):
                shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
        os.makedirs(partial)
    comm.barrier()

    os.makedirs(rank_dir(partial, comm.rank), exist_ok=True)
    cio = CheckpointIO(engine.config.checkpoint.writer)
    try:
        _save_shards(engine, cio, partial)
        _save_rest(engine, cio, partial, client_state)
    except BaseException as exc:
        # Free what this save wrote (a full disk most of all); the checkpoints saved before stay.
        shutil.rmtree(partial if comm.rank == 0 else rank_dir(partial, comm.rank), ignore_errors=True)
        if isinstance(exc, OSError):
            exc.add_note(f"saving checkpoint {tag!r} into {save_dir} failed on rank {comm.rank}; what it had "
                         f"written is removed and the checkpoints saved before are untouched (latest: "
                         f"{resolve_tag(save_dir, None)!r})")
        raise
    finally:
        cio.close("saved", comm.rank)
    comm.barrier()

    if comm.rank == 0:
        final = os.path.join(save_dir, tag)
        old = None
        if os.path.exists(final):
            old = os.path.join(save_dir, f".{tag}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(partial, final)
        _fsync_dir(save_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            _write_text_atomically(os.path.join(save_dir, LATEST), tag)
    comm.barrier()
    log_rank0(comm.rank, f"saved checkpoint {os.path.join(save_dir, tag)}")
    return True


def _check_same_model(meta: dict, engine) -> None:
    saved = [[(tuple(p["names"])[0], tuple(p["shape"])) for p in u["params"]] for u in meta["units"]]
    ours = [[(s.name, s.shape) for s in u.slots] for u in engine.parts.rank_layout.units]
    if saved != ours:
        theirs = {n: s for u in saved for n, s in u}
        mine = {n: s for u in ours for n, s in u}
        diff = sorted(set(theirs.items()) ^ set(mine.items()))[:5]
        raise ValueError(f"the checkpoint was saved from a different model (parameters differ: {diff})")


def _load_own_shard(engine, cio: CheckpointIO, checkpoint: str, sg, keys, load_states: bool) -> torch.Tensor:
    """A sub-group from this rank's own shard file (same layout): the optimizer state is
    copied file to file into the store's swap file where it has one; returns the master."""
    store = engine.parts.optimizer_store
    path = sub_group_file(checkpoint, engine.comm.rank, sg.index)
    with cio.shard_reader(path) as shard:
        for k in keys:
            numel = shard.info(k).shape[0] if shard.info(k).shape else 1
            if numel != sg.numel:
                raise ValueError(f"checkpoint shard {path}: {k!r} holds {numel} elements, sub-group "
                                 f"{sg.index} has {sg.numel}")
        imported = load_states and store.import_state(
            sg, {k: (path, shard.data_start + shard.info(k).begin) for k in keys})
        master = shard.get_tensor("master")
        if store is not None and not imported:
            store.load(sg, master, {k: shard.get_tensor(k) for k in keys[1:]} if load_states else None)
    return master


def _load_resharded(engine, reader: ShardReader, sg, keys, load_states: bool) -> torch.Tensor:
    """A sub-group gathered element range by element range from any rank's shards."""
    comm, layout, store = engine.comm, engine.parts.rank_layout, engine.parts.optimizer_store
    values = {k: torch.zeros(sg.numel, dtype=torch.float32) for k in keys}
    for index in sg.units:
        unit = layout.units[index]
        start, stop = layout.unit_range(index)
        first = unit.shard_start(comm.rank)
        for k in keys:
            values[k][start - sg.start:stop - sg.start].copy_(
                reader.read(index, first, first + unit.shard_numel, k))
    master = values.pop("master")
    if store is not None:
        store.load(sg, master, values if load_states else None)
    return master


def load_checkpoint(engine, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
                    load_lr_scheduler_states: bool) -> Tuple[Optional[str], Optional[dict]]:
    comm, parts = engine.comm, engine.parts
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        log_rank0(comm.rank, f"no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist",
                  logging.WARNING)
        return None, None
    checkpoint = os.path.join(load_dir, tag)
    meta = read_meta(checkpoint)
    _check_same_model(meta, engine)
    same_layout = meta["world_size"] == comm.world_size
    # This rank's shards hold exactly its sub-groups: read whole, or copied file to file.
    own_shards = same_layout and meta["sub_group_size"] == engine.config.zero_optimization.sub_group_size
    store = parts.optimizer_store
    layout = parts.rank_layout
    saved_states = meta.get("state_names", [])
    load_states = (store is not None and load_optimizer_states
                   and set(store.state_names) <= set(saved_states))
    keys = ["master"] + (list(store.state_names) if load_states else [])
    reader = ShardReader(checkpoint, meta)
    cio = CheckpointIO(engine.config.checkpoint.writer)
    try:
        with torch.no_grad():
            for sg in layout.sub_groups:
                if own_shards:
                    master = _load_own_shard(engine, cio, checkpoint, sg, keys, load_states)
                else:
                    master = _load_resharded(engine, reader, sg, keys, load_states)
                for index in sg.units:
                    start, stop = layout.unit_range(index)
                    parts.param_store.write(layout.units[index], master[start - sg.start:stop - sg.start])
            parts.param_store.flush()
        parts.coordinator.release_all()
        if parts.reducer is not None:
            parts.reducer.clear()

        state = cio.load_object(engine_file(checkpoint, comm.rank if same_layout else 0), weights_only=False)
        buffers = cio.load_object(os.path.join(checkpoint, BUFFERS), weights_only=True)
    finally:
        reader.close()
        cio.close("loaded", comm.rank)
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.micro_steps = state["micro_steps"]
    if load_optimizer_states and engine.optimizer is not None and state["optimizer"] is not None:
        engine.optimizer.load_hyper_state(state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for name, b in engine.module.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])
    log_rank0(comm.rank, f"loaded checkpoint {checkpoint}")
    return checkpoint, state["client_state"]


def save_16bit_model(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Gather every unit (one at a time) and save the module's state_dict in the compute dtype (rank 0)."""
    comm, parts = engine.comm, engine.parts
    if not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        log_rank0(comm.rank, (
            "did not save the model: zero_optimization.stage3_gather_16bit_weights_on_model_save is false; "
            "set it to true, or consolidate a checkpoint with zero_to_fp32"), logging.WARNING)
        return False
    values = {}
    with torch.no_grad():
        for unit in parts.units:
            unit.fwd_refs += 1
            unit.gather()
            if comm.rank == 0:
                for slot, p in zip(unit.layout.slots, unit.params):
                    if exclude_frozen_parameters and not p.requires_grad:
                        continue
                    tensor = p.detach().to("cpu", copy=True)
                    for name in slot.names:
                        values[name] = tensor
            unit.fwd_refs -= 1
            parts.coordinator.maybe_release(unit)
    if comm.rank == 0:
        param_names = {n for u in parts.rank_layout.units for s in u.slots for n in s.names}
        state = {}
        for name, tensor in engine.module.state_dict(keep_vars=True).items():
            if name in values:
                state[name] = values[name]
            elif name not in param_names:  # a buffer
                state[name] = tensor.detach().cpu()
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = f"{path}.tmp-{os.getpid()}"
        _save(state, tmp)
        os.replace(tmp, path)
        _fsync_dir(save_dir)
    comm.barrier()
    return True
