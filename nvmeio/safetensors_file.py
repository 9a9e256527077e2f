"""Streaming safetensors files: written one tensor at a time, read one tensor at a time.

The format (huggingface/safetensors, documented there): an 8-byte
little-endian header length N, N bytes of JSON
``{"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
..., "__metadata__": {"key": "value"}}`` (padded with spaces), then the raw
little-endian tensor bytes, ``data_offsets`` counting from the end of the
header. Files written here are read by the ``safetensors`` package and the
other way round.

    spec = {name: (t.dtype, t.shape) for name, t in model.state_dict().items()}
    with SafetensorsWriter("model.safetensors", spec, metadata={"format": "pt"}) as w:
        for name, t in model.state_dict().items():   # one at a time: the model is
            w.write(name, t)                         # never whole in memory
    with SafetensorsReader("model.safetensors") as r:
        for name in r.keys():
            t = r.get_tensor(name)

[Note: sizes declared up front]
The header precedes the data and holds every tensor's offsets, and the
writer goes front to back at disk speed: so every tensor's dtype and shape is
declared when the writer is made (a model's are known before its values),
the header is written first, and tensors follow in the declared order, each
checked against its declaration. Tensors sit back to back in that order,
with no gap (the ``safetensors`` package refuses gaps).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ._fast_buffers import DEFAULT_BUFFER_SIZE, IOBuffers
from ._fast_reader import FastFileReader
from ._fast_writer import FastFileWriter
from ._striped_reader import StripedPageReader
from .striping import StripedFile

__all__ = ["SafetensorsWriter", "SafetensorsReader", "SafetensorsError", "save_file", "load_file",
           "TensorInfo", "encode_header"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit


class SafetensorsError(ValueError):
    """A safetensors file (or a tensor given to the writer) is not what the format allows."""


def _dtype_table() -> Dict[str, "object"]:
    import torch

    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
             "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64"}
    return {code: getattr(torch, name) for code, name in names.items() if hasattr(torch, name)}


class TensorInfo:
    """One header entry: dtype code, torch dtype, shape, and the byte range in the file."""

    __slots__ = ("name", "code", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, code: str, dtype, shape: Tuple[int, ...], begin: int, end: int):
        self.name, self.code, self.dtype, self.shape, self.begin, self.end = name, code, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.code}, {list(self.shape)}, [{self.begin}, {self.end}])"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_bytes(tensor):
    """A contiguous CPU tensor's bytes as a flat uint8 numpy array (no copy)."""
    import torch

    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


# -- writing -------------------------------------------------------------------------------


def encode_header(tensors: Mapping[str, Tuple[object, Sequence[int]]], metadata: Optional[Mapping[str, str]] = None,
                  data_alignment: int = 8) -> Tuple[bytes, List[TensorInfo]]:
    """The bytes before the data of a file holding ``tensors`` back to back in this order
    (``{name: (dtype, shape)}``): the 8-byte length and the JSON header, padded with
    spaces so that the data starts at a multiple of ``data_alignment``; and each
    tensor's entry."""
    table = _dtype_table()
    codes = {v: k for k, v in table.items()}
    infos: List[TensorInfo] = []
    offset = 0
    header: Dict[str, object] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("metadata must map str to str (safetensors stores strings only), "
                                   f"got {metadata!r}")
        header["__metadata__"] = dict(metadata)
    for name, (dtype, shape) in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(f"tensor name must be a str other than '__metadata__', got {name!r}")
        code = dtype if isinstance(dtype, str) else codes.get(dtype)
        if code not in table:
            raise SafetensorsError(f"tensor {name!r}: dtype {dtype} has no safetensors code "
                                   f"(supported: {', '.join(table)})")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise SafetensorsError(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        nbytes = _numel(shape) * table[code].itemsize
        info = TensorInfo(name, code, table[code], shape, offset, offset + nbytes)
        infos.append(info)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [info.begin, info.end]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % max(8, data_alignment))  # JSON allows trailing spaces
    return struct.pack("<Q", len(raw)) + raw, infos


