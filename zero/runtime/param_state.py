"""The states of a unit of parameters, and what each costs in memory."""
from __future__ import annotations

import enum


class ParamState(enum.Enum):
    """Where a unit's full parameters are. ``shard`` stays at home in every state.

    Memory on the compute device, per unit, beyond its shard:
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
