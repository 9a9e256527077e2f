"""Ranks, the compute device and the collectives the engine uses.

A process started by a launcher (``torchrun``, ``deepspeed``, Open MPI's or
MPICH's ``mpirun``, Slurm's ``srun``: launcher.py reads which rank it is) joins
the default process group, NCCL when compute runs on CUDA (bound to that device),
gloo otherwise. A process started without one is a world of one: no process group
is created and every collective below is the identity, so a single-process run
never needs a port or a rendezvous. A process group the script created itself
is used as it is.

[Note: which device computes]
:func:`choose_compute_device` takes the first of these that names a device
(``"auto"`` names none and passes on):

1. the ``compute_device=`` argument of ``zero.initialize`` / ``zero.Init``: what a
   framework decided (``ZeroStrategy`` passes Lightning's root device, so
   ``accelerator="cpu"`` computes on the CPU; ``ZeroTrainer`` the
   TrainingArguments' device, so ``use_cpu=True`` does);
2. the config's top-level ``compute_device``;
3. ``$DS_ACCELERATOR``, DeepSpeed's variable (``cpu`` or ``cuda``);
4. CUDA when torch has it, else the CPU.

``"cuda"`` is the rank's own device (``LOCAL_RANK`` modulo the devices),
``"cuda:N"`` names one. CUDA asked for where there is none is an error saying
where it was asked for, never a silent CPU run. The test suite sets
``DS_ACCELERATOR=cpu`` (tests/conftest.py): its references are computed on the
CPU, so on a GPU machine it still compares like with like.

[Note: collectives take tensors where the backend wants them]
NCCL takes CUDA tensors only; gloo takes host tensors (and CUDA ones for some
collectives only). A :class:`Comm` knows its group's backend and the device its
collectives take (``collective_device``: for NCCL the CUDA compute device, or
the rank's own GPU when computing on the CPU; else the CPU). A collective given
a tensor elsewhere copies it there, runs, and copies the result back (an
asynchronous reduce-scatter copies back in its ``wait()``), so no caller has to
know: the offloaded optimizer's gradient norm lives on the host, ``zero.Init``
and ``GatheredParameters`` broadcast host values. What the engine gathers and
reduces it already places on the compute device, where NCCL wants it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from nvmeio import env

from ..config.errors import ConfigError, Problem
from ..config.values import compute_device_name
from ._slice_exchange import SliceExchange
from .launcher import discover, join_process_group

# torch 2.13 names the flat collectives *_single and warns (FutureWarning) on the old names,
# which older torch has alone.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CPU = torch.device("cpu")
ACCELERATOR_ENV = "DS_ACCELERATOR"
_ACCELERATORS = ("cpu", "cuda")  # the values of DeepSpeed's DS_ACCELERATOR that name a device we compute on


class Place(NamedTuple):
    """This process among the ranks."""

    rank: int
    world_size: int
    local_rank: int


def process_place() -> Place:
    """This process's rank, world size and local rank, joining nothing: the default process
    group's if one exists, else a launcher's (launcher.py), else a world of one."""
    launch = discover()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif dist.is_available() and launch.launcher is not None:
        rank, world = launch.rank, launch.world_size
    else:
        rank, world = 0, 1
    local_rank = launch.local_rank if launch.local_rank is not None else env.get("LOCAL_RANK")
    return Place(rank, world, rank if local_rank is None else local_rank)


def _named_device(argument, configured: str) -> tuple:
    """The first choice that names a device, and a function making the error that blames it."""
    if argument is not None:
        text = argument
        if isinstance(argument, torch.device):  # (the CPU's index, as in Hugging Face's "cpu:0", means nothing)
            text = "cpu" if argument.type == "cpu" else str(argument)
        try:
            name = compute_device_name(text)
        except ValueError as error:  # the config's message for the same spelling
            raise ValueError(f"compute_device={argument!r}: {error}") from None
        if name != "auto":
            return name, lambda why: ValueError(f"compute_device={argument!r} {why}")
    if configured != "auto":
        return configured, lambda why: ConfigError([Problem("compute_device", f"{configured!r} {why}")])
    raw = env.get(ACCELERATOR_ENV)
    if raw is not None:
        name = raw.strip().lower()
        if name not in _ACCELERATORS:
            raise ValueError(f"{ACCELERATOR_ENV}={raw!r}: zero computes on {' or '.join(_ACCELERATORS)}; "
                             f"set {ACCELERATOR_ENV} to one of them or unset it")
        return name, lambda why: ValueError(f"{ACCELERATOR_ENV}={raw!r} {why}")
    return "auto", None


def choose_compute_device(local_rank: int = 0, argument=None, configured: str = "auto") -> torch.device:
    """Where this rank computes (see [Note: which device computes]): ``argument`` (a
    ``compute_device=`` argument: a name or a ``torch.device``; None or ``"auto"``: no choice),
    else ``configured`` (the config's ``compute_device``), else ``$DS_ACCELERATOR``, else CUDA
    when available. A CUDA device is made the current one."""
    name, blame = _named_device(argument, configured)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return CPU
    if not torch.cuda.is_available():
        raise blame("asks for CUDA, but torch.cuda.is_available() is False here (no GPU, no driver, or a "
                    "CPU build of torch); compute on the CPU with compute_device 'cpu' or 'auto'")
    count = torch.cuda.device_count()
    index = local_rank % count if name == "cuda" else int(name.partition(":")[2])
    if index >= count:
        raise blame(f"names CUDA device {index}, but this machine has {count} (cuda:0 to cuda:{count - 1})")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device(backend: Optional[str], compute: torch.device, local_rank: int) -> torch.device:
    """The device whose tensors ``backend``'s collectives take (see the note): for NCCL the
    CUDA compute device, or this rank's own GPU; the CPU for the others (and for a group that
    serves host tensors with gloo beside NCCL, when computing on the CPU)."""
    if backend is None:  # a world of one: no collective moves anything
        return compute
    names = backend.lower()
    if "nccl" not in names:
        return CPU
    if compute.type == "cuda":
        return compute
    if "gloo" in names:
        return CPU
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (tests put a stand-in for CUDA here)."""
    return t.to(device)


