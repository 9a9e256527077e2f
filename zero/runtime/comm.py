"""Ranks, the compute device and the collectives the engine uses.

A process started by a launcher (``torchrun``, ``deepspeed``, Open MPI's or
MPICH's ``mpirun``, Slurm's ``srun``: launcher.py reads which rank it is) joins
the default process group, NCCL when compute runs on CUDA, gloo otherwise. A process
started without one is a world of one: no process group is created and every
collective below is the identity, so a single-process run never needs a port
or a rendezvous. A process group the script created itself is used as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from nvmeio import env

from .launcher import discover, join_process_group

# torch 2.13 names the flat collectives *_single and warns (FutureWarning) on the old names,
# which older torch has alone.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def compute_device(local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@dataclass
class Comm:
    """This process's place among the data-parallel ranks, and the collectives over them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Optional[object] = None
    # While ``deferring`` (the engine's forward and backward on several ranks), a rank whose
    # parameter read fails keeps the error here and joins the collectives with zeros, so that
    # the other ranks are not left waiting; the engine makes every rank raise at the end.
    deferring: bool = field(default=False, repr=False, compare=False)
    deferred: Optional[Exception] = field(default=None, repr=False, compare=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def defer(self, error: Exception) -> None:
        if self.deferred is None:
            self.deferred = error

    def take_deferred(self) -> Optional[Exception]:
        error, self.deferred = self.deferred, None
        return error

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """``full`` (world_size × shard elements) gets every rank's ``shard`` in rank order."""
        if not self.distributed:
            full.copy_(shard)
            return
        _ALL_GATHER(full, shard, group=self.group)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """``shard`` gets this rank's slice of the sum of every rank's ``full``; ``async_op``: returns
        the collective's work (``wait()`` before reading ``shard``), else None once it is done."""
        if not self.distributed:
            shard.copy_(full)
            return None
        return _REDUCE_SCATTER(shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def any(self, flag: bool, device: torch.device) -> bool:
        """True if ``flag`` is true on any rank."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(t, "max")
        return bool(t.item() > 0)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"


def process_group_timeout() -> Optional[timedelta]:
    """``$DEEPSPEED_TIMEOUT`` minutes (DeepSpeed's variable, an integer as it reads it), else None:
    torch's default (30 minutes for gloo). The rendezvous and every collective wait that long for
    a rank: a rank that dies in a collective fails the others at once (its connections reset),
    but one that dies during start-up, or hangs, leaves them waiting this long."""
    minutes = env.get(TIMEOUT_ENV)
    return timedelta(minutes=minutes) if minutes else None


def process_group_backend(dist_backend: Optional[str] = None) -> str:
    """``dist_backend``, else NCCL when CUDA is available, else gloo."""
    return dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")


def init_distributed(dist_backend: Optional[str] = None, join: bool = True) -> Comm:
    """The :class:`Comm` of this process, joining the default process group if launched
    (with :func:`process_group_timeout`): by torchrun (even as one rank), or by MPI or Slurm
    with more than one rank (one needs no group, and no port).

    ``dist_backend`` overrides the choice of NCCL (CUDA) or gloo (CPU). ``join=False`` never
    creates the group: the script's, else one rank.
    """
    launch = discover()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif join and dist.is_available() and (launch.launcher == "torchrun" or launch.world_size > 1):
        join_process_group(launch, process_group_backend(dist_backend), process_group_timeout())
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    local_rank = launch.local_rank if launch.local_rank is not None else env.get("LOCAL_RANK")
    return Comm(rank=rank, world_size=world, local_rank=rank if local_rank is None else local_rank)
