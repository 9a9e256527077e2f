"""``load_checkpoint``: checks everything, on every rank, before changing anything.

A directory of DeepSpeed's files (a DeepSpeed ZeRO checkpoint) is loaded by
deepspeed_load.py, under the same protocol.

A load checks everything first (the tag, the model, every file it will read,
the counters) and changes the engine only when all of it is there: a
missing or damaged file (a shard whose bytes differ from the checksums it
carries included) leaves weights and counters untouched. An I/O error
while the checked state is written into the stores leaves the engine
refusing to run until a checkpoint is loaded again.

[Note: verified while loading]
A shard that carries checksums is read once: where the store can stage it
(the optimizer on NVMe, same layout), the check reads it into a staging swap
file (a hard link of the shard, or a copy written as it is read) and hashes
the bytes on the way (swapper/_staged_state.py); only once every shard of the
checkpoint matched on every rank does the apply step publish the staged
files (a rename each) and take the masters from the staging buffers. A
mismatch, or a failure on another rank, discards the staged files: the
engine never saw them. Other shards are verified by a read of their own,
then loaded.
"""
from __future__ import annotations

import logging
import os
import pickle
from typing import Optional, Tuple

import torch

from swapper.checksum import ChecksumAlgorithm

from ..runtime.timers import log_rank0
from .deepspeed_files import is_deepspeed_checkpoint
from .deepspeed_load import load_deepspeed_checkpoint
from .format import (BUFFERS, LATEST, META, ShardReader, checkpoint_path, engine_file, excluded_units_from_meta,
                     frozen_units_from_meta, open_shard, read_meta, resolve_tag, shown_names, sub_group_file,
                     unsafe_error)
from .regroup import RegroupedReader
from .shard_io import CheckpointIO, check_digests, shard_checksums
from .storage import agreed_local_tag, check_local_files, check_same_copies


def _check_same_model(meta: dict, engine) -> bool:
    """The checkpoint holds this model's parameters (by name and shape); True where its units
    group them otherwise (regroup.py, [Note: a checkpoint grouped otherwise])."""
    saved = [[(tuple(p["names"])[0], tuple(p["shape"])) for p in u["params"]] for u in meta["units"]]
    ours = [[(s.name, s.shape) for s in u.slots] for u in engine.rank_layout.units]
    if saved == ours:
        return False
    theirs = {n: s for u in saved for n, s in u}
    mine = {n: s for u in ours for n, s in u}
    if theirs != mine:
        diff = sorted(set(theirs.items()) ^ set(mine.items()))[:5]
        raise ValueError(f"the checkpoint was saved from a different model (parameters differ: {diff})")
    return True


def _check_strict(engine, meta: dict, excluded: frozenset, checkpoint: str, strict: bool) -> None:
    """A checkpoint without its frozen units loads only with ``load_module_strict=False``
    (save.py [Note: checkpoints without the frozen units]); units this engine trains among them
    are named (they keep their values and start with zero optimizer states)."""
    if not excluded:
        return
    if strict:
        names = [p["names"][0] for i in sorted(excluded) for p in meta["units"][i]["params"]]
        raise ValueError(f"checkpoint {checkpoint} was saved with exclude_frozen_parameters=True and holds no values "
                         f"for {len(names)} frozen parameter(s) ({shown_names(names)}); load it with "
                         f"load_module_strict=False to keep this model's values for them")
    left_out = {p["names"][0] for i in excluded for p in meta["units"][i]["params"]}
    layout = engine.rank_layout
    trains = [s.name for u in layout.units if u.index not in layout.frozen for s in u.slots if s.name in left_out]
    if trains:
        log_rank0(engine.comm.rank, f"load_checkpoint: {checkpoint} was saved without its frozen parameters, "
                  f"{len(trains)} of which this engine trains ({shown_names(trains)}): they keep this model's values, "
                  f"their optimizer states start at zero", logging.WARNING)


def _absent(sg, own_shards: bool, excluded: frozenset) -> bool:
    """This rank's shard of ``sg`` is not in the checkpoint: a frozen sub-group left out at the save."""
    return own_shards and sg.frozen and bool(excluded)


