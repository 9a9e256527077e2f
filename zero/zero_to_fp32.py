"""Consolidate a ZeRO checkpoint into one fp32 state dict (DeepSpeed's ``zero_to_fp32.py``)::

    python -m zero.zero_to_fp32 <checkpoint_dir> <output_file> [--tag TAG]

The implementation is :mod:`zero.checkpoint.consolidate`."""

from .checkpoint.consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                                     get_fp32_state_dict_from_zero_checkpoint,
                                     load_state_dict_from_zero_checkpoint, main)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
