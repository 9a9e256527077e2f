"""The on-disk layout of a ZeRO checkpoint, and a reader that works for any world size.

```
<save_dir>/latest                      the newest complete tag, e.g. "global_step100"
<save_dir>/<tag>/zero_meta.json        format, world size, sub_group_size, every unit's parameters
<save_dir>/<tag>/buffers.pt            the module's buffers (rank 0)
<save_dir>/<tag>/rank00001/engine.pt   step counters, optimizer settings, loss scaler, LR schedule,
                                       client state (one per rank)
<save_dir>/<tag>/rank00001/subgroup00003.safetensors
                                       one sub-group of that rank: fp32 "master" and the optimizer
                                       states ("exp_avg", "exp_avg_sq"), each the sub-group's range
                                       of the rank's flat space (partition.py); safetensors, data
                                       on a 4096-byte boundary (checkpoint_io.py)
```

Rank layouts are a pure function of the units, the world size and
``sub_group_size`` (partition.py), so ``zero_meta.json`` holds only those and
:class:`ShardReader` can find any element of any parameter: that is what lets
``zero_to_fp32`` rebuild full parameters one at a time, and a checkpoint
saved on N ranks be loaded on M. Only the bytes asked for are ever read
(through the page cache: scattered ranges of many files).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from nvmeio import SafetensorsReader

from .partition import RankLayout, UnitLayout, build_rank_layout, build_unit_layout

FORMAT = "nvmeio-zero3/2"  # 2: sub-group shards are safetensors
META = "zero_meta.json"
BUFFERS = "buffers.pt"
LATEST = "latest"


def rank_dir(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, f"rank{rank:05d}")


def sub_group_file(checkpoint: str, rank: int, index: int) -> str:
    return os.path.join(rank_dir(checkpoint, rank), f"subgroup{index:05d}.safetensors")


def engine_file(checkpoint: str, rank: int) -> str:
    return os.path.join(rank_dir(checkpoint, rank), "engine.pt")


def meta_dict(units: List[UnitLayout], world_size: int, sub_group_size: int, precision: str) -> dict:
    return {
        "format": FORMAT,
        "world_size": world_size,
        "sub_group_size": sub_group_size,
        "precision": precision,
        "units": [{"module": u.module_name,
                   "params": [{"names": list(s.names), "shape": list(s.shape)} for s in u.slots]}
                  for u in units],
    }


def units_from_meta(meta: dict) -> List[UnitLayout]:
    return [build_unit_layout(i, u["module"], [(tuple(p["names"]), tuple(p["shape"])) for p in u["params"]],
                              meta["world_size"])
            for i, u in enumerate(meta["units"])]


def resolve_tag(save_dir: str, tag: Optional[str]) -> Optional[str]:
    """``tag``, or the one ``latest`` names; None when there is no ``latest``."""
    if tag is not None:
        return str(tag)
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


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

    def __init__(self, checkpoint: str, meta: Optional[dict] = None):
        self.checkpoint = checkpoint
        self.meta = meta or read_meta(checkpoint)
        self.units = units_from_meta(self.meta)
        self.world_size = self.meta["world_size"]
        self._layouts: Dict[int, RankLayout] = {}
        self._files: Dict[Tuple[int, int], SafetensorsReader] = {}

    def rank_layout(self, rank: int) -> RankLayout:
        if rank not in self._layouts:
            self._layouts[rank] = build_rank_layout(self.units, rank, self.meta["sub_group_size"])
        return self._layouts[rank]

    def _file(self, rank: int, index: int) -> SafetensorsReader:
        key = (rank, index)
        if key not in self._files:
            path = sub_group_file(self.checkpoint, rank, index)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint {self.checkpoint} is incomplete: {path} is missing")
            self._files[key] = SafetensorsReader(path, direct=False)
        return self._files[key]

    def read(self, unit_index: int, start: int, stop: int, key: str = "master") -> torch.Tensor:
        """Elements ``[start, stop)`` of unit ``unit_index``'s flat values (zeros past its end)."""
        unit = self.units[unit_index]
        out = torch.zeros(max(0, stop - start), dtype=torch.float32)
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
            part = self._file(rank, sg.index)
            if key not in part.keys():
                raise KeyError(f"checkpoint {self.checkpoint} holds no {key!r} (saved without an optimizer?)")
            part.read_range(key, base + a - lo, base + b - lo, out=out[a - start:b - start])
        return out

    def param_names(self) -> List[str]:
        return [name for u in self.units for s in u.slots for name in s.names]

    def close(self) -> None:
        for shard in self._files.values():
            shard.close()
        self._files.clear()