class _Done:
    """The work of a collective that had nothing to wait for (a world of one)."""

    @staticmethod
    def wait() -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


_DONE = _Done()


class _CopiedBack:
    """The work of an asynchronous collective that ran on copies: ``wait()`` also copies the
    result back into the caller's tensor."""

    def __init__(self, work, result: torch.Tensor, used: torch.Tensor, keep: torch.Tensor):
        self._work, self._result, self._used, self._keep = work, result, used, keep

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self):
        done = self._work.wait()
        self._result.copy_(self._used)
        self._used = self._keep = None
        return done


@dataclass
class Comm:
    """This process's place among the data-parallel ranks, and the collectives over them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Optional[object] = None
    backend: Optional[str] = None  # the process group's backend; None in a world of one
    # Where the collectives' tensors go (see [Note: collectives take tensors where the backend wants them]).
    collective_device: torch.device = CPU
    # While ``deferring`` (the engine's forward and backward on several ranks), a rank whose
    # parameter read fails keeps the error here and joins the collectives with zeros, so that
    # the other ranks are not left waiting; the engine makes every rank raise at the end.
    deferring: bool = field(default=False, repr=False, compare=False)
    deferred: Optional[Exception] = field(default=None, repr=False, compare=False)
    _exchange: Optional[SliceExchange] = field(default=None, init=False, repr=False, compare=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def defer(self, error: Exception) -> None:
        if self.deferred is None:
            self.deferred = error

    def take_deferred(self) -> Optional[Exception]:
        error, self.deferred = self.deferred, None
        return error

    def _there(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the collective device: itself, or a copy there."""
        return t if t.device == self.collective_device else _to_device(t, self.collective_device)

    @staticmethod
    def _back(result: torch.Tensor, used: torch.Tensor) -> None:
        if used is not result:
            result.copy_(used)

    def _slices_exchanged(self, *tensors: torch.Tensor) -> Optional[SliceExchange]:
        """Under gloo with host tensors, the point-to-point exchange that replaces its flat
        collectives (_slice_exchange.py [Note: gloo's flat collectives, and the exchange that
        replaces them]); else None."""
        if self.backend is None or "gloo" not in self.backend.lower() or self.collective_device.type != "cpu" \
                or any(t.device.type != "cpu" for t in tensors):
            return None
        if self._exchange is None:
            peers = [dist.get_global_rank(self.group, j) if self.group is not None else j
                     for j in range(self.world_size)]
            self._exchange = SliceExchange(self.rank, peers, self.group)
        return self._exchange

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """``full`` (world_size × shard elements) gets every rank's ``shard`` in rank order;
        ``async_op``: returns the work (``wait()`` before reading ``full``), else None once done."""
        if not self.distributed:
            full.copy_(shard)
            return _DONE if async_op else None
        exchange = self._slices_exchanged(full, shard)
        if exchange is not None:
            return exchange.all_gather(full, shard, async_op)
        used, given = self._there(full), self._there(shard)
        work = _ALL_GATHER(used, given, group=self.group, async_op=async_op)
        if async_op:
            return work if used is full else _CopiedBack(work, full, used, given)
        self._back(full, used)
        return None

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """``shard`` gets this rank's slice of the sum of every rank's ``full``; ``async_op``: returns
        the collective's work (``wait()`` before reading ``shard``), else None once it is done."""
        if not self.distributed:
            shard.copy_(full)
            return None
        exchange = self._slices_exchanged(shard, full)
        if exchange is not None:
            return exchange.reduce_scatter(shard, full, async_op)
        used, given = self._there(shard), self._there(full)
        work = _REDUCE_SCATTER(used, given, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if async_op:
            return work if used is shard else _CopiedBack(work, shard, used, given)
        self._back(shard, used)
        return None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            used = self._there(tensor)
            dist.all_reduce(used, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
            self._back(tensor, used)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.distributed:
            used = self._there(tensor)
            dist.broadcast(used, src=src, group=self.group)
            self._back(tensor, used)
        return tensor

    def barrier(self) -> None:
        if not self.distributed:
            return
        if self.collective_device.type == "cuda":  # NCCL's barrier on this rank's device, not a guess
            dist.barrier(group=self.group, device_ids=[self.collective_device.index])
        else:
            dist.barrier(group=self.group)

    def any(self, flag: bool) -> bool:
        """True if ``flag`` is true on any rank."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0])
        self.all_reduce(t, "max")  # on the collective device, and back
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
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.collective_device)
        return box[0]


TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"


def process_group_timeout() -> Optional[timedelta]:
    """``$DEEPSPEED_TIMEOUT`` minutes (DeepSpeed's variable, an integer as it reads it), else None:
    torch's default (30 minutes for gloo). The rendezvous and every collective wait that long for
    a rank: a rank that dies in a collective fails the others at once (its connections reset),
    but one that dies during start-up, or hangs, leaves them waiting this long."""
    minutes = env.get(TIMEOUT_ENV)
    return timedelta(minutes=minutes) if minutes else None


def process_group_backend(dist_backend: Optional[str] = None, device: Optional[torch.device] = None) -> str:
    """``dist_backend``, else NCCL when computing on CUDA (``device``; None: where this rank
    would compute, :func:`choose_compute_device`), else gloo."""
    if dist_backend:
        return dist_backend
    if device is None:
        device = choose_compute_device(process_place().local_rank)
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(dist_backend: Optional[str] = None, device: Optional[torch.device] = None,
                     join: bool = True) -> Comm:
    """The :class:`Comm` of this process computing on ``device`` (None: :func:`choose_compute_device`
    without an argument or a config), joining the default process group if launched (with
    :func:`process_group_timeout`): by torchrun (even as one rank), or by MPI or Slurm with more
    than one rank (one needs no group, and no port). NCCL when computing on CUDA, bound to that
    device (``device_id``), else gloo; ``dist_backend`` overrides that choice. ``join=False``
    never creates the group: the script's, else one rank."""
    launch = discover()
    place = process_place()
    if device is None:
        device = choose_compute_device(place.local_rank)
    backend = None
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    elif join and dist.is_available() and (launch.launcher == "torchrun" or launch.world_size > 1):
        backend = process_group_backend(dist_backend, device)
        # NCCL's communicators made eagerly, on this device only
        device_id = device if device.type == "cuda" and "nccl" in backend.lower() else None
        join_process_group(launch, backend, process_group_timeout(), device_id=device_id)
        place = Place(dist.get_rank(), dist.get_world_size(), place.local_rank)
    else:  # no group (join=False, or one rank that needs none): a world of one
        place = Place(0, 1, place.local_rank)
    return Comm(rank=place.rank, world_size=place.world_size, local_rank=place.local_rank, backend=backend,
                collective_device=collective_device(backend, device, place.local_rank))
