"""save_checkpoint / load_checkpoint / save_16bit_model for a ZeroEngine.

[Note: a checkpoint becomes visible only when complete]
Every rank writes into ``<save_dir>/.<tag>.partial-<random>/`` (made by rank 0,
exclusively, and its name broadcast); after a barrier rank 0 publishes it as
``<tag>`` and only then rewrites ``latest`` (an exclusive temporary file,
renamed: nvmeio.atomic_file). Each file is fsynced before the rename. A crash
at any point therefore leaves ``latest`` naming the previous complete
checkpoint. Re-saving an existing tag swaps the two directories in one step
(``renameat2(RENAME_EXCHANGE)``), so ``<tag>`` always names a complete copy;
where the file system cannot exchange, the old copy is renamed to
``.<tag>.old-<random>`` first, a load finds it there if a crash came between
the two renames, and the next save renames it back rather than deleting it:
no step ever deletes the only complete copy of a tag. A copy is deleted only
after a rename to a partial name, so a deletion stopped half way never leaves
an incomplete directory where a load or a recovery looks. Partial directories
are removed by the next save (which assumes one job saves into a directory
at a time). Re-saving a tag never mixes old and new shards (a checkpoint saved
again with another world size has no stale rank files).

Files are created exclusively (never through a planted symlink, see
checkpoint_io.py) with mode ``checkpoint.file_mode`` (0600) and directories
with the same bits plus search (0700): model state is the user's data.

A load checks everything first (the tag, the model, every file it will read,
the counters) and changes the engine only when all of it is there: a
missing or damaged file (a shard whose bytes differ from the checksums it
carries included) leaves weights and counters untouched. An I/O error
while the checked state is written into the stores leaves the engine
refusing to run until a checkpoint is loaded again.

NVMe-resident state is part of the checkpoint: each sub-group's swap file
becomes its shard by a hard link, or is copied file to file where no link
can be made (see [Note: sub-group shards are safetensors in the swap files'
layout] in checkpoint_io.py, which moves all the bytes of a save or load).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import secrets
import shutil
import tempfile
from typing import Optional, Tuple

import torch

from nvmeio import FastFileWriter, SafetensorsReader, SafetensorsWriter
from nvmeio.atomic_file import exchange, fsync_directory, write_atomically

from .checkpoint_format import (BUFFERS, LATEST, META, OLD_COPY, ShardReader, check_tag, checkpoint_path,
                                engine_file, meta_dict, rank_dir, read_meta, resolve_tag, sub_group_file,
                                unsafe_error)
from .checkpoint_io import CheckpointIO, shard_checksums
from .logging import log_rank0

_PARTIAL = ".partial-"  # in ".<tag>.partial-<random>": a save in progress (or one that died)


def _create(path: str, mode: int):
    """A new file, created exclusively (an existing file or symlink is refused), ``mode`` exactly."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _make_dir(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise
    os.chmod(path, mode)


def _discard(save_dir: str, path: str) -> None:
    """Delete a complete copy: renamed to a partial name first, so that a deletion stopped half
    way never leaves a damaged directory under a name a load or a recovery trusts."""
    doomed = os.path.join(save_dir, f".discarded{_PARTIAL}{secrets.token_hex(4)}")
    os.rename(path, doomed)
    fsync_directory(save_dir)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_leftovers(save_dir: str) -> None:
    """Partial directories of saves that died go; a complete copy moved aside by a re-save cut
    between its renames is renamed back to its tag when the tag is missing, else deleted.
    Every ``.old`` directory is complete (:func:`_discard`), so whichever is renamed back is."""
    entries = sorted(os.listdir(save_dir), key=lambda e: -os.lstat(os.path.join(save_dir, e)).st_mtime)
    for entry in entries:
        path = os.path.join(save_dir, entry)
        if not entry.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        if _PARTIAL in entry or entry.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)
        elif OLD_COPY in entry:
            tag = entry[1:entry.rindex(OLD_COPY)]
            if os.path.isdir(os.path.join(save_dir, tag)):
                _discard(save_dir, path)
            else:
                os.rename(path, os.path.join(save_dir, tag))  # the newest moved-aside copy comes first
                fsync_directory(save_dir)


