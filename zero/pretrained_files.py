"""The files of a pretrained checkpoint, and their tensors one at a time.

A checkpoint is a directory or a file: safetensors (``model.safetensors``, or
shards named by ``model.safetensors.index.json``) or torch pickles
(``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``).
:func:`checkpoint_files` finds the files; :func:`tensor_entries` lists a
file's tensors (name, shape, dtype) without reading their data, each with a
``read()`` that returns that one tensor.

safetensors files are read through ``nvmeio.aio_handle`` (the header, then
each tensor's byte range straight into a fresh tensor), so no file is mapped
and the memory held is the tensor being read; the ``safetensors`` package is
not needed. ``.bin`` files go through ``torch.load(weights_only=True,
mmap=True)``: nothing in them can execute code, and their tensors are read
from the mapping as they are used.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CANDIDATES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
               "pytorch_model.bin")
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is (missing shard, corrupt header, ...)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    file: str
    read: Callable[[], torch.Tensor]


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


def reader_handle():
    """The ``nvmeio.aio_handle`` that reads safetensors data (one per load)."""
    import nvmeio

    return nvmeio.aio_handle(block_size=8 << 20, queue_depth=32, intra_op_parallelism=2)


def tensor_entries(file: str, handle=None) -> List[TensorEntry]:
    """The tensors of one checkpoint file, in file order, none of them read yet."""
    if file.endswith(".safetensors"):
        return _safetensors_entries(file, handle or reader_handle())
    return _torch_entries(file)


def _read_bytes(handle, file: str, offset: int, nbytes: int, itemsize: int = 1) -> torch.Tensor:
    """``nbytes`` at ``offset`` into a fresh tensor placed at the same address modulo 4096 as the
    file offset, so that the whole aligned middle is read with O_DIRECT, without a bounce buffer."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    shift = (offset - raw.data_ptr()) % 4096
    if shift % itemsize:  # the tensor's elements would be misaligned: plain placement
        shift = 0
    out = raw[shift:shift + nbytes]
    if nbytes:
        handle.sync_pread(out, file, file_offset=offset)
    return out


def _safetensors_entries(file: str, handle) -> List[TensorEntry]:
    size = os.path.getsize(file)
    if size < 8:
        raise CheckpointError(f"safetensors file {file} is {size} bytes, too short for a header")
    (header_len,) = struct.unpack("<Q", _read_bytes(handle, file, 0, 8).numpy().tobytes())
    if header_len > min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"safetensors file {file} declares a {header_len}-byte header in a {size}-byte "
                              f"file: it is not a safetensors file or it is truncated")
    try:
        header = json.loads(_read_bytes(handle, file, 8, header_len).numpy().tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"safetensors file {file} has a corrupt header: {exc}") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"tensor '{name}' in {file} has dtype {info.get('dtype')!r}, which "
                                  f"zero.load_pretrained cannot read (known: {', '.join(SAFETENSORS_DTYPES)})")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(f"tensor '{name}' in {file} claims bytes [{begin}, {end}) of the data, which "
                                  f"do not hold {shape} {dtype} inside the file's {size - data_start} data "
                                  f"bytes: the file is corrupt or truncated")
        entries.append(TensorEntry(name, shape, dtype, file, _safetensors_reader(
            handle, file, data_start + begin, nbytes, dtype, shape)))
    entries.sort(key=lambda e: int(header[e.name]["data_offsets"][0]))  # file order: sequential reads
    return entries


def _safetensors_reader(handle, file, offset, nbytes, dtype, shape):
    def read() -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return _read_bytes(handle, file, offset, nbytes, itemsize).view(dtype).view(shape)

    return read


def _torch_entries(file: str) -> List[TensorEntry]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "zipfile" not in str(exc):
            raise
        state = torch.load(file, map_location="cpu", weights_only=True)  # legacy format: no mmap
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} is not a state dict of tensors")
    return [TensorEntry(name, tuple(t.shape), t.dtype, file, (lambda t=t: t)) for name, t in state.items()]
