"""``zero_demo``: ZeRO-3 training of a byte-level GPT on the standard library's own source,
parameters and optimizer states on NVMe, checked against plain PyTorch."""

from .run import main

__all__ = ["main"]