def _publish(save_dir: str, partial: str, tag: str) -> None:
    """Make the complete ``partial`` the directory of ``tag`` (see the [Note] above)."""
    final = os.path.join(save_dir, tag)
    if not os.path.lexists(final):
        os.rename(partial, final)
        fsync_directory(save_dir)
        return
    if exchange(partial, final):  # final is the new copy, partial the old one
        fsync_directory(save_dir)
        shutil.rmtree(partial)
        return
    old = os.path.join(save_dir, f".{tag}{OLD_COPY}{secrets.token_hex(4)}")
    os.rename(final, old)
    os.rename(partial, final)  # a crash just before: checkpoint_path() finds the copy at `old`
    fsync_directory(save_dir)
    _discard(save_dir, old)


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


@contextlib.contextmanager
def _state_of(engine, sg):
    """(master, states) of one sub-group while the block runs: views of the store's memory
    (no copy) where it has them; from the parameter shards when there is no optimizer."""
    store = engine.parts.optimizer_store
    if store is not None:
        with store.viewed(sg) as state:
            yield state
        return
    layout = engine.parts.rank_layout
    master = torch.empty(sg.numel, dtype=torch.float32)
    for index in sg.units:
        unit = layout.units[index]
        start, stop = layout.unit_range(index)
        master[start - sg.start:stop - sg.start].copy_(engine.parts.param_store.fetch(unit))
        engine.parts.param_store.fetched(unit)
    yield master, {}


def _save_shards(engine, cio: CheckpointIO, partial: str) -> None:
    """Each sub-group of this rank: copied from its swap file when it has one, else from memory."""
    comm, parts = engine.comm, engine.parts
    store = parts.optimizer_store
    for sg in parts.rank_layout.sub_groups:
        path = sub_group_file(partial, comm.rank, sg.index)
        stored = store.stored_file(sg) if store is not None else None
        if stored is not None:
            cio.save_shard(path, sg.numel, ["master", *store.state_names], stored=stored,
                           link=lambda dest, header, sg=sg: store.link_state(sg, dest, header),
                           checksums=store.stored_checksums(sg))
        else:
            with _state_of(engine, sg) as (master, states):
                cio.save_shard(path, sg.numel, ["master", *states], tensors={"master": master, **states})


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
    file_mode = engine.config.checkpoint.file_mode
    _set_file_modes(mine, file_mode)
    fsync_directory(mine)
    if comm.rank == 0:
        zc = engine.config.zero_optimization
        meta = meta_dict(list(parts.rank_layout.units), comm.world_size, zc.sub_group_size, engine.config.precision)
        meta["state_names"] = list(parts.optimizer_store.state_names) if parts.optimizer_store else []
        with _create(os.path.join(partial, META), file_mode) as f:
            f.write(json.dumps(meta, indent=1).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        buffers = {name: b.detach().cpu() for name, b in engine.module.named_buffers()}
        cio.save_object(buffers, os.path.join(partial, BUFFERS))
        _set_file_modes(partial, file_mode)
        fsync_directory(partial)


def _set_file_modes(directory: str, mode: int) -> None:
    """The writers create files 0600; another ``checkpoint.file_mode`` is set once they are written."""
    if mode == 0o600:
        return
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode)


