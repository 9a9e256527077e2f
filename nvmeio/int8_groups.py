"""int8 codes with one fp32 scale per group of elements, back to fp32 or bf16 on the host.

``dequantize_int8`` is the native pass of native/dequantize.cpp: one IEEE multiply per element
and, for bf16, one rounding to nearest even, bit-identical to torch's
``codes.to(float32).view(-1, group).mul_(scales[:, None]).to(bfloat16)``, vectorised where torch's
int8-to-float conversion is a scalar loop (zero/stores/quantized.py, [Note: dequantizing on the host]).
"""
from __future__ import annotations

import torch

from . import _native

__all__ = ["dequantize_int8", "NATIVE_DTYPES"]

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """A new host tensor of ``codes.numel()`` elements of ``dtype`` (fp32 or bf16): element i is
    ``codes[i] * scales[i // group_size]``. ``codes``: int8 on the CPU; ``scales``: fp32, one per group."""
    n = codes.numel()
    groups = -(-n // group_size) if group_size > 0 else 0
    if group_size <= 0 or codes.dtype != torch.int8 or codes.device.type != "cpu" or dtype not in NATIVE_DTYPES \
            or scales.numel() < groups:
        raise ValueError(f"dequantize: int8 codes on the CPU and {groups} fp32 scales for {n} elements in groups of "
                         f"{group_size}, into fp32 or bf16; got {codes.dtype} codes on {codes.device}, "
                         f"{scales.numel()} scales, {dtype}")
    codes = codes.contiguous()  # the names keep both alive through the native call
    scales = scales.to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(n, dtype=dtype)
    if n:
        _native.dequantize_int8(out.data_ptr(), dtype == torch.bfloat16, codes.data_ptr(), scales.data_ptr(), n,
                                group_size, torch.get_num_threads())
    return out
