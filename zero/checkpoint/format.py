"""The on-disk layout of a ZeRO checkpoint, and a reader that works for any world size.

```
<save_dir>/latest                      the newest complete tag, e.g. "global_step100"
<save_dir>/.<tag>.old-<random>/        a complete copy of <tag> moved aside while a re-save of
                                       <tag> is published (only where the file system cannot
                                       exchange two directories; see publish.py)
<save_dir>/<tag>/zero_meta.json        format, world size, sub_group_size, every unit's parameters;
                                       the units stored quantized, if any (QUANTIZED); the frozen
                                       units and parameters; the units left out (EXCLUDED_UNITS)
<save_dir>/<tag>/buffers.pt            the module's buffers (rank 0)
<save_dir>/<tag>/rank00001/engine.pt   step counters, optimizer settings, loss scaler, LR schedule,
                                       client state (one per rank)
<save_dir>/<tag>/rank00001/subgroup00003.safetensors
                                       one sub-group of that rank: fp32 "master" and the optimizer
                                       states ("exp_avg", "exp_avg_sq"), each the sub-group's range
                                       of the rank's flat space (stores/layouts.py); safetensors, data
                                       on a 4096-byte boundary (shard_io.py)
<save_dir>/<tag>/rank00001/subgroup00003.safetensors.stripe1, .stripe2, ...
                                       the rest of a striped shard: one whose header says it is
                                       one logical file cut over several, as the swap file it was
                                       linked from was cut over drives ([Note: striped shards])
```

Rank layouts are a pure function of the units, the world size and
``sub_group_size`` (stores/layouts.py), so ``zero_meta.json`` holds only those and
:class:`ShardReader` can find any element of any parameter: that is what lets
``zero_to_fp32`` rebuild full parameters one at a time, and a checkpoint
saved on N ranks be loaded on M. Only the bytes asked for are ever read
(through the page cache: scattered ranges of many files).

[Note: striped shards]
With ``nvme_path`` a list of drives, a sub-group's swap file is striped over them (one file
per drive, nvmeio/striping.py). Where the checkpoint directory shares a file system with
some of those drives, its shard is the swap file taken part by part: each part hard-linked
into the rank directory where it can be, copied where not (shard_io.py). Such a shard is
its parts, named ``<shard>`` and ``<shard>.stripe<k>``; the safetensors header at the start of
the first part describes the logical file and its metadata says how it is cut (``stripes``:
the number of parts, ``stripe_unit``: bytes per unit, unit ``i`` in part ``i % stripes``).
:func:`shard_source` turns a shard's name into what a reader opens (the path, or an
:class:`nvmeio.StripedFile` of its parts), so every reader (a load, a resharded load,
``zero_to_fp32``) reads either kind; a load into swap files cut alike links back each part
its drive's file system allows and writes the others (swapper/_sub_group_files.py
``stage_state``). A tool that reads the first part as a plain
safetensors file finds its data cut short and refuses it rather than read wrong values.
A shard whose parts share no file system with the checkpoint is copied as one plain file.

Nothing read from a checkpoint runs code: the sub-group shards are
safetensors, every ``.pt`` file is loaded with ``torch.load(weights_only=True)``
(:func:`load_state`), and a tag, given or read from ``latest``, must be a
plain directory name (:func:`check_tag`), so a checkpoint received from
someone else can neither execute anything nor make a load read outside its
directory.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Union

import torch

from nvmeio import SafetensorsReader, StripedFile

from ..stores.layouts import RankLayout, UnitLayout, build_rank_layout, build_unit_layout

FORMAT = "nvmeio-zero3/2"  # 2: sub-group shards are safetensors
META = "zero_meta.json"
BUFFERS = "buffers.pt"
LATEST = "latest"
OLD_COPY = ".old-"  # in ".<tag>.old-<random>": a complete copy moved aside during a re-save
NAME_MAX = 255  # bytes in one file name (Linux's NAME_MAX): a tag is a directory's name
_LATEST_MAX_BYTES = 4096


class CheckpointTagError(ValueError):
    """A checkpoint tag (an argument, or what ``latest`` holds) that is not a plain directory name."""


class CheckpointCorruptionError(ValueError):
    """A checkpoint shard whose bytes differ from the checksums saved with them."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds something other than tensors and plain containers (it was not run)."""


