"""The states of a unit of parameters, and what each costs in memory."""
from __future__ import annotations

import enum


class ParamState(enum.Enum):
    """Where a unit's full parameters are; its shard stays at home in every state.

    - ``NOT_AVAILABLE``: only the shard exists (the start, and after ``release``);
    - ``INFLIGHT``: a read of the shard ahead of use is in flight (``mark_prefetched``;
      back to ``NOT_AVAILABLE`` by ``drop_prefetch``, on to ``AVAILABLE`` by ``gather``);
    - ``AVAILABLE``: the full parameters are on the compute device (``gather``).

    Only :class:`~zero.runtime.unit.ParamUnit`'s methods change it. Each member says
    what it costs in memory, per unit, beyond the shard.
    """

    NOT_AVAILABLE = "not_available"
    """Only this rank's shard exists, at its home (device, host or NVMe); each
    parameter's ``.data`` is an empty tensor. Costs nothing on the device beyond
    the shard (nothing at all when the shard lives on the host or NVMe)."""

    INFLIGHT = "inflight"
    """A fetch was started (an NVMe read of the shard); the full parameters are not
    valid yet. Costs one pool buffer of host memory for the shard being read."""

    AVAILABLE = "available"
    """Full parameters on the compute device; each parameter's ``.data`` views the
    unit's flat buffer. Costs ``padded_numel × itemsize`` bytes on the device, or
    nothing extra when the flat buffer is the resident shard itself (world size
    1, shard on the compute device in the compute dtype)."""
