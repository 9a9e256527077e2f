"""``zero.Init()``: construct a model whose parameters are partitioned from the start.

Inside the context, every ``nn.Module`` partitions its parameters as soon as
its constructor returns (the constructor of the most derived class, so a
subclass that edits ``self.weight`` after ``super().__init__()`` still sees
full data): rank 0's values are broadcast, each rank keeps its slice of the
flattened parameter and the parameter's ``.data`` becomes an empty tensor
(``ds_shape`` and ``ds_numel`` keep the real size). So a model too large for
one process's memory is never whole in any one of them; only one module's
parameters are full at a time, while it is being built.
:func:`zero.initialize` then regroups these slices into its units.

Code that changes parameter values after construction (custom weight
initialisation) must gather them first: ``with zero.GatheredParameters(params,
modifier_rank=0): ...``. Slices are kept in host memory when
``remote_device`` or the config's ``offload_param.device`` is ``cpu`` or
``nvme``, on the compute device otherwise.

[Note: how constructors are intercepted]
Entering the context wraps ``__init__`` of every ``nn.Module`` subclass that
defines one (and, through ``__init_subclass__``, of classes defined while it
is open); leaving it restores them. The wrapper partitions only when the
outermost constructor call of an instance returns, which is the most derived
class's ``__init__``.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from .comm import Comm, compute_device, init_distributed

_STATE = threading.local()
_PATCHED: Dict[type, object] = {}
_DEPTH = [0]
_ORIGINAL_INIT_SUBCLASS = nn.Module.__dict__.get("__init_subclass__")


@dataclass
class InitShard:
    """This rank's slice of one parameter partitioned by :class:`Init`."""

    shard: torch.Tensor  # shard_numel elements, zero padded at the end of the last rank
    numel: int
    shape: Tuple[int, ...]


def is_init_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "_zero_init_shard", None) is not None


def forget_init_shard(p: torch.Tensor) -> None:
    if is_init_partitioned(p):
        p._zero_init_shard = None


def full_param_value(p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The full value of a parameter, all-gathered when :class:`Init` partitioned it."""
    s: Optional[InitShard] = getattr(p, "_zero_init_shard", None)
    if s is None:
        return p.data
    if comm.world_size == 1:
        return s.shard[:s.numel].view(s.shape)
    dev = compute_device(comm.local_rank)  # NCCL gathers device tensors, gloo host tensors
    full = torch.empty(s.shard.numel() * comm.world_size, dtype=s.shard.dtype, device=dev)
    comm.all_gather_into(full, s.shard.to(dev))
    return full[:s.numel].view(s.shape)


def store_init_shard(p: torch.Tensor, full: torch.Tensor, comm: Comm) -> None:
    """Keep this rank's slice of ``full`` as ``p``'s shard."""
    s: InitShard = p._zero_init_shard
    n = s.shard.numel()
    piece = full.reshape(-1)[comm.rank * n:(comm.rank + 1) * n]
    s.shard[:piece.numel()].copy_(piece)


def partition_param(p: nn.Parameter, comm: Comm, device: torch.device) -> None:
    if is_init_partitioned(p) or getattr(p, "_zero_unit", None) is not None:
        return
    data = p.data
    if comm.distributed:  # every rank keeps rank 0's values
        data = data.to(compute_device(comm.local_rank))
        comm.broadcast(data, 0)
    numel = data.numel()
    shard_numel = -(-numel // comm.world_size)
    shard = torch.zeros(shard_numel, dtype=data.dtype, device=device)
    piece = data.reshape(-1)[comm.rank * shard_numel:(comm.rank + 1) * shard_numel]
    shard[:piece.numel()].copy_(piece)
    p._zero_init_shard = InitShard(shard, numel, tuple(data.shape))
    p.ds_shape = data.shape
    p.ds_numel = numel
    p.data = torch.empty(0, dtype=data.dtype, device=data.device)


def _wrap_init(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _PATCHED:
        return
    _PATCHED[cls] = original

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        outer = "_zero_init_entered" not in self.__dict__
        if outer:
            object.__setattr__(self, "_zero_init_entered", True)
        try:
            original(self, *args, **kwargs)
        finally:
            if outer:
                self.__dict__.pop("_zero_init_entered", None)
        context = getattr(_STATE, "context", None)
        if outer and context is not None:
            for p in self.parameters():
                partition_param(p, context.comm, context.shard_device)

    cls.__init__ = __init__


def _all_subclasses(cls: type):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


@classmethod
def _init_subclass(cls, **kwargs):
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


class Init:
    """Partition parameters as modules are built (see the module docstring).

    Arguments follow DeepSpeed's ``zero.Init``; ``module`` partitions an
    existing model at once instead. ``enabled=False`` makes the context a no-op.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu=None):
        self.enabled = enabled
        self.comm = init_distributed()
        if remote_device is None and (config_dict_or_path is not None or config is not None):
            from .config import load_config

            loaded = load_config(config_dict_or_path if config_dict_or_path is not None else config,
                                 world_size=self.comm.world_size)
            remote_device = loaded.zero_optimization.offload_param.device
        on_host = remote_device in ("cpu", "nvme")
        self.shard_device = torch.device("cpu") if on_host else compute_device(self.comm.local_rank)
        if module is not None and enabled:
            for p in module.parameters():
                partition_param(p, self.comm, self.shard_device)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._previous = getattr(_STATE, "context", None)
        _STATE.context = self
        if _DEPTH[0] == 0:
            for cls in [nn.Module, *_all_subclasses(nn.Module)]:
                if cls is not nn.Module:
                    _wrap_init(cls)
            nn.Module.__init_subclass__ = _init_subclass
        _DEPTH[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        _DEPTH[0] -= 1
        _STATE.context = self._previous
        if _DEPTH[0] == 0:
            for cls, original in _PATCHED.items():
                cls.__init__ = original
            _PATCHED.clear()
            if _ORIGINAL_INIT_SUBCLASS is None:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = _ORIGINAL_INIT_SUBCLASS
