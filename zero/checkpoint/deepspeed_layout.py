"""What a DeepSpeed ZeRO checkpoint holds, and where each parameter's elements lie in it.

:func:`read_checkpoint` loads the files deepspeed_files.py found (every file
mapped, nothing read but the pickles) and describes the checkpoint as a
:class:`DeepSpeedCheckpoint`: each parameter's name, shape and *pieces* (which
rank's flat tensor holds which of its elements), the step counters, the LR
schedule, the optimizer's settings and step, the loss scaler, the buffers and
the client state. :meth:`DeepSpeedCheckpoint.read` then gives any element
range of a parameter's fp32 master or optimizer state, whatever the stage and
the world size it was saved with.

[Note: how DeepSpeed partitions a flat group]
The layout facts, from DeepSpeed 0.19.8's ``deepspeed/runtime/zero/stage_1_and_2.py``,
``deepspeed/runtime/zero/stage3.py`` and ``deepspeed/utils/zero_to_fp32.py``:

- Stages 1-2: each optimizer param group is one flat vector of its trainable
  parameters in ``param_shapes`` order (``round_robin_bit16_groups``), each
  followed by its ``param_alignment_paddings`` entry (zeros unless
  ``parameter_alignment``), padded at the end to a multiple of ``2 x
  world_size`` and cut into ``world_size`` consecutive partitions. Rank r's file
  holds its partition without the padding it contains
  (``single_partition_of_fp32_groups[g]``, ``group_paddings[g]`` elements
  shorter than the partition), so partition r starts at the sum of the
  earlier partitions' lengths plus paddings. The optimizer's states are the
  torch optimizer's state of that flat partition, padding included
  (``base_optimizer_state``, a torch ``state_dict``; with
  ``elastic_checkpoint`` a list of per-group states without padding). Frozen
  parameters are not in the groups: their values are in the module's state
  dict (``mp_rank_00_model_states.pt``, in the module's dtype).
- Stage 3: every parameter is partitioned on its own: ``ceil(numel /
  world_size)`` elements per rank, rank r holding elements ``[r * n, (r+1) *
  n)`` (the last rank padded). A rank's partitions of the parameters of one
  sub-group lie end to end in ``fp32_flat_groups[i]``, in the order of
  ``param_shapes[i]`` (one ordered dict per sub-group, in every rank's model
  states file); the optimizer's state of sub-group i is the torch optimizer's
  state of that flat tensor (``optimizer_state_dict``, its params numbered in
  sub-group order). Frozen parameters are ``frozen_param_fragments``, each
  rank's partition of it in its own model states file.
- Tied parameters are saved once, under the first name the module gives them
  (``named_parameters()``); ``shared_params`` maps the other names onto it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .deepspeed_files import DeepSpeedFiles, LossScalerRecord, load_file

GroupKey = Union[int, Tuple[str, str]]  # a flat group's index, or ("frozen", parameter name)

# Keys of a model states file that are DeepSpeed's; the others are the script's client_state
# (DeepSpeed's _load_checkpoint returns the same set).
_DEEPSPEED_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                   "random_ltd")
_HYPER = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of a parameter, at ``src`` in rank ``rank``'s flat ``group``."""

    rank: int
    group: GroupKey
    src: int
    start: int
    numel: int