def _load_own_shard(engine, cio: CheckpointIO, checkpoint: str, sg, keys, load_states: bool,
                    staged) -> torch.Tensor:
    """A sub-group from this rank's own shard file (same layout), taken by the store that holds
    it (file to file where it can, published where _stage_shards staged it); returns the master."""
    path = sub_group_file(checkpoint, engine.comm.rank, sg.index)
    keys, load_states = _sub_group_keys(sg, keys), load_states and not sg.frozen
    if staged is not None:  # verified: the bytes staged are the ones the shard carries digests of
        item, carried = staged
        master = engine.checkpointed_state.publish_shard(sg, item, carried)
        if master is not None:
            return master
        with cio.shard_reader(path) as shard:  # its staging buffer went to a later sub-group
            return shard.get_tensor("master")
    with cio.shard_reader(path) as shard:
        for k in keys:
            numel = shard.info(k).shape[0] if shard.info(k).shape else 1
            if numel != sg.numel:
                raise ValueError(f"checkpoint shard {path}: {k!r} holds {numel} elements, sub-group "
                                 f"{sg.index} has {sg.numel}")
        # the carried checksums were verified by _check_shards; the store keeps them
        return engine.checkpointed_state.load_shard(sg, shard, path, keys, load_states, shard_checksums(shard))


def _sub_group_keys(sg, keys):
    """The tensors a sub-group's shard holds of ``keys``: a frozen one its master alone."""
    return list(keys[:1]) if sg.frozen else list(keys)


def _check_carried(cio: CheckpointIO, paths: dict) -> None:
    """Every shard that carries checksums matches them (each file read once, streaming);
    ``paths``: path -> the keys read from it."""
    for path, keys in paths.items():
        cio.verify_shard(path, keys)


def _stage_shards(engine, cio: CheckpointIO, checkpoint: str, all_keys, all_load_states: bool,
                  staged: dict, excluded: frozenset) -> dict:
    """Stage (read once, hashing) each own shard that carries checksums where the store can,
    checking the digests ([Note: verified while loading]); ``staged`` gets sub-group index ->
    (staged state, the checksums the shard carries). Returns the paths left to verify by a read
    of their own, with their keys."""
    store, rest = engine.checkpointed_state, {}
    for sg in engine.rank_layout.sub_groups:
        if _absent(sg, True, excluded):
            continue
        keys, load_states = _sub_group_keys(sg, all_keys), all_load_states and not sg.frozen
        path = sub_group_file(checkpoint, engine.comm.rank, sg.index)
        with open_shard(path, direct=False) as shard:  # its header; the data is read staged
            carried = shard_checksums(shard)
            if carried is None:
                continue  # nothing to verify: loaded as before
            algorithm = ChecksumAlgorithm(carried[0])
            missing = [k for k in keys if k not in carried[1]]
            item = None if missing else store.stage_shard(sg, shard, path, keys, load_states, algorithm)
        if item is None:
            rest[path] = keys
            continue
        staged[sg.index] = item, carried
        cio.stats.files_read += 1
        cio.stats.bytes_read += item.bytes_read
        check_digests(path, carried, keys, item.digests)
    return rest


def _unit_keys(reader: ShardReader, sg, index: int, keys):
    """What a resharded load reads of a unit: its master alone where this engine's sub-group or
    the checkpoint has no states for it (a unit frozen when saved starts with zero states)."""
    return list(keys[:1]) if index in reader.frozen else _sub_group_keys(sg, keys)


def _load_resharded(engine, reader: ShardReader, sg, keys, load_states: bool) -> Optional[torch.Tensor]:
    """A sub-group gathered element range by element range from any rank's shards; a unit the
    checkpoint left out keeps its values (engine.current_master, with zero states); None where the whole
    sub-group is frozen and left out (nothing to load)."""
    comm, layout = engine.comm, engine.rank_layout
    missing = [i for i in sg.units if i in reader.excluded]
    if sg.frozen and len(missing) == len(sg.units):
        return None
    keys = _sub_group_keys(sg, keys)
    values = {k: torch.zeros(sg.numel, dtype=torch.float32) for k in keys}
    if missing:
        values["master"] = engine.current_master(sg)
    for index in sg.units:
        if index in reader.excluded:
            continue
        unit = layout.units[index]
        start, stop = layout.unit_range(index)
        first = unit.shard_start(comm.rank)
        for k in _unit_keys(reader, sg, index, keys):
            values[k][start - sg.start:stop - sg.start].copy_(
                reader.read(index, first, first + unit.shard_numel, k))
    master = values.pop("master")
    engine.checkpointed_state.load(sg, master, values if load_states and not sg.frozen else None)
    return master