def save_checkpoint(engine, save_dir: str, tag: Optional[str], client_state: dict, save_latest: bool) -> bool:
    comm, parts = engine.comm, engine.parts
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tag = _agreed_tag(engine, tag)
    file_mode, dir_mode = engine.config.checkpoint.file_mode, engine.config.checkpoint.dir_mode
    _check_loadable(client_state)
    name = None
    if comm.rank == 0:
        final = os.path.join(save_dir, tag)
        if os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)):
            raise FileExistsError(f"cannot save checkpoint {tag!r}: {final} exists and is not a checkpoint "
                                  f"directory")
        os.makedirs(save_dir, mode=dir_mode, exist_ok=True)
        _remove_leftovers(save_dir)
        name = os.path.basename(tempfile.mkdtemp(prefix=f".{tag}{_PARTIAL}", dir=save_dir))
        os.chmod(os.path.join(save_dir, name), dir_mode)
    partial = os.path.join(save_dir, comm.broadcast_object(name, 0))
    comm.barrier()

    _make_dir(rank_dir(partial, comm.rank), dir_mode)
    cio = CheckpointIO(engine.config.checkpoint.writer)
    try:
        _save_shards(engine, cio, partial)
        _save_rest(engine, cio, partial, client_state)
    except BaseException as exc:
        # Free what this save wrote (a full disk most of all); the checkpoints saved before stay.
        shutil.rmtree(partial if comm.rank == 0 else rank_dir(partial, comm.rank), ignore_errors=True)
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

    if comm.rank == 0:
        _publish(save_dir, partial, tag)
        if save_latest:
            write_atomically(os.path.join(save_dir, LATEST), tag.encode("utf-8"), mode=file_mode)
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
        master = None
        offsets = {k: shard.data_start + shard.info(k).begin for k in keys}
        carried = shard_checksums(shard)  # verified by _check_shards; the swapper keeps them
        if load_states and store.adopt_file(sg, path, offsets, carried):  # the shard becomes the swap file
            master = shard.get_tensor("master")
        elif load_states:  # the whole state, read straight into the store's swap buffer
            master = store.import_state(sg, {k: (path, offset) for k, offset in offsets.items()})
        if master is None:
            master = shard.get_tensor("master")
            if store is not None:
                store.load(sg, master, {k: shard.get_tensor(k) for k in keys[1:]} if load_states else None)
    return master


def _check_carried(cio: CheckpointIO, paths, keys) -> None:
    """Every shard that carries checksums matches them (each file read once, streaming)."""
    for path in dict.fromkeys(paths):
        cio.verify_shard(path, keys)


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
                  keys) -> None:
    """Every shard file, key and element range the load will read is there, and its bytes
    match the checksums it carries (see checkpoint_io.py [Note: checksums travel with the
    state])."""
    comm, layout = engine.comm, engine.parts.rank_layout
    paths = []
    for sg in layout.sub_groups:
        if own_shards:
            path = sub_group_file(checkpoint, comm.rank, sg.index)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint {checkpoint} is incomplete: {path} is missing")
            with SafetensorsReader(path, direct=False) as shard:
                for k in keys:
                    info = shard.info(k)
                    if info.dtype != torch.float32 or list(info.shape) != [sg.numel]:
                        raise ValueError(f"checkpoint shard {path}: {k!r} is {info.dtype} {list(info.shape)}, "
                                         f"sub-group {sg.index} has {sg.numel} fp32 elements")
            paths.append(path)
            continue
        for index in sg.units:
            unit = layout.units[index]
            first = unit.shard_start(comm.rank)
            for k in keys:
                reader.check(index, first, first + unit.shard_numel, k)
            paths.extend(reader.files(index, first, first + unit.shard_numel))
    _check_carried(cio, paths, keys)


