"""ZeroStrategy's single-file checkpoints: Lightning's own state with the whole model's weights.

A ZeroStrategy checkpoint is a directory (the engine's checkpoint, Lightning's state as its
``client_state``). One file holding the consolidated weights comes three ways, each loadable by
``LightningModule.load_from_checkpoint`` and, into a ZeroStrategy run, with
``load_full_weights=True``:

- :func:`convert_zero_checkpoint_to_fp32_state_dict` of a directory: the fp32 master weights;
- ``ZeroStrategy(save_full_weights=True)``: ``Trainer.save_checkpoint`` writes the file itself
  (Lightning 1.4's DeepSpeedPlugin option), the parameters gathered unit by unit in the dtype the
  engine computes in; ``exclude_frozen_parameters=True`` leaves out those without
  ``requires_grad``;
- any Lightning checkpoint of the same module (``ddp``, a single device).

[Note: what a single file does not hold]
No optimizer states: a fit resumed from one restarts Adam's moments (the strategy warns, as
DeepSpeedStrategy does) while the loops, callbacks and schedulers continue.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping

import torch
import torch.nn as nn

from nvmeio import FastFileWriter

from ..partitioning.full_state_dict import full_state_dict
from ..partitioning.gathered import GatheredParameters

EXCLUDED = ("state_dict", "optimizer_states")  # what Lightning's dict holds that the engine saves itself


def plain(value):
    """Lightning's checkpoint state with its dict subclasses (AttributeDict, ...) as plain dicts, so that it
    loads with ``weights_only``."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain(v) for v in value)
    return value


def _write_file(state: Dict[str, Any], output_file: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(output_file)) or ".", exist_ok=True)
    with FastFileWriter(output_file) as f:  # appears complete, or not at all
        torch.save(state, f)


def save_full_weights(module: nn.Module, checkpoint: Mapping[str, Any], filepath: str, rank: int,
                      exclude_frozen_parameters: bool) -> None:
    """Lightning's ``checkpoint`` (less what the engine saves) with ``state_dict`` the gathered weights, as one
    file at ``filepath`` written by rank 0. Every rank must call it (the gathers are collective)."""
    state = full_state_dict(module, exclude_frozen_parameters)  # the frozen ones not even gathered
    if rank == 0:
        out = plain({k: v for k, v in checkpoint.items() if k not in EXCLUDED})
        out["state_dict"] = state
        _write_file(out, filepath)


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
    """``module.load_state_dict(state_dict, strict)`` for a module whose parameters an engine partitions:
    each module's own parameters gathered while it loads, then written back into their partitions, master
    weights included (every rank loads the same file; rank 0's values are the ones kept)."""
    missing: List[str] = []
    unexpected: List[str] = []
    errors: List[str] = []
    metadata = getattr(state_dict, "_metadata", None)

    def load(m: nn.Module, prefix: str) -> None:
        local = {} if metadata is None else metadata.get(prefix[:-1], {})
        with GatheredParameters(list(m.parameters(recurse=False)), modifier_rank=0):
            m._load_from_state_dict(state_dict, prefix, local, True, missing, unexpected, errors)
        for name, child in m._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    with torch.no_grad():
        load(module, "")
    if strict and (missing or unexpected):
        errors.insert(0, f"missing keys: {missing}, unexpected keys: {unexpected}")
    if errors:
        raise RuntimeError(f"loading the full weights into {type(module).__name__}: " + "; ".join(errors) +
                           (" (LightningModule.strict_loading = False loads what matches)" if strict else ""))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None) -> dict:
    """A ZeroStrategy checkpoint directory as one Lightning checkpoint file.

    Lightning's own state (epoch, loops, callbacks, hyper-parameters) plus
    ``state_dict``: the consolidated fp32 weights. The file loads with
    ``LightningModule.load_from_checkpoint`` (and into a ZeroStrategy run with
    ``load_full_weights=True``). Returns what it wrote.
    """
    from ..checkpoint.format import checkpoint_path, engine_file, load_state, resolve_tag
    from ..checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

    checkpoint_dir = os.fspath(checkpoint_dir)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    saved = checkpoint_path(checkpoint_dir, resolve_tag(checkpoint_dir, tag))
    client_state = load_state(engine_file(saved, 0)).get("client_state") or {}
    out = dict(client_state, state_dict=state)
    _write_file(out, os.fspath(output_file))
    return out
