"""``zero_optimization.offload_param`` and ``zero_optimization.offload_optimizer``.

Where parameters and optimizer states live between uses: ``none`` (on the
accelerator), ``cpu`` (host memory) or ``nvme`` (files under ``nvme_path``).

[Note: nvme_path is checked, never created]
The config layer checks that ``nvme_path`` is an existing, writable directory,
and does not create it. Loading a config should have no side effect on the
filesystem (configs are loaded on login nodes, by tests, by the estimator),
and a missing directory is far more often a typo or an unmounted drive than a
directory the user wants created on the root filesystem. The swapper creates
its own ``<nvme_path>/<job>/rank<r>/`` below the checked directory.

[Note: checksum default]
``checksum`` defaults to "auto": on with xxhash, else crc32c, when that
package is installed (``nvmeio[checksum]``); a swap file damaged between
steps would otherwise be trained on silently (NaN or diverging losses) and
stored by the next checkpoint. The cost is one digest of every byte swapped
in or out, measured by bench/checksum_cost.py (bench/RESULTS.md, "Swap-file
checksums"): xxhash and crc32c cost a few percent of a step, the standard
library's crc32 several times more. So "auto" never picks crc32: without a fast package it turns checksums off
and says so once (set "crc32" to pay for it anyway); "none" gives the few
percent back to users who trust their storage. With checksums on, a checkpoint reads optimizer state through the
verifying swapper instead of copying swap files in the kernel. Where ``aio.use_gds`` puts the parameter
swapper's buffers in GPU memory (zero/stores/param_store.py ``gds_pool``), their bytes never reach the host to be
hashed: "auto" is off there and a named algorithm is refused (``gds_checksum``).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Optional

from pydantic import model_validator

from .base import StrictModel, raise_problems
from .values import Choice, Flag, Int, PathTexts, Real

Device = Choice("none", "cpu", "nvme", what="device")
Checksum = Choice("auto", "none", "xxhash", "crc32c", "crc32", what="checksum")

# fp32 master weights, exp_avg and exp_avg_sq of one sub-group, plus one buffer
# so that the next swap overlaps the current step.
MIN_NVME_OPTIMIZER_BUFFERS = 4


def nvme_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold swap files, or None if it can."""
    if not os.path.exists(path):
        return (f"'{path}' does not exist; create it on the NVMe drive (mkdir -p {path}) "
                f"or point nvme_path at an existing directory")
    if not os.path.isdir(path):
        return f"'{path}' is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"'{path}' is not writable by this user (uid {os.getuid()})"
    return None