@dataclass
class DeepSpeedParam:
    name: str
    shape: Tuple[int, ...]
    pieces: List[Piece]
    frozen: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint, described (see the module's docstring)."""

    path: str
    stage: int
    world_size: int
    params: Dict[str, DeepSpeedParam]
    aliases: Dict[str, str]  # shared_params: another name -> the name the values are saved under
    global_steps: int
    global_samples: Optional[int]
    skipped_steps: int
    lr_scheduler: Optional[dict]
    param_groups: List[dict]  # the optimizer's settings per param group (lr, betas, eps, weight_decay)
    adam_step: Optional[int]  # the optimizer's step count (None: the files hold none)
    loss_scaler: Optional[LossScalerRecord]
    buffers: Dict[str, torch.Tensor]
    client_state: dict
    state_keys: Tuple[str, ...]  # the optimizer states every flat group has (exp_avg, exp_avg_sq, ...)
    _flats: Dict[Tuple[int, GroupKey, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def flat(self, rank: int, group: GroupKey, key: str) -> Optional[torch.Tensor]:
        """Rank ``rank``'s flat ``key`` ("master" or a state name) of ``group``; None for a
        frozen parameter's states (zero)."""
        found = self._flats.get((rank, group, key))
        if found is None and not (isinstance(group, tuple) and key != "master"):
            raise KeyError(f"DeepSpeed checkpoint {self.path} holds no {key!r} of rank {rank}'s group {group}")
        return found

    def check(self, name: str, keys: Sequence[str]) -> None:
        """Every piece of parameter ``name`` lies inside its flat tensor for each of ``keys``."""
        for piece in self.params[name].pieces:
            for key in keys:
                t = self.flat(piece.rank, piece.group, key)
                if t is not None and t.numel() < piece.src + piece.numel:
                    raise ValueError(f"DeepSpeed checkpoint {self.path} is inconsistent: {key!r} of rank "
                                     f"{piece.rank}'s group {piece.group} holds {t.numel()} elements, parameter "
                                     f"{name} needs {piece.src + piece.numel}")

    def read(self, name: str, start: int, stop: int, key: str, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of parameter ``name``'s flattened ``key`` into ``out`` (fp32)."""
        for piece in self.params[name].pieces:
            a, b = max(start, piece.start), min(stop, piece.start + piece.numel)
            if a >= b:
                continue
            t = self.flat(piece.rank, piece.group, key)
            target = out[a - start:b - start]
            if t is None:
                target.zero_()
            else:
                target.copy_(t.reshape(-1)[piece.src + a - piece.start:piece.src + b - piece.start])

    def close(self) -> None:
        """Drop the mapped tensors (the files' mappings go with them)."""
        self._flats.clear()
        self.buffers.clear()


# -- reading ---------------------------------------------------------------------------------------

def _require(state, key: str, path: str, types=None):
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"{path} is not a DeepSpeed ZeRO checkpoint file of a supported version: it has no "
                         f"{key!r}")
    value = state[key]
    if types is not None and not isinstance(value, types):
        raise ValueError(f"{path}: {key!r} is {type(value).__name__}, expected "
                         f"{' or '.join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))}")
    return value


def _shape(value, where: str) -> Tuple[int, ...]:
    if isinstance(value, (torch.Size, tuple, list)) and all(isinstance(d, int) and d >= 0 for d in value):
        return tuple(int(d) for d in value)
    raise ValueError(f"{where}: {value!r} is not a tensor shape")


def _torch_state(base, path: str) -> Tuple[Dict, List[dict]]:
    """(state by param id, param groups) of a torch optimizer state_dict."""
    state = _require(base, "state", path, dict)
    groups = _require(base, "param_groups", path, list)
    return state, groups


def _tensors(values: list, what: str, path: str) -> list:
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in values):
        raise ValueError(f"{path}: {what} is not a list of flat tensors")
    return values


def _shape_dicts(shapes: list, path: str) -> list:
    if not all(isinstance(s, dict) for s in shapes):
        raise ValueError(f"{path}: param_shapes is not a list of name -> shape dicts")
    return shapes


def _as_int(value) -> Optional[int]:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return None if value is None else int(value)


class _Reader:
    """Builds a :class:`DeepSpeedCheckpoint` from the loaded files."""

    def __init__(self, files: DeepSpeedFiles, load: Callable[[str], object]):
        self.files = files
        self.load = load
        self.flats: Dict[Tuple[int, GroupKey, str], torch.Tensor] = {}
        self.steps: set = set()
        self.state_keys: Optional[set] = None

    def optimizer_files(self) -> List[dict]:
        out = []
        for path in self.files.optim:
            top = self.load(path)
            out.append(_require(top, "optimizer_state_dict", path, dict))
        return out

    def add_states(self, rank: int, group: int, entry: dict, path: str) -> None:
        keys = {k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() == 1}
        self.state_keys = keys if self.state_keys is None else self.state_keys & keys
        for key in keys:
            self.flats[(rank, group, key)] = entry[key]

    def note_step(self, step, path: str) -> None:
        """The optimizer's step count of one flat group: the same in every group of every file."""
        step = _as_int(step)
        if step is None:
            return
        if self.steps and step not in self.steps:
            raise ValueError(f"DeepSpeed checkpoint {self.files.directory} is inconsistent: {path} holds "
                             f"optimizer step {step}, another group {next(iter(self.steps))}")
        self.steps.add(step)


def _stage12_params(reader: _Reader, osds: List[dict], model: dict, model_path: str) -> Tuple[Dict, List[dict]]:
    files = reader.files
    world = len(osds)
    shapes = _shape_dicts(_require(model, "param_shapes", model_path, list), model_path)
    lean = [_tensors(_require(o, "single_partition_of_fp32_groups", p, list), "single_partition_of_fp32_groups", p)
            for o, p in zip(osds, files.optim)]
    paddings = [_require(o, "group_paddings", p, list) for o, p in zip(osds, files.optim)]
    alignment = osds[0].get("param_alignment_paddings") or [[0] * len(s) for s in shapes]
    if len(alignment) != len(shapes) or any(len(a) != len(s) for a, s in zip(alignment, shapes)):
        raise ValueError(f"{files.optim[0]}: param_alignment_paddings does not match the parameters of "
                         f"{model_path}'s param_shapes")
    param_groups: List[dict] = []
    for rank, (osd, path) in enumerate(zip(osds, files.optim)):
        if len(lean[rank]) != len(shapes) or len(paddings[rank]) != len(shapes):
            raise ValueError(f"{path} holds {len(lean[rank])} flat groups, {model_path} describes {len(shapes)}")
        base = _require(osd, "base_optimizer_state", path, (dict, list))
        elastic = isinstance(base, list)
        if not elastic:
            state, groups = _torch_state(base, path)
            param_groups = param_groups or groups
        for g in range(len(shapes)):
            reader.flats[(rank, g, "master")] = lean[rank][g]
            if elastic:
                entry = base[g] if isinstance(base[g], dict) else {}
                step = entry.get("step", osd.get("base_optimizer_state_step"))
            else:
                group = groups[g] if g < len(groups) else {}
                ids = group.get("params") or []
                entry = state.get(ids[0], {}) if ids else {}
                step = entry.get("step", group.get("step"))
            reader.add_states(rank, g, entry, path)
            reader.note_step(step, path)
    params: Dict[str, DeepSpeedParam] = {}
    for g, group_shapes in enumerate(shapes):
        sizes = [lean[r][g].numel() + int(paddings[r][g]) for r in range(world)]
        starts = [sum(sizes[:r]) for r in range(world)]
        offset = 0
        for (name, shape), pad in zip(group_shapes.items(), alignment[g]):
            shape = _shape(shape, f"{model_path} param_shapes[{g}][{name!r}]")
            numel = math.prod(shape)
            pieces = []
            for r in range(world):
                a, b = max(offset, starts[r]), min(offset + numel, starts[r] + sizes[r])
                if a < b:
                    if b - starts[r] > lean[r][g].numel():
                        raise ValueError(f"DeepSpeed checkpoint {files.directory} is inconsistent: parameter "
                                         f"{name} reaches past rank {r}'s partition of group {g}")
                    pieces.append(Piece(r, g, a - starts[r], a - offset, b - a))
            if sum(p.numel for p in pieces) != numel:
                raise ValueError(f"DeepSpeed checkpoint {files.directory} is inconsistent: group {g} holds only "
                                 f"part of parameter {name}")
            params[name] = DeepSpeedParam(name, shape, pieces)
            offset += numel + int(pad)
    # Frozen parameters: whatever else of the module's state dict is a parameter, values as saved.
    module = _require(model, "module", model_path, dict)
    skip = set(model.get("buffer_names") or []) | set((model.get("shared_params") or {}).keys())
    for name, value in module.items():
        if name in params or name in skip or not isinstance(value, torch.Tensor):
            continue
        reader.flats[(0, ("frozen", name), "master")] = value
        params[name] = DeepSpeedParam(name, tuple(value.shape), [Piece(0, ("frozen", name), 0, 0, value.numel())],
                                      frozen=True)
    return params, param_groups


def _stage3_params(reader: _Reader, osds: List[dict], models: List[dict]) -> Tuple[Dict, List[dict]]:
    files = reader.files
    world = len(osds)
    model, model_path = models[0], files.zero3_model[0]
    shapes = _shape_dicts(_require(model, "param_shapes", model_path, list), model_path)
    param_groups: List[dict] = []
    for rank, (osd, path) in enumerate(zip(osds, files.optim)):
        flats = _tensors(_require(osd, "fp32_flat_groups", path, list), "fp32_flat_groups", path)
        if len(flats) != len(shapes):
            raise ValueError(f"{path} holds {len(flats)} flat groups, {model_path} describes {len(shapes)} "
                             f"sub-groups")
        state, groups = _torch_state(_require(osd, "optimizer_state_dict", path, dict), path)
        param_groups = param_groups or groups
        ordered = [(pid, g) for g, group in enumerate(groups) for pid in group.get("params", [])]
        if len(ordered) != len(flats):
            raise ValueError(f"{path}: the optimizer's state numbers {len(ordered)} tensors, the file holds "
                             f"{len(flats)} flat groups")
        for i, flat in enumerate(flats):
            reader.flats[(rank, i, "master")] = flat
            pid, g = ordered[i]
            entry = state.get(pid, {})
            reader.add_states(rank, i, entry, path)
            reader.note_step(entry.get("step", groups[g].get("step")), path)
    params: Dict[str, DeepSpeedParam] = {}
    for i, group_shapes in enumerate(shapes):
        offset = 0
        for name, shape in group_shapes.items():
            shape = _shape(shape, f"{model_path} param_shapes[{i}][{name!r}]")
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            pieces = [Piece(r, i, offset, r * per_rank, min(per_rank, numel - r * per_rank))
                      for r in range(world) if r * per_rank < numel]
            params[name] = DeepSpeedParam(name, shape, pieces)
            offset += per_rank
        for rank in range(world):
            have = reader.flats[(rank, i, "master")].numel()
            if have != offset:
                raise ValueError(f"DeepSpeed checkpoint {files.directory} is inconsistent: rank {rank}'s flat "
                                 f"group {i} holds {have} elements, its parameters' partitions {offset}")
    frozen = model.get("frozen_param_shapes") or {}
    if not isinstance(frozen, dict):
        raise ValueError(f"{model_path}: frozen_param_shapes is not a name -> shape dict")
    for name, shape in frozen.items():
        shape = _shape(shape, f"{model_path} frozen_param_shapes[{name!r}]")
        numel = math.prod(shape)
        per_rank = -(-numel // world)
        pieces = []
        for rank, (state, path) in enumerate(zip(models, files.zero3_model)):
            fragments = _require(state, "frozen_param_fragments", path, dict)
            if name not in fragments or not isinstance(fragments[name], torch.Tensor):
                raise ValueError(f"{path} holds no fragment of the frozen parameter {name}")
            reader.flats[(rank, ("frozen", name), "master")] = fragments[name]
            if rank * per_rank < numel:
                pieces.append(Piece(rank, ("frozen", name), 0, rank * per_rank, min(per_rank, numel - rank * per_rank)))
        params[name] = DeepSpeedParam(name, shape, pieces, frozen=True)
    return params, param_groups


def _stage_of(osd: dict, path: str) -> int:
    stage = _require(osd, "zero_stage", path)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise ValueError(f"{path}: zero_stage {stage!r} is not a ZeRO stage 1-3")
    return int(stage)


def _world_size(osds: List[dict], files: DeepSpeedFiles) -> int:
    count = _require(osds[0], "partition_count", files.optim[0])
    counts = count if isinstance(count, list) else [count]
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) for c in counts) or len(set(counts)) != 1:
        raise ValueError(f"{files.optim[0]}: partition_count {count!r} is not one data-parallel world size "
                         f"(expert groups are not supported)")
    if counts[0] != len(files.optim):
        raise ValueError(f"DeepSpeed checkpoint {files.directory} was saved by {counts[0]} ranks but holds "
                         f"{len(files.optim)} optimizer files (an overwritten or incomplete checkpoint?)")
    return counts[0]


def read_checkpoint(files: DeepSpeedFiles, load: Callable[[str], object] = load_file) -> DeepSpeedCheckpoint:
    """Describe the checkpoint in ``files`` (:class:`DeepSpeedCheckpoint`); every inconsistency
    between its files is a ValueError naming them."""
    reader = _Reader(files, load)
    osds = reader.optimizer_files()
    stage = _stage_of(osds[0], files.optim[0])
    for osd, path in zip(osds[1:], files.optim[1:]):
        if _stage_of(osd, path) != stage:
            raise ValueError(f"DeepSpeed checkpoint {files.directory} mixes ZeRO stages: {path} is stage "
                             f"{_stage_of(osd, path)}, {files.optim[0]} stage {stage}")
    world = _world_size(osds, files)
    if stage == 3:
        if len(files.zero3_model) != world:
            raise FileNotFoundError(f"DeepSpeed checkpoint {files.directory} (stage 3, {world} ranks) holds "
                                    f"{len(files.zero3_model)} zero_pp_rank_*_mp_rank_00_model_states.pt files")
        models = [load(p) for p in files.zero3_model]
        model, model_path = models[0], files.zero3_model[0]
        params, param_groups = _stage3_params(reader, osds, models)
    else:
        if files.model is None:
            raise FileNotFoundError(f"DeepSpeed checkpoint {files.directory} is incomplete: "
                                    f"mp_rank_00_model_states.pt is missing")
        model, model_path = load(files.model), files.model
        params, param_groups = _stage12_params(reader, osds, model, model_path)
    if not isinstance(model, dict):
        raise ValueError(f"{model_path} is not a DeepSpeed model states file")
    module = _require(model, "module", model_path, dict)
    buffer_names = model.get("buffer_names") or []
    buffers = {n: module[n] for n in buffer_names if isinstance(module.get(n), torch.Tensor)}
    aliases = {k: v for k, v in (model.get("shared_params") or {}).items() if isinstance(k, str)}
    global_steps = _require(model, "global_steps", model_path, int)
    samples = model.get("global_samples")
    scheduler = model.get("lr_scheduler")
    scaler = osds[0].get("loss_scaler")
    hyper = [{k: g[k] for k in _HYPER if k in g} for g in param_groups]
    client = {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS + ("lr_scheduler", "optimizer")}
    steps = reader.steps
    return DeepSpeedCheckpoint(
        path=files.directory, stage=stage, world_size=world, params=params, aliases=aliases,
        global_steps=global_steps, global_samples=samples if isinstance(samples, int) else None,
        skipped_steps=int(model.get("skipped_steps") or 0),
        lr_scheduler=scheduler if isinstance(scheduler, dict) else None, param_groups=hyper,
        adam_step=steps.pop() if steps else None,
        loss_scaler=scaler if isinstance(scaler, LossScalerRecord) else None, buffers=buffers,
        client_state=client, state_keys=tuple(sorted(reader.state_keys or ())), _flats=reader.flats)