_COUNTERS = ("global_steps", "global_samples", "micro_steps")


def _check_engine_state(state, path: str) -> None:
    if not isinstance(state, dict) or any(not isinstance(state.get(k), int) for k in _COUNTERS):
        raise ValueError(f"{path} is not an engine state of this format: it lacks the step counters "
                         f"{', '.join(_COUNTERS)}")
    for key in ("optimizer", "lr_scheduler", "client_state"):
        if key not in state:
            raise ValueError(f"{path} is not an engine state of this format: it lacks {key!r}")


def _load_object(cio: CheckpointIO, path: str, checkpoint: str):
    """A torch.save file of the checkpoint, weights_only (nothing in it runs)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {checkpoint} is incomplete: {path} is missing")
    try:
        return cio.load_object(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise unsafe_error(path, error) from None


def _check_shards(engine, cio: CheckpointIO, checkpoint: str, reader: ShardReader, own_shards: bool,
                  keys, load_states: bool, staged: dict) -> None:
    """Every shard file, key and element range the load will read is there, and its bytes
    match the checksums it carries (see shard_io.py [Note: checksums travel with the
    state])."""
    comm, layout = engine.comm, engine.rank_layout
    paths = {}  # path -> the keys read from it
    for sg in layout.sub_groups:
        if _absent(sg, own_shards, reader.excluded):
            continue
        if own_shards:
            path = sub_group_file(checkpoint, comm.rank, sg.index)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint {checkpoint} is incomplete: {path} is missing")
            with open_shard(path, direct=False) as shard:
                for k in _sub_group_keys(sg, keys):
                    info = shard.info(k)
                    if info.dtype != torch.float32 or list(info.shape) != [sg.numel]:
                        raise ValueError(f"checkpoint shard {path}: {k!r} is {info.dtype} {list(info.shape)}, "
                                         f"sub-group {sg.index} has {sg.numel} fp32 elements")
            continue
        for index in sg.units:
            if index in reader.excluded:
                continue
            unit = layout.units[index]
            first = unit.shard_start(comm.rank)
            unit_keys = _unit_keys(reader, sg, index, keys)
            for k in unit_keys:
                reader.check(index, first, first + unit.shard_numel, k)
            for path in reader.files(index, first, first + unit.shard_numel):
                paths[path] = list(dict.fromkeys(paths.get(path, []) + unit_keys))
    if own_shards:
        paths = _stage_shards(engine, cio, checkpoint, keys, load_states, staged, reader.excluded)
    _check_carried(cio, paths)


def _files_read(engine, checkpoint: str, reader: ShardReader, own_shards: bool, same_layout: bool) -> list:
    """Every file of ``checkpoint`` this rank's load reads."""
    comm, layout = engine.comm, engine.rank_layout
    paths = [engine_file(checkpoint, comm.rank if same_layout else 0), os.path.join(checkpoint, BUFFERS)]
    for sg in layout.sub_groups:
        if _absent(sg, own_shards, reader.excluded):
            continue
        if own_shards:
            paths.append(sub_group_file(checkpoint, comm.rank, sg.index))
            continue
        for index in sg.units:
            if index in reader.excluded:
                continue
            first = layout.units[index].shard_start(comm.rank)
            paths.extend(reader.files(index, first, first + layout.units[index].shard_numel))
    return paths


