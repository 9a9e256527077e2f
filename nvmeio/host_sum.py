"""Sums of host tensors in a given order: gradient accumulation over micro-batches.

[Note: why the sum is native]
Accumulating k micro-batches' gradients into an fp32 sum is ``dst.add_(g)`` k times.
On the CPU torch pays twice for it in a window of micro-batches (zero/runtime/window.py):
a 16-bit ``g`` is first widened into a new fp32 temporary of its whole size, and the
window's k threads each have an OpenMP team of their own, so libgomp, managing more
threads than there are CPUs, lets every team's workers sleep right after each operation
and wakes them again for the next: a parallel add ran at single-thread speed (on the
2-CPU benchmark machine 119 ms on a micro-batch thread against 72 ms on the main thread
for the same sums). :func:`sum_series` does it in C++ (native/host_sum.cpp) with threads
of its own, widening bf16 on the fly: a bf16 window of k = 16 on the 311M GPT spent
0.65-0.70 s an iteration in its gradient sums instead of 1.25-1.5 s. Every element gets
the same fp32 additions in the same order as the ``add_`` calls, so the sums are
bit-identical; other dtypes or layouts take those calls.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _native

__all__ = ["sum_series"]

_NATIVE = (torch.float32, torch.bfloat16)


def sum_series(dst: torch.Tensor, sources: Sequence[torch.Tensor], first: Optional[torch.Tensor] = None) -> None:
    """``dst.copy_(first)`` when given, then ``dst.add_(s)`` for each of ``sources`` in order."""
    parts = ([first] if first is not None else []) + list(sources)
    for s in parts:
        if s.numel() != dst.numel():
            raise ValueError(f"sum_series: a source of {s.numel()} elements for a sum of {dst.numel()}")
    if not (dst.dtype == torch.float32 and dst.device.type == "cpu" and dst.is_contiguous()
            and all(s.dtype in _NATIVE and s.device.type == "cpu" and s.is_contiguous() for s in parts)):
        if first is not None:
            dst.copy_(first.reshape(dst.shape))
        for s in sources:
            dst.add_(s.reshape(dst.shape))
        return
    if dst.numel() == 0:
        return
    _native.sum_series(dst.data_ptr(), first.data_ptr() if first is not None else 0,
                       first is not None and first.dtype == torch.bfloat16, [s.data_ptr() for s in sources],
                       [s.dtype == torch.bfloat16 for s in sources], dst.numel(), torch.get_num_threads())