class OffloadBase(StrictModel):
    """What both offload sections share: the device and its directory."""

    device: Device = "none"
    nvme_path: Optional[PathTexts] = None
    """Directory of the swap files (device nvme), or a list of directories, one per drive: swap
    files are then striped over them (nvmeio/striping.py [Note: striping]), no RAID needed."""
    pin_memory: Flag = False
    checksum: Checksum = "auto"
    """Digest of every swap file region, kept in memory and checked on each swap-in (device nvme):
    a file changed behind the engine's back (zeroed, random bytes, NaNs) raises an error naming
    the file and the unit instead of training on it. "auto": xxhash when installed, else
    crc32c, else off (with a warning); "none" turns it off (see [Note: checksum default])."""

    _name: ClassVar[str] = ""

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded (device is cpu or nvme)."""
        return self.device != "none"

    def _nvme_problems(self) -> list[tuple[tuple[str, ...], str, Any]]:
        if self.device != "nvme":
            return []
        if self.nvme_path is None:
            return [(("nvme_path",), f"device is 'nvme' but nvme_path is not set; set "
                     f"zero_optimization.{self._name}.nvme_path to a directory on the NVMe drive",
                     None)]
        paths = self.nvme_path if isinstance(self.nvme_path, list) else [self.nvme_path]
        problems = [(("nvme_path",), why, path) for path in paths if (why := nvme_path_problem(path))]
        real = [os.path.realpath(p) for p in paths]
        same = [f"'{p}' and '{q}'" for i, p in enumerate(paths) for j, q in enumerate(paths[:i]) if real[i] == real[j]]
        if not problems and same:
            problems.append((("nvme_path",), f"{same[0]} are the same directory; give each drive once",
                             self.nvme_path))
        return problems


class OffloadParamConfig(OffloadBase):
    """``offload_param``: where partitioned parameters live (stage 3 only)."""

    _name: ClassVar[str] = "offload_param"

    buffer_count: Int(minimum=1) = 5
    """Pinned staging buffers for swapping parameters in and out of NVMe."""
    buffer_size: Int(minimum=1) = 100_000_000
    """Elements per staging buffer; each parameter partition must fit one."""
    max_in_cpu: Int(minimum=0) = 1_000_000_000
    """Elements of parameters allowed to stay in host memory with device nvme."""
    min_swap_bytes: Optional[Int(minimum=0)] = None
    """nvmeio's own (device nvme): a parameter partition smaller than this many bytes stays in
    host memory, never on NVMe, beside ``max_in_cpu``'s; unset, DeepSpeed's rule, whose swapper
    leaves a partition under max(1 MiB, ``aio.block_size``) in host memory (see
    :func:`min_swap_bytes`); 0 puts every partition past ``max_in_cpu`` on NVMe."""

    @model_validator(mode="after")
    def _check(self) -> "OffloadParamConfig":
        raise_problems(type(self).__name__, self._nvme_problems())
        return self


MIN_SWAP_BYTES = 1 << 20  # DeepSpeed's MIN_AIO_BYTES


def min_swap_bytes(offload_param: OffloadParamConfig, block_size: int) -> int:
    """The size under which a parameter partition stays in host memory (``min_swap_bytes``, else
    DeepSpeed's rule: an NVMe op per partition costs the same whatever its size, so one of a
    layer norm or a LoRA adapter would cost as much as a weight matrix's, for a few kilobytes)."""
    if offload_param.min_swap_bytes is not None:
        return offload_param.min_swap_bytes
    return max(MIN_SWAP_BYTES, block_size)


class OffloadOptimizerConfig(OffloadBase):
    """``offload_optimizer``: where fp32 master weights and Adam states live.

    ``pipeline: true`` turns on both ``pipeline_read`` and ``pipeline_write``
    unless they are given; after loading, ``pipeline`` is ``pipeline_read or
    pipeline_write`` (as in DeepSpeed).
    """

    _name: ClassVar[str] = "offload_optimizer"
    # buffer_count: the NVMe swapper sizes its own pool (one buffer per sub-group in flight).
    _inert: ClassVar[frozenset[str]] = frozenset({"fast_init", "buffer_count"})

    buffer_count: Int(minimum=1) = 4
    fast_init: Flag = False
    pipeline_read: Flag = False
    pipeline_write: Flag = False
    pipeline: Flag = False
    step_in_backward: Flag = True
    """nvmeio's own (device nvme): step each sub-group during backward as soon as its gradient
    is complete, when the step needs no global gradient norm first (no gradient_clipping, no
    dynamic fp16 loss scale); false writes gradients to NVMe and steps after backward."""
    ratio: Real(minimum=0.0, maximum=1.0, exclusive_minimum=True) = 1.0
    """Fraction of the optimizer step offloaded (DeepSpeed's partial offload)."""

    @model_validator(mode="after")
    def _check(self) -> "OffloadOptimizerConfig":
        problems = self._nvme_problems()
        given = self.model_fields_set
        if "pipeline" in given:
            explicit = {k: self.raw(k) for k in ("pipeline_read", "pipeline_write") if k in given}
            turned_on = [k for k, on in explicit.items() if on]
            if self.pipeline and len(explicit) == 2 and not turned_on:
                problems.append((("pipeline",), "pipeline is true but pipeline_read and "
                                 "pipeline_write are both false; drop pipeline or set one of them", True))
            elif not self.pipeline and turned_on:
                problems.append((("pipeline",), (
                    f"pipeline is false but {' and '.join(turned_on)} "
                    f"{'are' if len(turned_on) > 1 else 'is'} true; drop pipeline"), False))
            if self.pipeline:
                for key in ("pipeline_read", "pipeline_write"):
                    if key not in explicit:
                        self.__dict__[key] = True
        self.__dict__["pipeline"] = self.pipeline_read or self.pipeline_write
        if self.raw("ratio") != 1.0:
            problems.append((("ratio",), (
                f"ratio = {self.raw('ratio')}: partial optimizer offload (part of the optimizer step on "
                f"the compute device) is not implemented in nvmeio; drop ratio to offload the whole "
                f"optimizer, or set offload_optimizer.device to 'none' to keep it all on the device"),
                self.raw("ratio")))
        if self.device == "nvme" and self.buffer_count < MIN_NVME_OPTIMIZER_BUFFERS:
            problems.append((("buffer_count",), (
                f"buffer_count = {self.buffer_count} is too small for device 'nvme': the NVMe "
                f"optimizer swapper needs at least {MIN_NVME_OPTIMIZER_BUFFERS} buffers (one each for "
                f"the fp32 master weights, exp_avg and exp_avg_sq of a sub-group, plus one so the "
                f"next swap overlaps the step); set zero_optimization.offload_optimizer.buffer_count "
                f"to {MIN_NVME_OPTIMIZER_BUFFERS} or more"), self.buffer_count))
        raise_problems(type(self).__name__, problems)
        return self
