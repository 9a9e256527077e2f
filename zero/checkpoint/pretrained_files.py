"""The files of a pretrained checkpoint, and their tensors one at a time.

A checkpoint is a directory or a file: safetensors (``model.safetensors``, or
shards named by ``model.safetensors.index.json``) or torch pickles
(``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``).
:func:`checkpoint_files` finds the files; :func:`tensor_entries` lists a
file's tensors (name, shape, dtype) without reading their data;
:func:`open_tensors` reads them one at a time.

safetensors files are read with ``nvmeio.SafetensorsReader`` (O_DIRECT through
two small buffers), so no file is mapped and the memory held is the tensor
being read; the ``safetensors`` package is not needed. ``.bin`` files go through ``torch.load(weights_only=True,
mmap=True)``: nothing in them can execute code, and their tensors are read
from the mapping as they are used.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import torch

_CANDIDATES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
               "pytorch_model.bin")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is (missing shard, names that do not match, ...);
    a damaged safetensors file raises ``nvmeio.SafetensorsError`` (also a ValueError)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    file: str


def checkpoint_files(path) -> List[str]:
    """The files of the checkpoint at ``path`` (a directory, an index, or one file), in index order."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in _CANDIDATES:
            if os.path.isfile(os.path.join(path, name)):
                return checkpoint_files(os.path.join(path, name))
        raise CheckpointError(f"no checkpoint in {path}: expected one of {', '.join(_CANDIDATES)}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.endswith(".index.json"):
        return [path]
    with open(path) as f:
        try:
            weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint index {path} has no readable weight_map: {exc}") from None
    base = os.path.dirname(path)
    files = []
    for shard in dict.fromkeys(weight_map.values()):
        if os.path.basename(shard) != shard:
            raise CheckpointError(f"checkpoint index {path} names shard {shard!r} outside its directory")
        full = os.path.join(base, shard)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint index {path} names shard {shard}, which is missing from {base}")
        files.append(full)
    return files


_READ_BUFFER_BYTES = 8 << 20  # nvmeio's reader buffers (two): larger tensors go through them in pieces


def tensor_entries(file: str) -> List[TensorEntry]:
    """The tensors of one checkpoint file (name, shape, dtype), in file order, none of them read."""
    if file.endswith(".safetensors"):
        from nvmeio import SafetensorsReader

        with SafetensorsReader(file, buffer_size=_READ_BUFFER_BYTES) as r:
            return [TensorEntry(n, r.info(n).shape, r.info(n).dtype, file) for n in r.keys()]
    return [TensorEntry(n, tuple(t.shape), t.dtype, file) for n, t in _torch_state(file).items()]


@contextlib.contextmanager
def open_tensors(file: str) -> Iterator[Callable[[str], torch.Tensor]]:
    """``get(name)`` reading one tensor of ``file`` at a time, while the file is open."""
    if file.endswith(".safetensors"):
        from nvmeio import SafetensorsReader

        with SafetensorsReader(file, buffer_size=_READ_BUFFER_BYTES) as r:
            yield r.get_tensor
    else:
        yield _torch_state(file).__getitem__


def _torch_state(file: str) -> Dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "zipfile" not in str(exc):
            raise
        state = torch.load(file, map_location="cpu", weights_only=True)  # legacy format: no mmap
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} is not a state dict of tensors")
    return state
