"""Consolidate a ZeRO checkpoint into one fp32 state_dict, one parameter at a time.

    python -m zero.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [-t TAG] [--safe_serialization]

``CHECKPOINT_DIR`` is the directory ``save_checkpoint`` wrote to (holding
``latest``). Each parameter is assembled from the ranks' fp32 master shards
(only its bytes are read: the optimizer states in the same files never are).
Frozen parameters an engine stored int8 (``zero_quantized_nontrainable_weights``)
come out as their dequantized values, the ones the model computed with; a
warning names how many. ``--exclude_frozen_parameters`` leaves out every
parameter saved with ``requires_grad=False``; a checkpoint saved with
``exclude_frozen_parameters=True`` holds none of its frozen units, and a warning
names those missing from the output (save.py [Note: checkpoints without the
frozen units]).
``--safe_serialization`` writes a safetensors file streaming, one parameter
at a time, so the model is never whole in memory; the torch.save format
(default) needs the whole state_dict, held once. Either way the file is
written through nvmeio's FastFileWriter (atomic, 0600). An existing directory
as OUTPUT_FILE receives ``model.safetensors`` or ``pytorch_model.bin``.
Shared parameters appear under each of their names (the same tensor in the
torch.save format, a copy each in safetensors, which has no aliases), and
the module's buffers are included, as in ``model.state_dict()``.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
from collections import OrderedDict
from typing import Iterator, Optional, Tuple

import torch

from nvmeio import FastFileWriter, SafetensorsWriter

from .format import (BUFFERS, ShardReader, checkpoint_path, frozen_param_names, load_state, quantized_param_names,
                     resolve_tag, shown_names)


def _warn(reader: ShardReader, exclude_frozen: bool) -> None:
    """What the state dict holds that the model was not built with, or lacks."""
    log = logging.getLogger("zero")
    if not exclude_frozen:
        names = quantized_param_names(reader.meta)
        if names:
            log.warning("%s: %d frozen parameter(s) were stored int8 (zero_quantized_nontrainable_weights): %s; "
                        "the state dict holds their dequantized values, not the weights the model was built with",
                        reader.checkpoint, len(names), shown_names(names, 3))
        missing = [s.name for i in sorted(reader.excluded) for s in reader.units[i].slots]
        if missing:
            log.warning("%s was saved with exclude_frozen_parameters=True: the state dict lacks %d frozen "
                        "parameter(s) (%s); they are the model's own (its pretrained weights, for a LoRA base)",
                        reader.checkpoint, len(missing), shown_names(missing, 3))


def _kept(reader: ShardReader, exclude_frozen: bool) -> Iterator[Tuple[object, object, list]]:
    """``(unit, slot, names)`` of each parameter the state dict gets: those the checkpoint holds,
    less the frozen ones with ``exclude_frozen``."""
    frozen = frozen_param_names(reader.meta) if exclude_frozen else frozenset()
    for unit in reader.units:
        if unit.index in reader.excluded:
            continue
        for slot in unit.slots:
            names = [n for n in slot.names if n not in frozen]
            if names:
                yield unit, slot, names


def _checkpoint(checkpoint_dir: str, tag: Optional[str]) -> str:
    checkpoint_dir = os.fspath(checkpoint_dir)
    resolved = resolve_tag(checkpoint_dir, tag)
    if resolved is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file; pass the tag explicitly")
    return checkpoint_path(checkpoint_dir, resolved)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False) -> "OrderedDict":
    """The full fp32 state_dict of the checkpoint ``tag`` (default: ``latest``) under ``checkpoint_dir``;
    ``exclude_frozen_parameters``: without the parameters saved with ``requires_grad=False``."""
    checkpoint = _checkpoint(checkpoint_dir, tag)
    reader = ShardReader(checkpoint)
    _warn(reader, exclude_frozen_parameters)
    state = OrderedDict()
    try:
        for unit, slot, names in _kept(reader, exclude_frozen_parameters):
            tensor = reader.read(unit.index, slot.offset, slot.stop).view(slot.shape)
            for name in names:
                state[name] = tensor
    finally:
        reader.close()
    state.update(_buffers(checkpoint))
    return state


def _buffers(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, BUFFERS)
    return load_state(path) if os.path.isfile(path) else {}


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    """Load the consolidated fp32 weights into ``model`` (a plain, unpartitioned module); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag: Optional[str] = None,
                                               safe_serialization: bool = False,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the consolidated fp32 state_dict to ``output_file`` (mode 0600, atomically: an
    exclusive temporary file renamed over it); returns its path.

    ``safe_serialization``: a safetensors file, written one parameter at a time.
    ``exclude_frozen_parameters``: without the parameters saved with ``requires_grad=False``.
    """
    output_file = os.fspath(output_file)
    if os.path.isdir(output_file):
        output_file = os.path.join(output_file, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    if not safe_serialization:
        state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
        with FastFileWriter(output_file) as f:
            torch.save(state, f)
        return output_file
    checkpoint = _checkpoint(checkpoint_dir, tag)
    reader = ShardReader(checkpoint)
    _warn(reader, exclude_frozen_parameters)
    try:
        buffers = _buffers(checkpoint)
        spec = {name: (torch.float32, tuple(slot.shape))
                for _, slot, names in _kept(reader, exclude_frozen_parameters) for name in names}
        buffer_names = [name for name in buffers if name not in spec]
        spec.update({name: (buffers[name].dtype, tuple(buffers[name].shape)) for name in buffer_names})
        with SafetensorsWriter(output_file, spec, {"format": "pt"}) as w:
            for unit, slot, names in _kept(reader, exclude_frozen_parameters):
                tensor = reader.read(unit.index, slot.offset, slot.stop).view(slot.shape)
                for name in names:
                    w.write(name, tensor)
                del tensor
            for name in buffer_names:
                w.write(name, buffers[name])
    finally:
        reader.close()
    return output_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero_to_fp32", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="directory save_checkpoint wrote (it holds 'latest')")
    parser.add_argument("output_file", help="where to write the fp32 state_dict (torch.save format, or "
                        "safetensors with --safe_serialization; a directory gets pytorch_model.bin / "
                        "model.safetensors)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors, one parameter at a time (the model is never whole in memory)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters saved with requires_grad=False (a LoRA base)")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag,
                                                          safe_serialization=args.safe_serialization,
                                                          exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (FileNotFoundError, ValueError, pickle.UnpicklingError) as error:
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 1
    print(f"saved the fp32 state_dict to {path}")
    return 0


