"""``zero.GatheredParameters``: full parameters inside a ``with`` block.

    with zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.normal_(std=0.02)

Inside the block the parameters hold their full values on every rank. With
``modifier_rank`` set, that rank's values are broadcast on exit and become the
new partitioned values: the compute-dtype shards and the fp32 master weights
(so an engine's next step starts from them). Without it, changes are not
propagated: other ranks never see them and they may or may not survive the
release (on one rank, fp32 parameters kept in memory are views of the master
weights, so in-place changes stay). Works for parameters of an engine and for parameters partitioned
by :class:`zero.Init` before any engine exists; other tensors pass through.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch

from ..runtime.comm import init_distributed
from .init_store import full_param_value, is_init_partitioned, store_init_shard
from ..runtime.unit import ParamUnit, empty_like_released


def _as_list(params) -> List[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if isinstance(p, torch.Tensor)]


class GatheredParameters:
    """Gather ``params`` on entry, release (and with ``modifier_rank``, write back) on exit."""

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module=None, enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.units: List[ParamUnit] = []
        for p in self.params:
            u = getattr(p, "_zero_unit", None)
            if u is not None and all(u is not v for v in self.units):
                self.units.append(u)
        self.init_params = [p for p in self.params if is_init_partitioned(p)]
        self.comm = self.units[0].comm if self.units else (init_distributed() if self.init_params else None)

    def __enter__(self):
        for u in self.units:
            u.hold()
            u.gather()
        for p in self.init_params:
            p.data = full_param_value(p, self.comm).clone() if self.comm.distributed else \
                full_param_value(p, self.comm)
        return self

    def __exit__(self, *exc) -> None:
        modified = self.modifier_rank is not None and exc[0] is None
        with torch.no_grad():
            for u in self.units:
                if modified:
                    self._write_back(u)
                u.unhold()
                if u.releasable:
                    u.release()
            for p in self.init_params:
                if modified:
                    full = self.comm.broadcast(p.data, self.modifier_rank)
                    store_init_shard(p, full, self.comm)
                p.data = empty_like_released(p.dtype, p.device)

    def _write_back(self, u: ParamUnit) -> None:
        full = self.comm.broadcast(u.full, self.modifier_rank)
        start = u.layout.shard_start(self.comm.rank)
        shard = u.store.as_stored(u.layout, full[start:start + u.layout.shard_numel])
        if u.optimizer_store is not None:
            u.optimizer_store.write_master(u.index, shard.float())
        u.store.write(u.layout, shard)
        u.store.flush()
