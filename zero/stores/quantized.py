"""Frozen weights stored quantized: int8 with one fp32 scale per group (``zero_quantized_nontrainable_weights``).

[Note: frozen weights stored quantized]
With ``zero_optimization.zero_quantized_nontrainable_weights`` at stage 3, the
shard of every unit whose parameters all have ``requires_grad=False`` (a LoRA
base, a frozen encoder; every unit of an engine without an optimizer, as
ZeRO-Inference's) is stored as int8 codes and fp32 scales, in host memory
(``offload_param`` none / cpu) and in its NVMe swap file, and dequantized into
the compute dtype when it is fetched: ~1 byte per element instead of 2 (bf16)
or 4 (fp32), plus 4 bytes of scale per :data:`GROUP_SIZE` elements.

- Groups are runs of :data:`GROUP_SIZE` elements along a rank's flattened
  shard of the unit (the last one shorter); each is quantized symmetrically:
  ``scale = max|x| / 127`` (fp32), ``q = round(x / scale)`` in [-127, 127],
  and dequantized as ``(q * scale)`` in fp32, then cast to the compute dtype.
  Each dequantized value is within ``scale / 2`` of the original (fp32
  rounding aside).
- The codec is idempotent: quantizing the dequantized values gives the same
  codes and scales bit for bit. The scale is taken to a fixed point of
  ``s -> (127 s) / 127`` (in fp32), so the group's largest dequantized value,
  ``127 s``, gives ``s`` back. The dequantized values are therefore what a
  frozen unit holds (what checkpoints save as its master, ``zero_to_fp32`` and
  ``GatheredParameters`` see, the values the model computes with; it has no
  optimizer master: layouts.py), and every write of them into the store (a
  checkpoint load, a gather's write-back) stores the same int8 bytes again: a checkpoint loads back
  exactly at the same world size; at another the groups fall elsewhere and the
  dequantized values are quantized once more.
- Trainable units are stored as without the flag, bit for bit.

Packed layout of one shard, as bytes: the fp32 scales, then the int8 codes.

[Note: dequantizing on the host]
Every fetch of a frozen unit dequantizes its shard, on the compute device. On
the CPU torch's int8-to-fp32 conversion is a scalar loop: about 3 ns an
element on the 2-CPU benchmark machine, 2.5 s an iteration for the 311M LoRA
stand-in, more than the reads the int8 bytes save. :func:`dequantize` does it
in one vectorised native pass there (native/dequantize.cpp, the fp32 multiply
and the bf16 rounding torch does, bit for bit; on torch's thread count),
torch's ops elsewhere (CUDA, fp16 outputs).
"""
from __future__ import annotations

from typing import AbstractSet, Callable, FrozenSet, Optional

import torch

from nvmeio.int8_groups import NATIVE_DTYPES, dequantize_int8

from .layouts import UnitLayout

GROUP_SIZE = 256
"""Elements per quantization group (one fp32 scale each): 1.6% of the int8 bytes."""
QMAX = 127


