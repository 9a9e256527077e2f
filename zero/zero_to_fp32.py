"""Consolidate a ZeRO checkpoint into one fp32 state_dict, one parameter at a time.

    python -m zero.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [-t TAG]

``CHECKPOINT_DIR`` is the directory ``save_checkpoint`` wrote to (holding
``latest``). Each parameter is assembled from the ranks' fp32 master shards,
which are read memory-mapped, so the process holds the output model once and
never a second copy: the optimizer states in the same files are never read.
Shared parameters appear under each of their names (the same tensor), and
the module's buffers are included, as in ``model.state_dict()``.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections import OrderedDict
from typing import Optional

import torch

from nvmeio.atomic_file import replacing

from .checkpoint_format import BUFFERS, ShardReader, checkpoint_path, load_state, resolve_tag


def _checkpoint(checkpoint_dir: str, tag: Optional[str]) -> str:
    checkpoint_dir = os.fspath(checkpoint_dir)
    resolved = resolve_tag(checkpoint_dir, tag)
    if resolved is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file; pass the tag explicitly")
    return checkpoint_path(checkpoint_dir, resolved)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None) -> "OrderedDict":
    """The full fp32 state_dict of the checkpoint ``tag`` (default: ``latest``) under ``checkpoint_dir``."""
    checkpoint = _checkpoint(checkpoint_dir, tag)
    reader = ShardReader(checkpoint)
    state = OrderedDict()
    try:
        for unit in reader.units:
            for slot in unit.slots:
                tensor = reader.read(unit.index, slot.offset, slot.stop).view(slot.shape)
                for name in slot.names:
                    state[name] = tensor
    finally:
        reader.close()
    buffers = os.path.join(checkpoint, BUFFERS)
    if os.path.isfile(buffers):
        state.update(load_state(buffers))
    return state


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    """Load the consolidated fp32 weights into ``model`` (a plain, unpartitioned module); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag: Optional[str] = None) -> None:
    """Write the consolidated fp32 state_dict to ``output_file`` (mode 0600, through an exclusive
    temporary file that replaces it atomically)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    output_file = os.fspath(output_file)
    parent = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(parent, exist_ok=True)
    with replacing(output_file) as tmp:
        with open(tmp.fd, "wb", closefd=False) as f:
            torch.save(state, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero_to_fp32", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="directory save_checkpoint wrote (it holds 'latest')")
    parser.add_argument("output_file", help="where to write the fp32 state_dict (torch.save format)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    args = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag)
    except (FileNotFoundError, ValueError, pickle.UnpicklingError) as error:
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 1
    print(f"saved the fp32 state_dict to {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