def load_checkpoint(engine, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
                    load_lr_scheduler_states: bool) -> Tuple[Optional[str], Optional[dict]]:
    """Checks everything, on every rank, before changing anything (see the [Note] above)."""
    comm, parts = engine.comm, engine.parts
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        log_rank0(comm.rank, f"no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist",
                  logging.WARNING)
        return None, None
    checkpoint = checkpoint_path(load_dir, tag)
    cio = CheckpointIO(engine.config.checkpoint.writer)
    reader = None
    error = None
    try:
        meta = read_meta(checkpoint)
        _check_same_model(meta, engine)
        same_layout = meta["world_size"] == comm.world_size
        # This rank's shards hold exactly its sub-groups: read whole, or copied file to file.
        own_shards = same_layout and meta["sub_group_size"] == engine.config.zero_optimization.sub_group_size
        store = parts.optimizer_store
        load_states = (store is not None and load_optimizer_states
                       and set(store.state_names) <= set(meta.get("state_names", [])))
        keys = ["master"] + (list(store.state_names) if load_states else [])
        reader = ShardReader(checkpoint, meta)
        _check_shards(engine, cio, checkpoint, reader, own_shards, keys)
        path = engine_file(checkpoint, comm.rank if same_layout else 0)
        state = _load_object(cio, path, checkpoint)
        _check_engine_state(state, path)
        buffers = _load_object(cio, os.path.join(checkpoint, BUFFERS), checkpoint)
    except Exception as exc:  # every rank must learn that one failed, so that none loads
        error = exc
    try:
        if comm.any(error is not None, engine.device):
            if error is not None:
                raise error
            raise RuntimeError(f"load_checkpoint({checkpoint}) failed on another rank; nothing was loaded")
        try:
            _apply(engine, cio, reader, checkpoint, own_shards, keys, load_states, state, buffers,
                   load_optimizer_states, load_lr_scheduler_states)
        except BaseException as exc:
            engine.mark_unusable(f"load_checkpoint({checkpoint}) failed while writing the checked state into "
                                 f"the engine ({type(exc).__name__}: {exc}); the engine holds a mix of states. "
                                 f"Load a checkpoint again (engine.load_checkpoint) before using it")
            raise
    finally:
        if reader is not None:
            reader.close()
        cio.close("loaded", comm.rank)
    engine.mark_usable()
    log_rank0(comm.rank, f"loaded checkpoint {checkpoint}")
    return checkpoint, state["client_state"]


def _apply(engine, cio: CheckpointIO, reader: ShardReader, checkpoint: str, own_shards: bool, keys,
           load_states: bool, state: dict, buffers: dict, load_optimizer_states: bool,
           load_lr_scheduler_states: bool) -> None:
    parts = engine.parts
    layout = parts.rank_layout
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
    for key in _COUNTERS:
        setattr(engine, key, state[key])
    if load_optimizer_states and engine.optimizer is not None and state["optimizer"] is not None:
        engine.optimizer.load_hyper_state(state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for name, b in engine.module.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])


def save_16bit_model(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Gather every unit (one at a time) and save the module's state_dict in the compute dtype (rank 0).

    A ``save_filename`` ending in ``.safetensors`` is written streaming: each unit's
    parameters go to the file as soon as they are gathered, so the model is never
    whole in memory. Otherwise the state_dict is assembled and written with
    ``torch.save``. Either way through nvmeio's FastFileWriter, atomically.
    """
    comm, parts = engine.comm, engine.parts
    if not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        log_rank0(comm.rank, (
            "did not save the model: zero_optimization.stage3_gather_16bit_weights_on_model_save is false; "
            "set it to true, or consolidate a checkpoint with zero_to_fp32"), logging.WARNING)
        return False
    path = os.path.join(save_dir, save_filename)
    param_names = {n for u in parts.rank_layout.units for s in u.slots for n in s.names}
    buffers, writer = {}, None
    if comm.rank == 0:
        os.makedirs(save_dir, mode=engine.config.checkpoint.dir_mode, exist_ok=True)
        buffers = {name: t.detach().cpu() for name, t in engine.module.state_dict(keep_vars=True).items()
                   if name not in param_names}
        if save_filename.endswith(".safetensors"):
            spec = {name: (p.dtype, tuple(slot.shape)) for unit in parts.units
                    for slot, p in zip(unit.layout.slots, unit.params)
                    if not (exclude_frozen_parameters and not p.requires_grad) for name in slot.names}
            spec.update({name: (b.dtype, tuple(b.shape)) for name, b in buffers.items()})
            writer = SafetensorsWriter(path, spec, {"format": "pt"})
    values = {}
    try:
        with torch.no_grad():
            for unit in parts.units:
                unit.hold()
                unit.gather()
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
                unit.unhold()
                parts.coordinator.maybe_release(unit)
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