def group_count(numel: int, group_size: int = GROUP_SIZE) -> int:
    return -(-numel // group_size)


def packed_nbytes(numel: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes of a packed shard of ``numel`` elements: fp32 scales, then int8 codes."""
    return 4 * group_count(numel, group_size) + numel


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` (flat) as rows of ``group_size``, the last padded with zeros (a copy only then)."""
    groups = group_count(x.numel(), group_size)
    if groups * group_size != x.numel():
        x = torch.nn.functional.pad(x, (0, groups * group_size - x.numel()))
    return x.view(groups, group_size)


def quantize(values: torch.Tensor, group_size: int = GROUP_SIZE):
    """``(codes, scales)``: int8 codes of ``values`` (flattened, any float dtype) and one fp32 scale
    per group of ``group_size`` elements. Raises ValueError on a non-finite value."""
    x = values.detach().reshape(-1)
    n = x.numel()
    rows = _groups(x if x.dtype == torch.float32 else x.to(torch.float32), group_size)
    scales = rows.abs().amax(dim=1)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("a non-finite value (inf or nan) cannot be stored quantized")
    scales.div_(QMAX)
    for _ in range(2):  # to the fixed point of s -> (127 s) / 127 (see the note): one step in practice
        scales = (scales * QMAX) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.div(rows, safe[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The values ``codes`` and ``scales`` stand for, in ``dtype``: ``codes * scale`` computed in
    fp32, then rounded once to ``dtype``."""
    n = codes.numel()
    if codes.device.type == "cpu" and dtype in NATIVE_DTYPES:
        return dequantize_int8(codes, scales, group_size, dtype)
    whole = n // group_size * group_size
    values = codes.to(torch.float32)
    if whole:
        values[:whole].view(-1, group_size).mul_(scales[:whole // group_size, None])
    if n > whole:
        values[whole:].mul_(scales[-1])
    return values if dtype == torch.float32 else values.to(dtype)


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 tensor: the scales' bytes, then the codes'."""
    return torch.cat([scales.contiguous().view(torch.uint8), codes.contiguous().view(torch.uint8)])


def unpack(packed: torch.Tensor, numel: int, group_size: int = GROUP_SIZE):
    """``(codes, scales)`` viewing ``packed`` (uint8, as :func:`pack` made it)."""
    head = 4 * group_count(numel, group_size)
    if packed.numel() != head + numel:
        raise ValueError(f"a packed shard of {numel} elements has {head + numel} bytes, got {packed.numel()}")
    return packed[head:].view(torch.int8), packed[:head].view(torch.float32)


class FrozenShards:
    """Which units' shards a parameter store keeps quantized, and the codec for them. The null
    object (:data:`NOT_QUANTIZED`) quantizes none, so stores ask it unconditionally."""

    def __init__(self, units: AbstractSet[int] = frozenset(), group_size: int = GROUP_SIZE,
                 to_device: Optional[Callable[[torch.Tensor, torch.device], torch.Tensor]] = None):
        self.units: FrozenSet[int] = frozenset(units)
        self.group_size = group_size
        # How packed bytes reach the compute device: ``to_device(packed, device)`` returns once
        # ``packed`` may be reused. On CUDA the engine's copy on its copy stream, which waits for that
        # copy alone (zero/runtime/host_to_device.py); a plain ``.to`` waits for every kernel queued before it.
        self.to_device = to_device or (lambda packed, device: packed.to(device))

    def __bool__(self) -> bool:
        return bool(self.units)

    def packs(self, layout: UnitLayout) -> bool:
        return layout.index in self.units and layout.shard_numel > 0

    def nbytes(self, layout: UnitLayout) -> int:
        return packed_nbytes(layout.shard_numel, self.group_size)

    def encode(self, layout: UnitLayout, values: torch.Tensor) -> torch.Tensor:
        """The packed bytes of one shard's ``values`` (on their device)."""
        try:
            return pack(*quantize(values, self.group_size))
        except ValueError as error:
            raise ValueError(f"unit '{layout.module_name or '<root>'}' (zero_quantized_nontrainable_weights): "
                             f"{error}") from None

    def decode(self, layout: UnitLayout, packed: torch.Tensor, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The shard in ``dtype`` on ``device`` (the packed bytes are moved first: 1/4 of fp32's).
        The move waits for its copy: ``packed`` may be a swap pool's buffer, registered with CUDA,
        which goes back to the pool as soon as this returns."""
        host_to_device = packed.device.type == "cpu" and device.type != "cpu"
        moved = self.to_device(packed, device) if host_to_device else packed.to(device)
        codes, scales = unpack(moved, layout.shard_numel, self.group_size)
        return dequantize(codes, scales, dtype, self.group_size)

    def as_stored(self, layout: UnitLayout, values: torch.Tensor) -> torch.Tensor:
        """The fp32 values a store gives back for ``values`` (dequantized for a packed unit, else
        ``values`` themselves): what the fp32 master of the unit holds (see the note)."""
        if not self.packs(layout):
            return values
        codes, scales = unpack(self.encode(layout, values), layout.shard_numel, self.group_size)
        return dequantize(codes, scales, torch.float32, self.group_size)


NOT_QUANTIZED = FrozenShards()
