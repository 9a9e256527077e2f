"""Where :class:`zero.Init` keeps each parameter's slice until :func:`zero.initialize` takes it over.

A slice lives in memory (``remote_device`` none or cpu) or, with
``remote_device="nvme"`` (or the config's ``offload_param.device: nvme``), in
a swap file of its own under ``<nvme_path>/zero_init[.n]/rank<r>/params/``,
written as soon as the parameter's module is built. The first
``offload_param.max_in_cpu`` elements stay in host memory (DeepSpeed's rule).
So building a model costs about one module of memory whatever its size:
the slices of the modules built before are on disk. ``zero.initialize``
reads them back one unit at a time and deletes each file once its values
are in the engine's stores; the directory goes with the last file.

Below the store, the functions that read, gather or replace one parameter's
slice (``full_param_value``, ``store_init_shard``, ...), for ``Init``,
``GatheredParameters`` and ``zero.initialize`` alike.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Optional, Set, Tuple

import torch

from ..runtime.comm import Comm

_JOBS = itertools.count()
_ABANDONED = ("this parameter's zero.Init slice was deleted with its context's swap files when the context "
             "failed (an error left its with block, or its construction raised); build the model again")
_POOL_BUFFER_BYTES = 16 << 20  # a larger slice is written and read in pieces of this size


class InitShard:
    """This rank's slice of one parameter partitioned by :class:`zero.Init`.

    ``shard_numel`` elements, zero padded at the end of the last rank; either
    ``tensor`` (in memory) or the swap file ``key`` of ``store``.
    """

    def __init__(self, numel: int, shape: Tuple[int, ...], shard_numel: int, dtype: torch.dtype,
                 tensor: Optional[torch.Tensor] = None, store: Optional["NvmeInitStore"] = None,
                 key: str = ""):
        self.numel = numel
        self.shape = shape
        self.shard_numel = shard_numel
        self.dtype = dtype
        self.tensor = tensor
        self.store = store
        self.key = key

    @property
    def on_nvme(self) -> bool:
        return self.tensor is None

    @property
    def lost(self) -> bool:
        """Its file went with a context that failed (:meth:`NvmeInitStore.abandon`)."""
        return self.store is not None and self.store.abandoned

    def read(self) -> torch.Tensor:
        """The slice's values: the resident tensor itself, or a fresh tensor read from its file."""
        if self.tensor is not None:
            return self.tensor
        return self.store.read(self.key, self.shard_numel, self.dtype)

    def write(self, values: torch.Tensor) -> None:
        """Replace the slice by ``values`` (at most ``shard_numel`` elements; the rest becomes 0)."""
        values = values.detach().reshape(-1)
        if self.tensor is not None:
            self.tensor[:values.numel()].copy_(values)
            self.tensor[values.numel():].zero_()
            return
        if values.numel() != self.shard_numel or values.dtype != self.dtype:
            padded = torch.zeros(self.shard_numel, dtype=self.dtype, device="cpu")
            padded[:values.numel()].copy_(values)
            values = padded
        self.store.write(self.key, values)

    def drop(self) -> None:
        """Free the slice (its file is deleted)."""
        if self.store is not None:
            self.store.remove(self.key)
            self.store = None
        self.tensor = None


