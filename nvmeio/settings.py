"""AioSettings: the one model of a handle's settings.

The same six knobs reach a handle from four places: ``aio_handle``'s
arguments, the swappers, the ZeRO config's ``"aio"`` section and the block
``nvme_tune`` prints. All of them hold an :class:`AioSettings`; each only
parses its own spelling into it (the config layer accepts ``"false"``
strings and ``thread_count``, the tuner ds_nvme_tune's sweep names).

[Note: two sets of defaults]
DeepSpeed documents two defaults for the same knobs: its handle,
``aio_handle(block_size=1M, queue_depth=128, single_submit=False,
overlap_events=False, intra_op_parallelism=1)``, and its ZeRO config's
``"aio"`` section, ``queue_depth=8, overlap_events=true``. A script or config
written for DeepSpeed must behave the same here, so both are kept: the
dataclass defaults are the handle's, :data:`ZERO_CONFIG_DEFAULTS` the
config's. Nothing else defines a default.

``use_gds=True`` selects :class:`nvmeio.gds_handle` (cuFile through kvikio)
instead of :class:`nvmeio.aio_handle`; :func:`nvmeio.new_handle` refuses it,
naming what is missing, where CUDA or kvikio is not there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Optional, Union

from .hints import hint

__all__ = ["AioSettings", "ZERO_CONFIG_DEFAULTS", "BACKENDS", "MAX_BLOCK_SIZE", "MAX_QUEUE_DEPTH",
           "MAX_INTRA_OP_PARALLELISM"]

BACKENDS = ("auto", "io_uring", "aio", "psync")  # what the native core can be built with

# Largest settings the core accepts. block_size: a worker may hold two bounce
# buffers of it, and the kernel moves at most ~2 GiB per request anyway;
# queue_depth: io_uring's ring limit; intra_op_parallelism: threads per handle.
MAX_BLOCK_SIZE = 256 << 20
MAX_QUEUE_DEPTH = 32768
MAX_INTRA_OP_PARALLELISM = 1024
_MAXIMA = {"block_size": MAX_BLOCK_SIZE, "queue_depth": MAX_QUEUE_DEPTH,
           "intra_op_parallelism": MAX_INTRA_OP_PARALLELISM}
_BOOLS = ("single_submit", "overlap_events", "use_gds")


@dataclass(frozen=True)
class AioSettings:
    """Settings of one handle; validated when built.

    Attributes:
        block_size: bytes per I/O request (the native core rounds up to 4096).
        queue_depth: requests kept in flight per worker thread.
        single_submit: submit one request per syscall instead of batches.
        overlap_events: reap completions while submitting.
        intra_op_parallelism: worker threads; one op is split across them.
        backend: "auto" (the fastest available, measured once per process),
            "io_uring", "aio" (kernel AIO) or "psync"; checked against what
            this build and kernel allow when a handle is made.
        use_gds: a ``gds_handle`` (GPUDirect Storage) instead of an ``aio_handle``.
    """

    block_size: int = 1048576
    queue_depth: int = 128
    single_submit: bool = False
    overlap_events: bool = False
    intra_op_parallelism: int = 1
    backend: str = "auto"
    use_gds: bool = False

    def __post_init__(self) -> None:
        for name, maximum in _MAXIMA.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if value > maximum:
                raise ValueError(f"{name} must be at most {maximum}, got {value!r}")
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a backend name ({', '.join(BACKENDS)}), "
                             f"got {self.backend!r}")
        if self.use_gds and self.backend != "auto":
            raise ValueError(f"backend={self.backend!r} does not apply with use_gds=True: the "
                             "gds_handle has no backend choice (its host-buffer ops use the "
                             "fastest available); leave backend at 'auto' or set use_gds to false")

    @classmethod
    def coerce(cls, value: Union["AioSettings", Mapping[str, Any], None],
               defaults: Optional["AioSettings"] = None) -> "AioSettings":
        """Settings from themselves, ``None`` (``defaults``, else the handle's) or a
        dict with these keys (a DeepSpeed ``"aio"`` dict); an unknown key is an
        error with a did-you-mean hint, never ignored."""
        base = defaults if defaults is not None else cls()
        if value is None:
            return base
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError("aio settings must be an AioSettings, a dict or None, got "
                            f"{type(value).__name__}")
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"unknown aio key {key!r}; {hint(str(key), known)}")
        return replace(base, **dict(value))

    def as_dict(self) -> dict:
        return asdict(self)

    def handle_kwargs(self) -> dict:
        """Keyword arguments of the handle these settings select (see :func:`nvmeio.new_handle`):
        ``aio_handle``'s, or ``gds_handle``'s (no backend) with ``use_gds``."""
        kwargs = {"block_size": self.block_size, "queue_depth": self.queue_depth,
                  "single_submit": self.single_submit, "overlap_events": self.overlap_events,
                  "intra_op_parallelism": self.intra_op_parallelism}
        if not self.use_gds:
            kwargs["backend"] = self.backend
        return kwargs

    def aio_block(self) -> dict:
        """The ZeRO config's ``"aio"`` section for these settings (what nvme_tune prints):
        real booleans and ``intra_op_parallelism``; ``use_gds: true`` only when set, and
        then no ``backend``."""
        block = {"block_size": self.block_size, "queue_depth": self.queue_depth,
                 "intra_op_parallelism": self.intra_op_parallelism,
                 "single_submit": self.single_submit, "overlap_events": self.overlap_events}
        if self.use_gds:
            block["use_gds"] = True
        else:
            block["backend"] = self.backend
        return block


ZERO_CONFIG_DEFAULTS = AioSettings(queue_depth=8, overlap_events=True)
"""Defaults of the ZeRO config's ``"aio"`` section (see [Note: two sets of defaults])."""