class SafetensorsWriter:
    """Writes a safetensors file whose tensors are declared up front (see [Note: sizes declared up front]).

    Args:
        path: the file (written atomically through :class:`~nvmeio.FastFileWriter`).
        tensors: ``{name: (dtype, shape)}`` in the order the tensors will be
            written; a torch dtype or a safetensors code ("F32", "BF16", ...).
        metadata: ``{str: str}`` stored as ``__metadata__``.
        io: a :class:`~nvmeio.FastIO` to write through (default: a private one).
        file: instead of ``path``/``io``, an open writer to write into (a
            FastFileWriter or PlainFileWriter, owned from then on).
        data_alignment: the header is padded with spaces so that the data
            starts at a multiple of this (8 as the package does; 4096 keeps
            the tensor data on O_DIRECT boundaries).

    ``write(name, tensor)`` in the declared order; ``copy_from(name, source,
    offset)`` takes a tensor's bytes from another file inside the kernel.
    ``close()`` checks every tensor was written, then commits the file.
    """

    def __init__(self, path, tensors: Mapping[str, Tuple[object, Sequence[int]]],
                 metadata: Optional[Mapping[str, str]] = None, *, io: Optional[IOBuffers] = None,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, double_buffer: bool = True, file=None,
                 data_alignment: int = 8):
        try:
            raw, self._infos = encode_header(tensors, metadata, data_alignment)
        except BaseException:
            if file is not None:
                file.abort()
            raise
        self.data_start = len(raw)
        self.data_bytes = self._infos[-1].end if self._infos else 0
        self._next = 0
        self._file = file if file is not None else FastFileWriter(
            path, io=io, buffer_size=buffer_size, double_buffer=double_buffer)
        self.name = self._file.name
        reserve = getattr(self._file, "reserve", None)  # the fast writer allocates the file at once
        if reserve is not None:
            try:
                reserve(self.data_start + self.data_bytes)
            except BaseException:
                self._file.abort()
                raise
        self._file.write(raw)

    def infos(self) -> List[TensorInfo]:
        return list(self._infos)

    def _expect(self, name: str) -> TensorInfo:
        if self._next >= len(self._infos):
            raise SafetensorsError(f"{self.name}: tensor {name!r} written after every declared tensor")
        info = self._infos[self._next]
        if name != info.name:
            raise SafetensorsError(f"{self.name}: tensors are written in the declared order: expected "
                                   f"{info.name!r} next, got {name!r}")
        return info

    def write(self, name: str, tensor) -> None:
        """Writes the next declared tensor (any device, any strides; copied to the CPU if needed)."""
        info = self._expect(name)
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise SafetensorsError(f"{self.name}: tensor {name!r} was declared {info.dtype} "
                                   f"{list(info.shape)}, got {tensor.dtype} {list(tensor.shape)}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
        self._file.write(_as_bytes(tensor))
        self._next += 1

    def copy_from(self, name: str, source, offset: int = 0, **how) -> None:
        """The next declared tensor's bytes, from file ``source`` (path or fd) at ``offset``,
        file to file (see ``FastFileWriter.copy_from``; ``how`` is passed on)."""
        info = self._expect(name)
        self._file.copy_from(source, info.nbytes, offset, **how)
        self._next += 1

    def close(self) -> None:
        if self._file.closed:
            return
        if self._next != len(self._infos):
            missing = [i.name for i in self._infos[self._next:]]
            self._file.abort()
            raise SafetensorsError(f"{self.name}: closed before every declared tensor was written "
                                   f"(missing: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                                   "the file was not written")
        self._file.close()

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def save_file(tensors: Mapping[str, object], path, metadata: Optional[Mapping[str, str]] = None, *,
              io: Optional[IOBuffers] = None) -> None:
    """``safetensors.torch.save_file`` through the fast writer (atomic, 0600)."""
    spec = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsWriter(path, spec, metadata, io=io) as w:
        for name, t in tensors.items():
            w.write(name, t)


# -- reading -------------------------------------------------------------------------------


def parse_header(raw: bytes, data_bytes: int, where: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Checks a header against the format and the size of the data that follows it."""
    table = _dtype_table()
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{where}: damaged header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: damaged header: a JSON object was expected, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise SafetensorsError(f"{where}: damaged header: __metadata__ must map str to str")
    infos: Dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where}: damaged header: tensor {name!r} must have exactly dtype, "
                                   f"shape and data_offsets, got {entry!r}")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in table:
            raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {code!r} "
                                   f"(known: {', '.join(table)})")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: tensor {name!r} has a bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise SafetensorsError(f"{where}: tensor {name!r} has bad data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise SafetensorsError(f"{where}: tensor {name!r} data_offsets [{begin}, {end}] are out of "
                                   f"range (the file holds {data_bytes} data bytes)")
        dtype = table[code]
        if end - begin != _numel(shape) * dtype.itemsize:
            raise SafetensorsError(f"{where}: tensor {name!r} spans {end - begin} bytes but {code} "
                                   f"{shape} needs {_numel(shape) * dtype.itemsize}")
        infos[name] = TensorInfo(name, code, dtype, tuple(shape), begin, end)
    ranges = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{where}: tensors {n0!r} [{b0}, {e0}] and {n1!r} [{b1}, {e1}] overlap")
    return infos, metadata


class SafetensorsReader:
    """Reads a safetensors file one tensor at a time (``keys()``, ``get_tensor``, ``metadata()``).

    The header is checked when the file is opened: a bad length, invalid
    JSON, an unknown dtype, offsets out of range or overlapping, or a size
    that does not match the shape raise :class:`SafetensorsError` naming the
    file and the tensor. Tensor bytes are read through a
    :class:`~nvmeio.FastFileReader` (O_DIRECT, read-ahead), or with
    ``direct=False`` through the page cache (small scattered reads of many
    files: no buffers to set up per file). ``path`` may be a :class:`~nvmeio.StripedFile`
    (a file striped over several, read as one; named by its first part).
    """

    def __init__(self, path, *, io: Optional[IOBuffers] = None, buffer_size: int = DEFAULT_BUFFER_SIZE,
                 double_buffer: bool = True, direct: bool = True):
        if direct:
            self._file = FastFileReader(path, io=io, buffer_size=buffer_size, double_buffer=double_buffer)
        elif isinstance(path, StripedFile):
            self._file = StripedPageReader(path)
        else:
            self._file = open(path, "rb", buffering=0)  # closed by close()
            self._file.size = os.fstat(self._file.fileno()).st_size
        self.name = self._file.name if isinstance(path, StripedFile) else os.fspath(path)
        self.source = path if isinstance(path, StripedFile) else self.name  # what it reads
        try:
            size = self._file.size
            if size < 8:
                raise SafetensorsError(f"{self.name}: {size} bytes is too short for a safetensors file "
                                       "(8-byte header length missing)")
            (n,) = struct.unpack("<Q", self._file.read(8))
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{self.name}: damaged header: its length field says {n} bytes but "
                                       f"the file holds {size - 8} after it (limit {MAX_HEADER_BYTES})")
            self.data_start = 8 + n
            self._infos, self._metadata = parse_header(self._file.read(n), size - self.data_start, self.name)
        except BaseException:
            self._file.close()
            raise

    def keys(self) -> List[str]:
        """Tensor names in file order."""
        return sorted(self._infos, key=lambda k: (self._infos[k].begin, k))

    def metadata(self) -> Dict[str, str]:
        return dict(self._metadata)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.name} holds no tensor {name!r}") from None

    def get_tensor(self, name: str, out=None):
        """The tensor ``name`` as a new CPU tensor, or read into ``out`` (a contiguous
        CPU tensor of the same dtype and number of elements)."""
        import torch

        info = self.info(name)
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        elif (out.dtype != info.dtype or out.numel() != _numel(info.shape) or out.device.type != "cpu"
              or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous CPU {info.dtype} tensor of {_numel(info.shape)} "
                             f"elements for {name!r}, got {out.dtype} {list(out.shape)} on {out.device}")
        if info.nbytes:
            self._file.seek(self.data_start + info.begin)
            got = self._read_exact(memoryview(_as_bytes(out)))
            if got != info.nbytes:
                raise SafetensorsError(f"{self.name}: tensor {name!r} is cut short ({got} of {info.nbytes} bytes)")
        return out

    def read_range(self, name: str, start: int, stop: int, out=None):
        """Elements ``[start, stop)`` of the flattened tensor ``name`` (only those bytes are read)."""
        import torch

        info = self.info(name)
        numel = _numel(info.shape)
        if not 0 <= start <= stop <= numel:
            raise IndexError(f"{self.name}: elements [{start}, {stop}) are outside {name!r} of {numel} elements")
        if out is None:
            out = torch.empty(stop - start, dtype=info.dtype)
        elif out.dtype != info.dtype or out.numel() != stop - start or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {info.dtype} tensor of {stop - start} elements")
        if stop > start:
            size = info.dtype.itemsize
            self._file.seek(self.data_start + info.begin + start * size)
            got = self._read_exact(memoryview(_as_bytes(out)))
            if got != (stop - start) * size:
                raise SafetensorsError(f"{self.name}: tensor {name!r} is cut short")
        return out

    def views(self, name: str, chunk_bytes: int = 8 << 20) -> Iterator[memoryview]:
        """The bytes of tensor ``name`` as memoryviews, in order: straight out of the fast
        reader's locked buffers (no copy), or read in ``chunk_bytes`` pieces with
        ``direct=False``. Each view is valid until the next one is asked for."""
        info = self.info(name)
        start = self.data_start + info.begin
        if isinstance(self._file, FastFileReader):
            yield from self._file.views(start, info.nbytes)
            return
        chunk = bytearray(min(chunk_bytes, info.nbytes))
        done = 0
        while done < info.nbytes:
            n = min(len(chunk), info.nbytes - done)
            self._file.seek(start + done)
            if self._read_exact(memoryview(chunk)[:n]) != n:
                raise SafetensorsError(f"{self.name}: tensor {name!r} is cut short")
            yield memoryview(chunk)[:n]
            done += n

    def _read_exact(self, view: memoryview) -> int:
        """readinto until full or end of file (a plain read() stops at 2 GiB)."""
        done = 0
        while done < len(view):
            n = self._file.readinto(view[done:])
            if not n:
                break
            done += n
        return done

    def tensors(self) -> Iterable[Tuple[str, object]]:
        """(name, tensor) in file order, one tensor in memory at a time (for the caller to drop)."""
        for name in self.keys():
            yield name, self.get_tensor(name)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def load_file(path, *, io: Optional[IOBuffers] = None) -> Dict[str, object]:
    """``safetensors.torch.load_file`` through the fast reader."""
    with SafetensorsReader(path, io=io) as r:
        return dict(r.tensors())