class NvmeInitStore:
    """The swap files of one :class:`zero.Init` context (see the module docstring).

    ``offload`` is the config's ``offload_param`` section (``nvme_path``,
    ``max_in_cpu``, ``buffer_count``, ``pin_memory``), ``aio`` the handle settings.
    """

    def __init__(self, offload, aio, rank: int):
        from swapper import AsyncTensorSwapper, PinnedBufferPool
        from swapper import SwapDirectory
        from nvmeio import AioSettings
        from nvmeio.striping import stripe_unit

        job = "zero_init" + ("" if (n := next(_JOBS)) == 0 else f".{n}")
        with contextlib.ExitStack() as undo:  # a part that fails gives back those made before it
            swap_dir = SwapDirectory(offload.nvme_path, job, rank, "params", remove_stale=True,
                                     stripe_unit=stripe_unit(AioSettings.coerce(aio).block_size))
            undo.callback(swap_dir.cleanup)
            with torch.device("cpu"):  # on the CPU even inside ``with torch.device("meta")``
                pool = PinnedBufferPool(max(2, offload.buffer_count), _POOL_BUFFER_BYTES, torch.uint8,
                                        pin_memory=offload.pin_memory)
            undo.callback(pool.close)
            self.swapper = AsyncTensorSwapper(swap_dir, pool, aio, holder="zero.Init")
            undo.pop_all()
        self.max_in_cpu = int(offload.max_in_cpu)
        self.cpu_numel = 0
        self.files = 0
        self.sealed = False  # the context has exited: no new slices; close with the last file
        self.abandoned = False  # closed with its files by a context that failed (abandon())
        self._ids = itertools.count()
        self._live: Set[str] = set()

    @property
    def closed(self) -> bool:
        return self.swapper.swap_dir.closed

    @property
    def path(self) -> str:
        return self.swapper.swap_dir.path

    def new_shard(self, values: torch.Tensor, numel: int, shape: Tuple[int, ...], shard_numel: int) -> InitShard:
        """A slice holding ``values`` (this rank's piece, ``shard_numel`` elements or fewer)."""
        values = values.detach().reshape(-1)
        if self.cpu_numel + shard_numel <= self.max_in_cpu:
            self.cpu_numel += shard_numel
            tensor = torch.zeros(shard_numel, dtype=values.dtype, device="cpu")
            tensor[:values.numel()].copy_(values)
            return InitShard(numel, shape, shard_numel, values.dtype, tensor=tensor)
        shard = InitShard(numel, shape, shard_numel, values.dtype, store=self, key=f"p{next(self._ids)}.swp")
        self._live.add(shard.key)
        self.files += 1
        shard.write(values)
        return shard

    def write(self, key: str, values: torch.Tensor) -> None:
        # The values are copied into pool buffers before this returns; the write completes later.
        self.swapper.swap_out([values], [key])

    def read(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.abandoned:
            raise RuntimeError(_ABANDONED)
        self.swapper.synchronize()  # a write of this file may still be in flight
        out = torch.empty(numel, dtype=dtype, device="cpu")
        self.swapper.swap_in([out], [key])
        return out

    def remove(self, key: str) -> None:
        if key not in self._live or self.swapper.swap_dir.closed:
            return
        self._live.discard(key)
        self.swapper.synchronize()
        self.swapper.swap_dir.remove(key)
        self.files -= 1
        if self.files == 0 and self.sealed:
            self.close()

    def seal(self) -> None:
        """No more slices will come (the context exited): close now if no file is left."""
        self.sealed = True
        if self.files == 0:
            self.close()

    def abandon(self) -> None:
        """The context failed (its construction, or an error left its ``with`` block): delete
        every slice now, as nothing will take them over; reading one afterwards is an error."""
        self.abandoned = True
        self.close()

    def close(self) -> None:
        """Complete the writes in flight, end the handles' threads, free the pool, delete the
        directory with every file left in it (each step runs even if one before it raised)."""
        if self.swapper.swap_dir.closed:
            return
        with contextlib.ExitStack() as steps:  # the steps run last registered first
            steps.callback(self.swapper.swap_dir.cleanup)
            steps.callback(self.swapper.pool.close)
            self.swapper.close()


# -- a parameter's slice, for the code that reads or replaces it ------------------------------------

def is_init_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "_zero_init_shard", None) is not None


def init_shard_lost(p: torch.Tensor) -> bool:
    """``p``'s :class:`Init` slice was deleted with a context that failed (init_store.py)."""
    s: Optional[InitShard] = getattr(p, "_zero_init_shard", None)
    return s is not None and s.lost


def forget_init_shard(p: torch.Tensor) -> None:
    """Drop ``p``'s :class:`Init` slice (its swap file too): an engine holds its values now."""
    s: Optional[InitShard] = getattr(p, "_zero_init_shard", None)
    if s is not None:
        s.drop()
        p._zero_init_shard = None


def full_param_value(p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The full value of a parameter, all-gathered when :class:`Init` partitioned it."""
    s: Optional[InitShard] = getattr(p, "_zero_init_shard", None)
    if s is None:
        return p.data
    shard = s.read()
    if comm.world_size == 1:
        return shard[:s.numel].view(s.shape)
    full = torch.empty(s.shard_numel * comm.world_size, dtype=s.dtype, device=comm.collective_device)
    comm.all_gather_into(full, shard)
    return full[:s.numel].view(s.shape)


def store_init_shard(p: torch.Tensor, full: torch.Tensor, comm: Comm) -> None:
    """Keep this rank's slice of ``full`` as ``p``'s shard."""
    s: InitShard = p._zero_init_shard
    n = s.shard_numel
    s.write(full.reshape(-1)[comm.rank * n:(comm.rank + 1) * n])