def load_checkpoint(engine, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_strict: bool = True
                    ) -> Tuple[Optional[str], Optional[dict]]:
    """Checks everything, on every rank, before changing anything (see the [Note] above)."""
    comm = engine.comm
    # Each node reads its own copy ([Note: node-local storage] in storage.py); they must agree.
    node_local = engine.config.checkpoint.use_node_local_storage
    tag = agreed_local_tag(comm, load_dir, tag) if node_local else resolve_tag(load_dir, tag)
    if tag is None:
        log_rank0(comm.rank, f"no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist",
                  logging.WARNING)
        return None, None
    checkpoint = checkpoint_path(load_dir, tag)
    if not os.path.exists(os.path.join(checkpoint, META)) and is_deepspeed_checkpoint(checkpoint):
        return load_deepspeed_checkpoint(engine, checkpoint, load_optimizer_states, load_lr_scheduler_states,
                                         load_module_strict)
    cio = CheckpointIO(engine.config.checkpoint.writer)
    reader = None
    error = None
    staged: dict = {}  # sub-group index -> (its shard staged and verified, carried checksums), until published
    try:
        meta = read_meta(checkpoint)
        regrouped = _check_same_model(meta, engine)
        excluded = excluded_units_from_meta(meta)
        _check_strict(engine, meta, excluded, checkpoint, load_module_strict)
        same_layout = meta["world_size"] == comm.world_size
        # This rank's shards hold exactly its sub-groups (or none of the frozen ones): read whole, or
        # copied file to file.
        frozen = frozen_units_from_meta(meta)
        own_shards = (same_layout and not regrouped
                      and meta["sub_group_size"] == engine.config.zero_optimization.sub_group_size
                      and frozen == engine.rank_layout.frozen and excluded in (frozen, frozenset()))
        names = engine.checkpointed_state.state_names
        load_states = load_optimizer_states and set(names) <= set(meta.get("state_names", []))
        keys = ["master"] + (list(names) if load_states else [])
        reader = ShardReader(checkpoint, meta)
        if regrouped:
            reader = RegroupedReader(reader, engine.rank_layout.units)
        if node_local:
            check_local_files(checkpoint, comm.rank, _files_read(engine, checkpoint, reader, own_shards, same_layout),
                              resharding=not own_shards)
        _check_shards(engine, cio, checkpoint, reader, own_shards, keys, load_states, staged)
        path = engine_file(checkpoint, comm.rank if same_layout else 0)
        state = _load_object(cio, path, checkpoint)
        _check_engine_state(state, path)
        buffers = _load_object(cio, os.path.join(checkpoint, BUFFERS), checkpoint)
    except Exception as exc:  # noqa: BLE001 - every rank must learn that one failed, so that none loads
        error = exc
    try:
        failed = [(r, m) for r, m in enumerate(comm.all_gather_object(
            None if error is None else f"{type(error).__name__}: {error}")) if m is not None]
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"load_checkpoint({checkpoint}) failed on another rank (rank {failed[0][0]}: "
                               f"{failed[0][1]}); nothing was loaded")
        if node_local:
            check_same_copies(comm, checkpoint, state)
        try:
            _apply(engine, cio, reader, checkpoint, own_shards, keys, load_states, state, buffers,
                   load_optimizer_states, load_lr_scheduler_states, staged)
        except BaseException as exc:
            engine.mark_unusable(f"load_checkpoint({checkpoint}) failed while writing the checked state into "
                                 f"the engine ({type(exc).__name__}: {exc}); the engine holds a mix of states. "
                                 f"Load a checkpoint again (engine.load_checkpoint) before using it")
            raise
    finally:
        for item, _ in staged.values():  # those not published (the load failed somewhere)
            engine.checkpointed_state.discard_staged(item)
        if reader is not None:
            reader.close()
        cio.close("loaded", comm.rank)
    engine.mark_usable()
    log_rank0(comm.rank, f"loaded checkpoint {checkpoint}")
    return checkpoint, state["client_state"]


def _apply(engine, cio: CheckpointIO, reader: ShardReader, checkpoint: str, own_shards: bool, keys,
           load_states: bool, state: dict, buffers: dict, load_optimizer_states: bool,
           load_lr_scheduler_states: bool, staged: dict) -> None:
    store = engine.checkpointed_state
    engine.begin_load()
    with torch.no_grad():
        for sg in engine.rank_layout.sub_groups:
            if _absent(sg, own_shards, reader.excluded):
                continue  # its parameters keep their values
            entry = staged.pop(sg.index, None)
            try:
                if own_shards:
                    master = _load_own_shard(engine, cio, checkpoint, sg, keys, load_states, entry)
                else:
                    master = _load_resharded(engine, reader, sg, keys, load_states)
                if master is not None:
                    engine.load_parameters(sg, master)
            finally:
                if entry is not None:
                    store.discard_staged(entry[0])  # its buffer (a published file stays)
        engine.finish_load()
    for key in _COUNTERS:
        setattr(engine, key, state[key])
    if load_optimizer_states and engine.optimizer is not None and state["optimizer"] is not None:
        engine.optimizer.load_hyper_state(state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for name, b in engine.module.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])
