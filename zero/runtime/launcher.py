"""Which rank this process is, read from the launcher that started it.

    launch = discover()          # Launch(rank=1, world_size=4, local_rank=1, ..., launcher="Open MPI")

Launchers and what each sets (the first found rules, in this order):

| launcher | rank, world size, local rank | rank 0's address and port |
|---|---|---|
| torchrun, ``deepspeed`` | ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (with ``MASTER_ADDR``) | ``MASTER_ADDR``, ``MASTER_PORT`` |
| Open MPI (``mpirun``) | ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK`` | see below |
| MPICH / Intel MPI (PMI) | ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` | see below |
| Slurm (``srun``) | ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` | see below |

Without torchrun's variables, rank 0's address is ``MASTER_ADDR`` when set;
else, with every rank on this machine (the launcher's local size equals the
world size, or Slurm's ``SLURM_NNODES`` is 1), 127.0.0.1; else under Slurm the
first host of ``SLURM_NODELIST`` (as Lightning's SLURMEnvironment reads it);
else it cannot be known without a message between the ranks and is refused,
naming ``MASTER_ADDR``. The port is ``MASTER_PORT``, else DeepSpeed's 29500 (its
``init_distributed(distributed_port=...)``). DeepSpeed's own discovery (mpi4py)
broadcasts rank 0's host name instead; the result is the same address. Nothing
here writes the environment. A Slurm job named ``bash`` or ``interactive`` is
not taken for a launch (Lightning's rule): from such a shell a script starts
its own ranks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from nvmeio import env

from .timers import log_rank0

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


@dataclass(frozen=True)
class Launch:
    """This process's place among the ranks a launcher started (``launcher`` None: no launcher, one rank);
    ``local_size``: the ranks on this machine where the launcher says."""

    rank: int = 0
    world_size: int = 1
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    port: int = DEFAULT_PORT
    launcher: Optional[str] = None

    def master_addr(self) -> str:
        """Rank 0's address (module docstring); an error naming ``MASTER_ADDR`` where it cannot be known."""
        given = env.get("MASTER_ADDR")
        if given is not None:
            return given
        slurm = self.launcher == "Slurm"
        if self.world_size == 1 or self.local_size == self.world_size or (slurm and env.get("SLURM_NNODES") == 1):
            return "127.0.0.1"
        if slurm and env.get("SLURM_NODELIST") is not None:
            return first_slurm_host(env.get("SLURM_NODELIST"))
        raise RuntimeError(f"{self.launcher} started {self.world_size} ranks on several machines (or did not say "
                           f"how many are on this one) and MASTER_ADDR is not set: set it to the host name of rank "
                           f"0's machine for every rank (with mpirun: -x MASTER_ADDR=<host>)")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr()}:{self.port}"


# launcher -> (rank, world size, local rank, local size) variables
_MPI_LIKE = (
    ("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("MPICH (PMI)", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("Slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[5-9,12],gpu1`` -> ``node5``."""
    nodes = re.sub(r"\[(.*?)[,-].*?\]", r"\1", nodelist)
    nodes = re.sub(r"\[(.*?)\]", r"\1", nodes)
    return nodes.split(" ")[0].split(",")[0]


def discover(distributed_port: int = DEFAULT_PORT, mpi: bool = True) -> Launch:
    """This process's :class:`Launch`, from the first launcher whose variables are set (module
    docstring); ``mpi=False`` looks at torchrun's only (DeepSpeed's ``auto_mpi_discovery=False``)."""
    port = env.get("MASTER_PORT") or distributed_port
    if env.is_set("WORLD_SIZE") and env.is_set("RANK") and env.is_set("MASTER_ADDR"):
        return _checked(Launch(env.get("RANK"), env.get("WORLD_SIZE"), env.get("LOCAL_RANK"), None, port,
                               "torchrun"), "RANK", "WORLD_SIZE")
    if not mpi:
        return Launch()
    for launcher, (rank_var, size_var, local_var, local_size_var) in _MPI_LIKE:
        if not (env.is_set(rank_var) and env.is_set(size_var)):
            continue
        if launcher == "Slurm" and env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
            continue
        return _checked(Launch(env.get(rank_var), env.get(size_var), env.get(local_var),
                               env.get(local_size_var) if local_size_var else None, port, launcher),
                        rank_var, size_var)
    return Launch()


def join_process_group(launch: Launch, backend: str, timeout: Optional[timedelta] = None,
                       init_method: Optional[str] = None) -> None:
    """Create the default process group of ``launch``'s ranks. torchrun's through ``env://`` (its
    agent's store, where it has one); the others' at :attr:`Launch.init_method`, or ``init_method``."""
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if launch.launcher == "torchrun" and init_method is None:
        dist.init_process_group(backend=backend, **kwargs)
        return
    address = init_method or launch.init_method
    # Said before waiting: a script a batch job runs without its launcher (python, not srun) waits here.
    log_rank0(launch.rank, f"joining the {launch.world_size} ranks {launch.launcher} started at {address} (each of "
                           f"them must start: under Slurm, launch with srun)")
    dist.init_process_group(backend=backend, init_method=address, rank=launch.rank,
                            world_size=launch.world_size, **kwargs)


def _checked(launch: Launch, rank_var: str, size_var: str) -> Launch:
    if launch.rank >= launch.world_size:
        raise ValueError(f"{rank_var}={launch.rank} is not below {size_var}={launch.world_size}: the "
                         f"{launch.launcher} launch variables contradict each other")
    return launch
