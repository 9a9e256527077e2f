"""``aio``: settings of the nvmeio handle that swaps to NVMe.

Accepted at the top level (DeepSpeed reads it there) and inside
``zero_optimization`` (some DeepSpeed docs put it there). The engine reads
the top-level ``config.aio``, which holds whichever was given.

This section only parses the DeepSpeed spelling (``"false"`` strings,
``thread_count``); what it holds is an :class:`nvmeio.AioSettings`
(:meth:`AioConfig.settings`), and its defaults are
:data:`nvmeio.settings.ZERO_CONFIG_DEFAULTS`: DeepSpeed's ZeRO defaults
(queue_depth 8, overlap_events true), not those of a bare
``nvmeio.aio_handle()``, so a config written for DeepSpeed behaves the same
(see [Note: two sets of defaults] there). ``nvme_tune`` prints a tuned
``"aio"`` block to paste here. ``use_gds: true`` selects ``nvmeio.gds_handle``;
the engine refuses it, naming what is missing, where CUDA or kvikio is not
there.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from pydantic import model_validator

from nvmeio.settings import BACKENDS, ZERO_CONFIG_DEFAULTS, AioSettings

from .base import StrictModel, raise_problems
from .values import Choice, Flag, Int

Backend = Choice(*BACKENDS, what="aio backend")
_D = ZERO_CONFIG_DEFAULTS


class AioConfig(StrictModel):
    """Arguments of ``nvmeio.aio_handle`` (``use_gds``: ``gds_handle``)."""

    _renamed: ClassVar[Mapping[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: Int(minimum=1) = _D.block_size
    """Bytes per I/O request."""
    queue_depth: Int(minimum=1) = _D.queue_depth
    """Requests in flight per worker thread."""
    intra_op_parallelism: Int(minimum=1) = _D.intra_op_parallelism
    """Worker threads one op is split over (old name: thread_count)."""
    single_submit: Flag = _D.single_submit
    """Submit one request per system call."""
    overlap_events: Flag = _D.overlap_events
    """Reap completions while submitting."""
    use_gds: Flag = _D.use_gds
    """GPUDirect Storage (cuFile, through ``nvmeio.gds_handle``) instead of host bounce buffers."""
    backend: Backend = _D.backend
    """I/O engine: kernel aio, io_uring, psync thread pool, or the best available."""

    @model_validator(mode="after")
    def _check(self) -> "AioConfig":
        if self.use_gds and self.backend != "auto":
            raise_problems(type(self).__name__, [(
                ("backend",), f"backend {self.backend!r} does not apply with use_gds: true (the "
                "gds_handle has no backend choice); leave backend out or set use_gds to false",
                self.backend)])
        return self

    def settings(self) -> AioSettings:
        """These settings as the one settings type of nvmeio."""
        return AioSettings(**self.model_dump())

    def handle_kwargs(self) -> dict:
        """Keyword arguments of the handle these settings select."""
        return self.settings().handle_kwargs()