def check_tag(tag, source: str = "checkpoint tag") -> str:
    """``tag`` as a string, if it is a plain directory name; else :class:`CheckpointTagError`.

    The same rules on save and on load (argument or ``latest``): not empty, no
    path separator, not ``.``/``..`` nor any name starting with ``.`` (the
    partial and moved-aside directories), not ``latest``, no whitespace at
    either end and no control character (a newline would make ``latest``
    unreadable), UTF-8 text (what ``latest`` holds) and at most ``NAME_MAX``
    (255) bytes, the longest file name.
    """
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise CheckpointTagError(f"{source} must be a string, got {type(tag).__name__} {tag!r}")
    text = str(tag)
    if not text:
        why = "is empty"
    elif "/" in text or "\\" in text or (os.altsep and os.altsep in text):
        why = "holds a path separator (an absolute path or a path to another directory)"
    elif text.startswith("."):
        why = "starts with '.' ('.', '..' and hidden names are reserved)"
    elif text != text.strip():
        why = "has whitespace at its start or end"
    elif any(ord(c) < 32 or ord(c) == 127 for c in text):
        why = "holds a control character (a newline?)"
    elif text == LATEST:
        why = f"is {LATEST!r}, the name of the file that points at the newest tag"
    elif not _is_utf8(text):
        why = f"is not UTF-8 text ({LATEST!r} holds the tag as UTF-8)"
    elif len(os.fsencode(text)) > NAME_MAX:
        why = (f"is {len(os.fsencode(text))} bytes long, over the {NAME_MAX}-byte limit of a "
               "file name")
    else:
        return text
    shown = repr(text if len(text) <= 200 else text[:200] + "...")
    raise CheckpointTagError(f"{source} {shown} {why}; a tag must be a plain directory name inside the "
                             f"checkpoint directory (e.g. 'global_step100')")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def rank_dir(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, f"rank{rank:05d}")


def sub_group_file(checkpoint: str, rank: int, index: int) -> str:
    return os.path.join(rank_dir(checkpoint, rank), f"subgroup{index:05d}.safetensors")


STRIPES = "stripes"          # shard metadata: the number of files a striped shard is cut into
STRIPE_UNIT = "stripe_unit"  # and the bytes of one stripe unit ([Note: striped shards])
MAX_STRIPES = 256
_HEADER_PAGE = 4096  # a striped shard's header is its swap file's header page (shard_io.py)


def shard_part(path: str, k: int) -> str:
    """The name of part ``k`` of the (striped) shard ``path``: part 0 is ``path`` itself."""
    return path if k == 0 else f"{path}.stripe{k}"


