"""``zero.load_pretrained(model, path)``: checkpoint tensors into a partitioned model, one at a time.

    with zero.Init(config_dict_or_path=ds_config), torch.device("meta"):
        model = MyModel()                        # no memory, no initialisation
    zero.load_pretrained(model, "checkpoint_dir")  # safetensors / .bin, sharded or not
    engine, *_ = zero.initialize(model=model, config=ds_config)

Each tensor is read, cast to its parameter's dtype (an fp16/bf16 checkpoint
becomes fp32 in an fp32 model, stays 16-bit in a 16-bit one) and goes where
the parameter lives: its :class:`zero.Init` slice (a swap file with
``offload_param.device: nvme``), a new slice for a parameter still on the
meta device, the engine's partitions (master weights included) after
``zero.initialize``, or the tensor itself in a plain model. So the memory
held is about the largest tensor of the checkpoint, never the model. Every
rank reads the files and keeps its own slice.

Everything is checked before the first value is written (all-or-nothing):
every tensor's shape and dtype, and with ``strict`` (the default) that the
checkpoint and the model hold the same names.

``zero.save_pretrained(model, directory)`` is the way back: safetensors files
(sharded with an index past ``max_shard_size``) written by
``nvmeio.SafetensorsWriter``, one gathered parameter at a time, that ``load_pretrained`` (and transformers'
``from_pretrained``, with the model's ``config.json``) reads back bit-identical.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from nvmeio.atomic_file import write_atomically

from ..runtime.comm import init_distributed
from ..stores.malloc_trim import FreedBytes
from ..partitioning.init_store import is_init_partitioned, store_init_shard
from .pretrained_files import CheckpointError, TensorEntry, checkpoint_files, open_tensors, tensor_entries


@dataclass
class LoadResult:
    """What :func:`load_pretrained` did: names of the model not in the checkpoint and the reverse."""

    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    loaded: int = 0  # tensors written into the model


@dataclass
class _Target:
    name: str
    owner: nn.Module
    attr: str
    is_param: bool

    def tensor(self) -> torch.Tensor:
        return (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr]

    def shape(self) -> Tuple[int, ...]:
        t = self.tensor()
        return tuple(getattr(t, "ds_shape", None) or t.shape) if self.is_param else tuple(t.shape)


def _targets(model: nn.Module) -> Dict[str, _Target]:
    """Every name a checkpoint may use for a parameter or persistent buffer of ``model``."""
    out: Dict[str, _Target] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(prefix + attr, _Target(prefix + attr, mod, attr, True))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out.setdefault(prefix + attr, _Target(prefix + attr, mod, attr, False))
    return out


def _resolve(name: str, targets: Dict[str, _Target], prefix: Optional[str]) -> Optional[_Target]:
    """The target of a checkpoint name, allowing for a base-model prefix on either side (Hugging Face)."""
    if name in targets:
        return targets[name]
    if prefix:
        if f"{prefix}.{name}" in targets:
            return targets[f"{prefix}.{name}"]
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in targets:
            return targets[name[len(prefix) + 1:]]
    return None


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    if src == dst:
        return True
    if src.is_floating_point and dst.is_floating_point:
        return True
    integer = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    return src in integer and dst in integer


def _check(entry: TensorEntry, target: _Target) -> None:
    kind = "parameter" if target.is_param else "buffer"
    if entry.shape != target.shape():
        raise CheckpointError(f"checkpoint tensor '{entry.name}' in {entry.file} has shape {entry.shape}, the "
                              f"model's {kind} '{target.name}' has {target.shape()}")
    dst = target.tensor().dtype
    if not _convertible(entry.dtype, dst):
        raise CheckpointError(f"checkpoint tensor '{entry.name}' in {entry.file} is {entry.dtype}, the model's "
                              f"{kind} '{target.name}' is {dst}: zero.load_pretrained converts between "
                              f"floating-point types and between integer types only")


def _replace_everywhere(model: nn.Module, old: torch.Tensor, new: nn.Parameter) -> None:
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is old:
                m._parameters[attr] = new


def _write(model: nn.Module, target: _Target, value: torch.Tensor, comm) -> None:
    current = target.tensor()
    value = value.to(current.dtype)
    with torch.no_grad():
        if not target.is_param:
            if current.is_meta:
                target.owner._buffers[target.attr] = value.clone()
            else:
                current.copy_(value)
        elif is_init_partitioned(current):
            store_init_shard(current, value, comm)
        elif getattr(current, "_zero_unit", None) is not None:
            from ..partitioning.gathered import GatheredParameters

            with GatheredParameters(current, modifier_rank=0):
                current.data.copy_(value)
        elif current.is_meta:
            new = nn.Parameter(value.clone(), requires_grad=current.requires_grad)
            _replace_everywhere(model, current, new)
            context = getattr(current, "_zero_init_context", None)
            if context is not None:
                context.partition(new)
        else:
            current.copy_(value)


def load_pretrained(model: nn.Module, path_or_dir, strict: bool = True) -> LoadResult:
    """Load the checkpoint at ``path_or_dir`` into ``model`` (or a ``zero.initialize`` engine), tensor by
    tensor; see the module docstring. Returns the missing and unexpected names."""
    module = getattr(model, "module", model) if hasattr(model, "parts") else model
    path = os.fspath(path_or_dir)
    files = checkpoint_files(path)
    targets = _targets(module)
    prefix = getattr(module, "base_model_prefix", None)
    plan: List[Tuple[TensorEntry, _Target]] = []
    unexpected: List[str] = []
    seen = set()
    entries_per_file = [tensor_entries(f) for f in files]
    for entries in entries_per_file:
        for entry in entries:
            target = _resolve(entry.name, targets, prefix)
            if target is None:
                unexpected.append(entry.name)
                continue
            _check(entry, target)
            plan.append((entry, target))
            seen.add(id(target.tensor()))
    missing, reported = [], set()
    for t in targets.values():  # one name per tensor: a tied parameter loaded under any name is not missing
        key = id(t.tensor())
        if key not in seen and key not in reported:
            reported.add(key)
            missing.append(t.name)
    if strict and (missing or unexpected):
        problems = []
        if missing:
            problems.append(f"{len(missing)} name(s) of the model are not in the checkpoint: "
                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model: "
                            f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(problems)} "
                              f"(strict=False loads what matches)")
    comm = init_distributed()
    freed = FreedBytes()
    for file in files:
        with open_tensors(file) as get:
            for entry, target in plan:
                if entry.file != file:
                    continue
                value = get(entry.name)
                _write(module, target, value, comm)
                freed.add(value.numel() * value.element_size())
                del value
    return LoadResult(missing, unexpected, len(plan))


def _shards(sizes: List[Tuple[str, int]], max_bytes: int) -> List[List[str]]:
    """Names in order, cut into runs of at most ``max_bytes`` (a larger tensor is a shard alone)."""
    shards: List[List[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def save_pretrained(model: nn.Module, directory, dtype: Optional[torch.dtype] = None,
                    max_shard_size: int = 5_000_000_000) -> str:
    """Write ``model``'s parameters and persistent buffers as safetensors in ``directory``, one
    tensor at a time (each gathered from its partitions, then dropped); ``dtype`` casts floating-point
    tensors. Files of at most ``max_shard_size`` bytes: ``model.safetensors`` if one is enough, else
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (Hugging Face's layout;
    transformers maps each file whole, which fails for a file larger than memory). Every rank must
    call it; rank 0 writes. A Hugging Face model's config is saved beside. Returns the file or index."""
    from nvmeio import SafetensorsWriter

    from ..partitioning.gathered import GatheredParameters

    module = getattr(model, "module", model) if hasattr(model, "parts") else model
    directory = os.fspath(directory)
    comm = init_distributed()
    tensors: Dict[str, _Target] = {}
    seen = set()
    for name, target in _targets(module).items():
        t = target.tensor()
        if id(t) not in seen:  # a tied parameter is saved once, under its first name
            seen.add(id(t))
            tensors[name] = target

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    def nbytes(target: _Target) -> int:
        numel = 1
        for d in target.shape():
            numel *= d
        return numel * torch.empty(0, dtype=out_dtype(target.tensor())).element_size()

    shards = _shards([(n, nbytes(t)) for n, t in tensors.items()], max_shard_size)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if comm.rank == 0:
        os.makedirs(directory, exist_ok=True)
    for file, shard in zip(names, shards):
        writer = None
        if comm.rank == 0:
            spec = {n: (out_dtype(tensors[n].tensor()), tensors[n].shape()) for n in shard}
            writer = SafetensorsWriter(os.path.join(directory, file), spec, metadata={"format": "pt"})
        try:
            for name in shard:
                target = tensors[name]
                t = target.tensor()
                with GatheredParameters([t] if target.is_param else []):
                    if writer is not None:
                        writer.write(name, t.detach().to(out_dtype(t)).contiguous())
            if writer is not None:
                writer.close()
                writer = None
        finally:
            if writer is not None:
                writer.abort()
    result = os.path.join(directory, names[0])
    if comm.rank == 0 and len(shards) > 1:
        result = os.path.join(directory, "model.safetensors.index.json")
        index = {"metadata": {"total_size": sum(nbytes(t) for t in tensors.values())},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        shard_mode = os.stat(os.path.join(directory, names[0])).st_mode & 0o777  # as its shards
        write_atomically(result, json.dumps(index, indent=2).encode("utf-8"), mode=shard_mode)
    config = getattr(module, "config", None)
    if comm.rank == 0 and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    return result
