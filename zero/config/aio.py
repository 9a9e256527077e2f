"""``aio``: settings of the nvmeio handle that swaps to NVMe.

Accepted at the top level (DeepSpeed reads it there) and inside
``zero_optimization`` (some DeepSpeed docs put it there). The engine reads
the top-level ``config.aio``, which holds whichever was given.

Defaults are DeepSpeed's ZeRO defaults (queue_depth 8), not the defaults of a
bare ``nvmeio.aio_handle()``: a config written for DeepSpeed behaves the same.
``nvme_tune`` prints a tuned ``"aio"`` block to paste here.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from .base import StrictModel
from .values import Choice, Flag, Int

Backend = Choice("auto", "aio", "io_uring", "psync", what="aio backend")


class AioConfig(StrictModel):
    """Arguments of ``nvmeio.aio_handle`` (``use_gds``: ``gds_handle``)."""

    _renamed: ClassVar[Mapping[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: Int(minimum=1) = 1_048_576
    """Bytes per I/O request."""
    queue_depth: Int(minimum=1) = 8
    """Requests in flight per worker thread."""
    intra_op_parallelism: Int(minimum=1) = 1
    """Worker threads one op is split over (old name: thread_count)."""
    single_submit: Flag = False
    """Submit one request per system call."""
    overlap_events: Flag = True
    """Reap completions while submitting."""
    use_gds: Flag = False
    """GPUDirect Storage (cuFile) instead of host bounce buffers."""
    backend: Backend = "auto"
    """I/O engine: kernel aio, io_uring, psync thread pool, or the best available."""

    def handle_kwargs(self) -> dict:
        """Keyword arguments for ``nvmeio.aio_handle(**kwargs)``."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
            "intra_op_parallelism": self.intra_op_parallelism,
            "backend": self.backend,
        }