def shard_source(path: str) -> Union[str, StripedFile]:
    """What a reader opens for the shard ``path``: the path, or where its header says it is
    striped, a :class:`~nvmeio.StripedFile` of its parts ([Note: striped shards]). A header
    that cannot be read is left to the reader to report; stripes out of range or a part
    missing are refused here, naming the shard."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_PAGE)
    meta = None
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if n <= len(head) - 8:
            try:
                meta = json.loads(head[8:8 + n]).get("__metadata__")
            except (ValueError, AttributeError):
                meta = None
    if not isinstance(meta, dict) or STRIPES not in meta:
        return path
    count, unit = _small_int(meta.get(STRIPES)), _small_int(meta.get(STRIPE_UNIT))
    if count is None or unit is None or not 2 <= count <= MAX_STRIPES or unit <= 0 or unit % _HEADER_PAGE:
        raise CheckpointCorruptionError(
            f"checkpoint shard {path} is damaged: its header says it is striped over {meta.get(STRIPES)!r} files "
            f"in units of {meta.get(STRIPE_UNIT)!r} bytes (2 to {MAX_STRIPES} files, units a multiple of "
            f"{_HEADER_PAGE} bytes)")
    parts = tuple(shard_part(path, k) for k in range(count))
    for part in parts[1:]:
        if not os.path.isfile(part):
            raise FileNotFoundError(f"checkpoint shard {path} is striped over {count} files and {part} is missing")
    return StripedFile(parts, unit)


def _small_int(text) -> Optional[int]:
    """A metadata value of at most 18 ASCII digits as an int, else None."""
    if isinstance(text, str) and 0 < len(text) <= 18 and text.isascii() and text.isdigit():
        return int(text)
    return None


def open_shard(path: str, **how) -> SafetensorsReader:
    """A reader of the shard ``path``, plain or striped (``how``: SafetensorsReader's options)."""
    return SafetensorsReader(shard_source(path), **how)


def engine_file(checkpoint: str, rank: int) -> str:
    return os.path.join(rank_dir(checkpoint, rank), "engine.pt")


QUANTIZED = "quantized_nontrainable_weights"
"""The meta key naming the units stored int8 (stores/quantized.py): their "master" in the shards
is the dequantized values, from which the int8 codes and scales come back exactly at the same world
size ([Note: frozen weights stored quantized])."""
FROZEN_UNITS = "frozen_units"
"""The meta key naming the units without optimizer state (stores/layouts.py [Note: the optimizer
covers the trainable units only]): their shards come last in each rank's sub-groups, "master" alone."""


FROZEN_PARAMS = "frozen_parameters"
"""The meta key naming every parameter that had ``requires_grad=False`` when saved (a trainable
unit may hold some): what ``zero_to_fp32 --exclude_frozen_parameters`` leaves out."""
EXCLUDED_UNITS = "excluded_units"
"""The meta key naming the frozen units whose shards a save left out
(``save_checkpoint(exclude_frozen_parameters=True)``, [Note: checkpoints without the frozen
units]): every rank's frozen sub-groups are absent."""


def shown_names(names, count: int = 4) -> str:
    """The first ``count`` of ``names`` for a message, and how many more."""
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")


def quantized_meta(frozen) -> dict:
    return {"codes": "int8", "scales": "float32", "group_size": frozen.group_size, "units": sorted(frozen.units)}


def quantized_param_names(meta: dict) -> List[str]:
    """The parameters of a checkpoint's quantized units (none without the key)."""
    quantized = meta.get(QUANTIZED)
    if not quantized:
        return []
    units = units_from_meta(meta)
    return [s.name for i in quantized["units"] for s in units[i].slots]


def meta_dict(units: List[UnitLayout], world_size: int, sub_group_size: int, precision: str,
              frozen_units=(), frozen_params=(), exclude_frozen: bool = False) -> dict:
    meta = {
        "format": FORMAT,
        "world_size": world_size,
        "sub_group_size": sub_group_size,
        "precision": precision,
        "units": [{"module": u.module_name,
                   "params": [{"names": list(s.names), "shape": list(s.shape)} for s in u.slots]}
                  for u in units],
    }
    if frozen_units:  # their shards hold a master and no states, after the others' (stores/layouts.py)
        meta[FROZEN_UNITS] = sorted(frozen_units)
    if frozen_params:
        meta[FROZEN_PARAMS] = list(frozen_params)
    if exclude_frozen and frozen_units:
        meta[EXCLUDED_UNITS] = sorted(frozen_units)
    return meta


def _unit_indices(meta: dict, key: str) -> frozenset:
    indices = meta.get(key, [])
    count = len(meta["units"])
    if (not isinstance(indices, list) or len(set(indices)) != len(indices)
            or not all(type(i) is int and 0 <= i < count for i in indices)):
        raise CheckpointCorruptionError(f"checkpoint meta {key!r} is not a list of distinct unit "
                                        f"indices below {count}: {str(indices)[:80]}")
    return frozenset(indices)


def frozen_units_from_meta(meta: dict) -> frozenset:
    """The units a checkpoint's optimizer did not cover (none in checkpoints without the key)."""
    return _unit_indices(meta, FROZEN_UNITS)


def excluded_units_from_meta(meta: dict) -> frozenset:
    """The units whose shards the checkpoint does not hold (frozen ones, left out at the save)."""
    excluded = _unit_indices(meta, EXCLUDED_UNITS)
    if not excluded <= frozen_units_from_meta(meta):
        raise CheckpointCorruptionError(f"checkpoint meta {EXCLUDED_UNITS!r} names units that are not frozen: "
                                        f"{sorted(excluded - frozen_units_from_meta(meta))[:8]}")
    return excluded


def frozen_param_names(meta: dict) -> frozenset:
    """The parameters saved with ``requires_grad=False``; a checkpoint without the key: those of
    its frozen units."""
    if FROZEN_PARAMS not in meta:
        units = meta["units"]
        return frozenset(n for i in frozen_units_from_meta(meta) for p in units[i]["params"] for n in p["names"])
    names = meta[FROZEN_PARAMS]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointCorruptionError(f"checkpoint meta {FROZEN_PARAMS!r} is not a list of parameter names: "
                                        f"{str(names)[:80]}")
    return frozenset(names)


def units_from_meta(meta: dict) -> List[UnitLayout]:
    return [build_unit_layout(i, u["module"], [(tuple(p["names"]), tuple(p["shape"])) for p in u["params"]],
                              meta["world_size"])
            for i, u in enumerate(meta["units"])]


def resolve_tag(save_dir: str, tag: Optional[str]) -> Optional[str]:
    """``tag``, or the one ``latest`` names (both checked by :func:`check_tag`); None when
    there is no ``latest``. Whitespace around what ``latest`` holds is ignored, as DeepSpeed does."""
    if tag is not None:
        return check_tag(tag)
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(_LATEST_MAX_BYTES + 1)
    if len(raw) > _LATEST_MAX_BYTES:
        raise CheckpointTagError(f"{path} is not a tag: it holds more than {_LATEST_MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointTagError(f"{path} is not a tag: it is not UTF-8 text") from None
    return check_tag(text.strip(), f"the tag in {path}")


def checkpoint_path(save_dir: str, tag: str) -> str:
    """The directory of ``tag``; where a re-save was cut between its two renames (see
    publish.py), the complete copy it moved aside."""
    path = os.path.join(save_dir, tag)
    if os.path.isdir(path):
        return path
    old = moved_aside(save_dir, tag)
    return old[-1] if old else path


def moved_aside(save_dir: str, tag: str) -> List[str]:
    """The complete copies of ``tag`` a re-save moved aside, oldest first."""
    prefix = f".{tag}{OLD_COPY}"
    try:
        entries = [os.path.join(save_dir, e) for e in os.listdir(save_dir) if e.startswith(prefix)]
    except FileNotFoundError:
        return []
    return sorted((p for p in entries if os.path.isdir(p) and not os.path.islink(p)), key=os.path.getmtime)


def unsafe_error(path: str, error: pickle.UnpicklingError) -> "UnsafeCheckpointError":
    """The error for a file ``torch.load(weights_only=True)`` refused, naming it and what it holds."""
    lines = [l.strip() for l in str(error).splitlines() if "GLOBAL" in l or "Unsupported" in l]
    reason = lines[0] if lines else (str(error).strip().splitlines() or ["not a torch.save file"])[-1]
    return UnsafeCheckpointError(
        f"refused to load {path}: it holds more than tensors and plain containers ({reason}); "
        f"nothing in it was run. Load checkpoints only from sources you trust; if this one holds "
        f"your own types (in client_state), allow them with "
        f"torch.serialization.add_safe_globals([YourType]) before loading")


def load_state(path: str):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, nothing run.

    Anything else raises :class:`UnsafeCheckpointError` naming the file and what it holds.
    A script's own types in ``client_state`` can be allowed with
    ``torch.serialization.add_safe_globals([...])`` before loading.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise unsafe_error(path, error) from None


def read_meta(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, META)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{checkpoint} is not a ZeRO checkpoint of this engine: {META} is missing")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT!r})")
    return meta


class ShardReader:
    """Reads ranges of a unit's flat fp32 values (or optimizer states) from a checkpoint."""

    OPEN_SHARDS = 64

    def __init__(self, checkpoint: str, meta: Optional[dict] = None):
        self.checkpoint = checkpoint
        self.meta = meta or read_meta(checkpoint)
        self.units = units_from_meta(self.meta)
        self.frozen = frozen_units_from_meta(self.meta)  # their shards hold no optimizer states
        self.excluded = excluded_units_from_meta(self.meta)  # their shards are not there at all
        self.world_size = self.meta["world_size"]
        self._layouts: Dict[int, RankLayout] = {}
        # Open shards, least recently used first; at most OPEN_SHARDS (a striped one holds a
        # descriptor per part, and a resharded load may touch every rank's shards).
        self._files: "OrderedDict[Tuple[int, int], SafetensorsReader]" = OrderedDict()

    def rank_layout(self, rank: int) -> RankLayout:
        if rank not in self._layouts:
            self._layouts[rank] = build_rank_layout(self.units, rank, self.meta["sub_group_size"], self.frozen)
        return self._layouts[rank]

    def _file(self, rank: int, index: int) -> SafetensorsReader:
        key = (rank, index)
        if key in self._files:
            self._files.move_to_end(key)
        else:
            if len(self._files) >= self.OPEN_SHARDS:
                self._files.popitem(last=False)[1].close()
            path = sub_group_file(self.checkpoint, rank, index)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint {self.checkpoint} is incomplete: {path} is missing")
            self._files[key] = open_shard(path, direct=False)
        return self._files[key]

    def _pieces(self, unit_index: int, start: int, stop: int):
        """``(rank, sub_group_index, source_start, out_start, length)`` of each rank file holding
        part of elements ``[start, stop)`` of unit ``unit_index``."""
        unit = self.units[unit_index]
        if unit_index in self.excluded:
            raise KeyError(f"checkpoint {self.checkpoint} does not hold {', '.join(s.name for s in unit.slots)}: "
                           f"it was saved with exclude_frozen_parameters=True, which leaves frozen parameters out")
        shard = unit.shard_numel
        stop_data = min(stop, unit.numel)
        for rank in range(start // shard if shard else 0, self.world_size):
            lo, hi = rank * shard, (rank + 1) * shard
            a, b = max(start, lo), min(stop_data, hi)
            if a >= stop_data:
                break
            if a >= b:
                continue
            layout = self.rank_layout(rank)
            sg = layout.sub_group_of(unit_index)
            base = layout.offsets[unit_index] - sg.start
            yield rank, sg.index, base + a - lo, a - start, b - a

    def _part(self, rank: int, index: int, key: str, need: int) -> SafetensorsReader:
        part = self._file(rank, index)
        if key not in part.keys():
            raise KeyError(f"checkpoint {self.checkpoint} holds no {key!r} in {part.name} "
                           f"(saved without an optimizer?)")
        info = part.info(key)
        if info.dtype != torch.float32 or len(info.shape) != 1 or info.shape[0] < need:
            raise ValueError(f"checkpoint {self.checkpoint} is damaged: {key!r} in {part.name} is not a flat "
                             f"fp32 tensor of at least {need} elements")
        return part

    def files(self, unit_index: int, start: int, stop: int) -> List[str]:
        """The shard files holding elements ``[start, stop)`` of unit ``unit_index``."""
        return [sub_group_file(self.checkpoint, rank, index)
                for rank, index, _, _, _ in self._pieces(unit_index, start, stop)]

    def check(self, unit_index: int, start: int, stop: int, key: str = "master") -> None:
        """Raise what :meth:`read` would raise for these elements (a missing file, key or range),
        reading no values."""
        for rank, index, src, _, n in self._pieces(unit_index, start, stop):
            self._part(rank, index, key, src + n)

    def read(self, unit_index: int, start: int, stop: int, key: str = "master") -> torch.Tensor:
        """Elements ``[start, stop)`` of unit ``unit_index``'s flat values (zeros past its end)."""
        out = torch.zeros(max(0, stop - start), dtype=torch.float32)
        for rank, index, src, dst, n in self._pieces(unit_index, start, stop):
            self._part(rank, index, key, src + n).read_range(key, src, src + n, out=out[dst:dst + n])
        return out

    def param_names(self) -> List[str]:
        return [name for u in self.units for s in u.slots for name in s.names]

    def close(self) -> None:
        for shard in self._files.values():
            shard.close()
        self._files.clear()
