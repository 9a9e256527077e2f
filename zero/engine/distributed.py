"""``zero.init_distributed``: DeepSpeed's ``deepspeed.init_distributed``, the process group a script
asks for before it builds its model.

    zero.init_distributed()                  # torchrun, deepspeed, mpirun (Open MPI, MPICH) or srun
    rank = torch.distributed.get_rank()

The launcher is read as zero/runtime/launcher.py says (torchrun's variables,
then Open MPI's, PMI's, Slurm's). Unlike ``zero.initialize``, which makes no
group for a single process, this call always leaves one: a process started
without a launcher gets a group of one rank on an in-memory store (no port),
so that ``torch.distributed.get_rank()`` and friends work as after DeepSpeed's
call.
"""
from __future__ import annotations

import logging
import warnings
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..config import IgnoredSettingWarning
from ..runtime.comm import process_group_backend, process_group_timeout
from ..runtime.launcher import DEFAULT_PORT, Launch, discover, join_process_group
from ..runtime.timers import log_rank0


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: Optional[timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group, as ``deepspeed.init_distributed`` does (same arguments).

    Nothing happens when a group exists already or ``dist_init_required=False``. ``dist_backend``:
    default NCCL with CUDA, else gloo. ``auto_mpi_discovery=False`` reads torchrun's variables only.
    ``distributed_port``: rank 0's port where ``MASTER_PORT`` is unset. ``timeout``: default
    ``$DEEPSPEED_TIMEOUT`` minutes, else torch's. ``rank`` and ``world_size`` (both, or neither)
    replace what the launcher says, with ``init_method`` (default ``env://``: ``MASTER_ADDR`` and
    ``MASTER_PORT``). ``config``: DeepSpeed reads its communication logger there, which this
    engine does not have (a warning says so).
    """
    if config is not None:
        warnings.warn("zero.init_distributed(config=...) is accepted for DeepSpeed compatibility but has no effect "
                      "in nvmeio (DeepSpeed reads its communication logger settings there)", IgnoredSettingWarning,
                      stacklevel=2)
    if dist_init_required is False or dist.is_initialized():
        return
    if (rank >= 0) != (world_size > 0):
        raise ValueError(f"zero.init_distributed(rank={rank}, world_size={world_size}): pass both, or neither to "
                         f"take them from the launcher")
    backend = process_group_backend(dist_backend)
    timeout = timeout if timeout is not None else process_group_timeout()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if rank >= 0:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                **kwargs)
        how = "as given"
    else:
        launch = discover(distributed_port, mpi=auto_mpi_discovery)
        if launch.launcher is None or (launch.world_size == 1 and launch.launcher != "torchrun"):
            # One rank: an in-memory store, no port (DeepSpeed's discovery would open one).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            launch = Launch(launcher=launch.launcher)
        else:
            join_process_group(launch, backend, timeout, init_method)
        how = f"from {launch.launcher}" if launch.launcher else "no launcher: one rank"
    if verbose:
        log_rank0(dist.get_rank(), f"init_distributed: rank {dist.get_rank()} of {dist.get_world_size()} "
                  f"({how}), backend {backend}", logging.INFO)


__all__ = ["init_distributed"]
