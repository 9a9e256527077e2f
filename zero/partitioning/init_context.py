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

Where the slices live (init_store.py): on the compute device by default, in
host memory with ``remote_device="cpu"`` (or the config's
``offload_param.device``), in one swap file per parameter with ``"nvme"``,
written as each module is built, so that building costs about one module of
memory whatever the model's size.

Models built on the meta device (``with torch.device("meta")``, as Hugging
Face does) are materialised module by module: when a module's constructor
returns, its meta parameters get real memory and the module's
``reset_parameters()`` gives them values (the same values a construction off
the meta device gives with the same seed, for modules whose constructor sets
nothing beyond what ``reset_parameters`` does), then they are partitioned.
Meta parameters of a module without ``reset_parameters`` have no values to
give; they stay on the meta device until a value is assigned to them (a
checkpoint loader, see below) and :func:`zero.initialize` refuses them by name.
A parameter assigned to a module after the module was built inside the
context (``module.weight = nn.Parameter(t)``, what checkpoint loaders do) is
partitioned at once.

Code that changes parameter values after construction (custom weight
initialisation) must gather them first: ``with zero.GatheredParameters(params,
modifier_rank=0): ...``; transformers' ``_init_weights`` is, module by module
(hf_hook.py), so a transformers model built here gets its usual values. While
the context is open transformers sees ZeRO-3 (hf_zero3.py).

[Note: how constructors are intercepted]
Entering the context wraps ``__init__`` of every ``nn.Module`` subclass that
defines one (and, through ``__init_subclass__``, of classes defined while it
is open), and registers a global parameter-registration hook; leaving it
restores both. The wrapper partitions only when the outermost constructor call
of an instance returns, which is the most derived class's ``__init__``.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..runtime.comm import choose_compute_device, init_distributed, process_place
from ..stores.malloc_trim import FreedBytes
from . import hf_zero3
from .active_context import current_context, set_current_context
from .init_store import InitShard, NvmeInitStore, is_init_partitioned

_PATCHED: Dict[type, object] = {}
_DEPTH = [0]
_HOOK = [None]
_ORIGINAL_INIT_SUBCLASS = nn.Module.__dict__.get("__init_subclass__")
_REMOTE_DEVICES = ("none", "cpu", "nvme")


def _replace_param(root: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Put ``new`` wherever ``old`` is registered below ``root`` (tied parameters included)."""
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is old:
                m._parameters[name] = new


def materialize_meta(root: nn.Module) -> None:
    """Give memory and values to the meta parameters below ``root`` whose module has
    ``reset_parameters()`` (see the module docstring); the others stay on the meta device."""
    for m in root.modules():
        metas = [p for p in m._parameters.values() if p is not None and p.is_meta]
        if not metas or not callable(getattr(m, "reset_parameters", None)):
            continue
        for old in metas:
            new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="cpu"),
                               requires_grad=old.requires_grad)
            _replace_param(root, old, new)
        with torch.no_grad():
            m.reset_parameters()


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
        context = current_context()
        if outer and context is not None:
            if context.materialize:
                materialize_meta(self)
            for p in self.parameters():
                if p.is_meta:
                    p._zero_init_context = context  # where a loader partitions its value (checkpoint/pretrained.py)
                else:
                    context.partition(p)
            object.__setattr__(self, "_zero_init_built", True)

    cls.__init__ = __init__


def _on_parameter_registered(module: nn.Module, name: str, param: Optional[nn.Parameter]):
    """A parameter assigned to a module built in the context is partitioned at once."""
    context = current_context()
    if (context is not None and param is not None and module.__dict__.get("_zero_init_built")
            and "_zero_init_entered" not in module.__dict__
            and (context.accept_assigned is None or context.accept_assigned(param))):
        context.partition(param)
    return None


def _all_subclasses(cls: type):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


@classmethod
def _init_subclass(cls, **kwargs):
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


class Init(contextlib.ContextDecorator):
    """Partition parameters as modules are built (see the module docstring).

    A context manager, or a decorator of a function that builds a model
    (``@zero.Init(config_dict_or_path=...)``: each call runs inside the context).
    Arguments follow DeepSpeed's ``zero.Init``; ``module`` partitions an
    existing model at once instead; ``mpu`` (model parallelism) is refused. ``remote_device`` (``"none"``, ``"cpu"``,
    ``"nvme"``) defaults to the config's ``offload_param.device``; ``"nvme"``
    takes ``nvme_path``, ``max_in_cpu``, ``buffer_count`` and ``pin_memory``
    from the config's ``offload_param`` section and the handle settings from
    its ``aio`` section. ``dtype`` casts floating-point parameters as they are
    partitioned. ``enabled=False`` makes the context a no-op. ``compute_device``
    (ours) is where slices stay with ``remote_device="none"``, chosen as
    ``zero.initialize`` chooses it (runtime/comm.py, [Note: which device computes]).
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu=None, compute_device=None):
        if mpu is not None:
            raise ValueError("zero.Init(mpu=...): model parallelism is not supported by this engine: its "
                             "data-parallel group is every rank of the process group, so with model-parallel ranks "
                             "each would keep a slice of the others' parameters; run without model parallelism "
                             "(mpu=None)")
        self.enabled = enabled
        self.dtype = dtype  # floating-point parameters are kept in this dtype (DeepSpeed's meaning)
        place = process_place()
        source = config_dict_or_path if config_dict_or_path is not None else config
        loaded = None
        if source is not None:
            from ..config import load_config

            loaded = load_config(source, world_size=place.world_size)
            if remote_device is None:
                remote_device = loaded.zero_optimization.offload_param.device
        device = choose_compute_device(place.local_rank, compute_device,
                                       loaded.compute_device if loaded is not None else "auto")
        self.comm = init_distributed(device=device)
        self.remote_device = "none" if remote_device is None else remote_device
        if self.remote_device not in _REMOTE_DEVICES:
            raise ValueError(f"zero.Init remote_device must be one of {', '.join(map(repr, _REMOTE_DEVICES))}, "
                             f"got {remote_device!r}")
        on_host = self.remote_device in ("cpu", "nvme")
        self.shard_device = torch.device("cpu") if on_host else device
        self._nvme = None
        if self.remote_device == "nvme":
            offload = loaded.zero_optimization.offload_param if loaded is not None else None
            if offload is None or offload.nvme_path is None:
                raise ValueError(
                    "zero.Init(remote_device='nvme') needs a directory for the swap files: pass "
                    "config_dict_or_path= a config with zero_optimization.offload_param.nvme_path set")
            self._nvme = (offload, loaded.aio.settings())
        self._store: Optional[NvmeInitStore] = None
        self.materialize = True  # give meta parameters values when their module is built
        self.accept_assigned: Optional[Callable[[nn.Parameter], bool]] = None  # None: partition every one
        self.freed = FreedBytes()  # full values dropped once partitioned, returned to the OS (stores/malloc_trim.py)
        self._outer: list = []  # the context active where each open entry of this one began (re-entered: nested)
        hf_config = loaded.model_dump(exclude_unset=True) if loaded is not None else {"zero_optimization": {"stage": 3}}
        self._hf_source = hf_zero3.Zero3Source("zero.Init", hf_config)  # active while an entry is open
        if module is not None and enabled:
            try:
                for p in module.parameters():
                    self.partition(p)
            except BaseException as error:
                self._abandon(error)
                raise
            self._seal()

    @property
    def nvme_store(self) -> Optional[NvmeInitStore]:
        """The swap files of this context (``remote_device="nvme"``), once the first is written."""
        return self._store

    def partition(self, p: nn.Parameter) -> None:
        """Keep this rank's slice of ``p`` where this context keeps slices; ``p.data`` becomes empty."""
        if is_init_partitioned(p) or getattr(p, "_zero_unit", None) is not None or p.is_meta:
            return
        comm = self.comm
        data = p.data
        if self.dtype is not None and data.is_floating_point() and data.dtype != self.dtype:
            data = data.to(self.dtype)
        if comm.distributed:  # every rank keeps rank 0's values
            data = data.to(comm.collective_device)
            comm.broadcast(data, 0)
        numel = data.numel()
        shard_numel = -(-numel // comm.world_size)
        piece = data.reshape(-1)[comm.rank * shard_numel:(comm.rank + 1) * shard_numel]
        if self._nvme is not None:
            if self._store is not None and self._store.abandoned:
                raise RuntimeError("this zero.Init context failed and deleted its swap files; build the model "
                                   "again in a new one")
            if self._store is None or self._store.closed:
                self._store = NvmeInitStore(self._nvme[0], self._nvme[1], comm.rank)
            shard = self._store.new_shard(piece.cpu(), numel, tuple(data.shape), shard_numel)
            # A parameter dropped before zero.initialize (replaced by a tied one) takes its file along.
            weakref.finalize(p, shard.drop).atexit = False
        else:
            tensor = torch.zeros(shard_numel, dtype=data.dtype, device=self.shard_device)
            tensor[:piece.numel()].copy_(piece)
            shard = InitShard(numel, tuple(data.shape), shard_numel, data.dtype, tensor=tensor)
        p._zero_init_shard = shard
        p.ds_shape = data.shape
        p.ds_numel = numel
        p.data = torch.empty(0, dtype=data.dtype, device=data.device)
        if data.device.type == "cpu":
            self.freed.add(numel * data.element_size())

    @contextlib.contextmanager
    def loading(self, accept_assigned: Optional[Callable[[nn.Parameter], bool]] = None):
        """While a checkpoint loader builds and fills a model in this context: meta parameters are
        left for it to assign (no ``reset_parameters``), and an assigned parameter is partitioned at
        once if ``accept_assigned(param)`` (the others stay whole until the caller partitions them)."""
        saved = self.materialize, self.accept_assigned
        self.materialize, self.accept_assigned = False, accept_assigned
        try:
            yield self
        finally:
            self.materialize, self.accept_assigned = saved

    def _seal(self) -> None:
        if self._store is not None:
            self._store.seal()

    def _abandon(self, error: BaseException) -> None:
        """``error`` ends this context: nothing will take its slices over, so their swap files,
        pool and threads go now (the parameters built in it cannot be used: building the model
        again is the way on). A failure doing so is noted on ``error``, never raised in its place."""
        if self._store is None:
            return
        try:
            self._store.abandon()
        except BaseException as other:  # noqa: BLE001 - noted; the context's own error is the one to raise
            error.add_note(f"deleting the zero.Init slices also failed: {type(other).__name__}: {other}")

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._outer.append(current_context())
        set_current_context(self)
        if _DEPTH[0] == 0:
            try:
                for cls in [nn.Module, *_all_subclasses(nn.Module)]:
                    if cls is not nn.Module:
                        _wrap_init(cls)
                nn.Module.__init_subclass__ = _init_subclass
                _HOOK[0] = register_module_parameter_registration_hook(_on_parameter_registered)
                if "transformers" in sys.modules:  # from_pretrained / from_config build partitioned (hf_hook.py)
                    from .hf_hook import install

                    install()
            except BaseException:
                _unpatch()  # no half-patched nn.Module is left behind
                set_current_context(self._outer.pop())
                raise
        _DEPTH[0] += 1
        try:  # transformers sees ZeRO-3 while the context is open (hf_zero3.py)
            hf_zero3.activate(self._hf_source)
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        hf_zero3.deactivate(self._hf_source)
        _DEPTH[0] -= 1
        set_current_context(self._outer.pop())
        if _DEPTH[0] == 0:
            _unpatch()
        if exc is None:
            self._seal()
        else:
            self._abandon(exc)


def _unpatch() -> None:
    """Undo what entering the outermost context patched (whatever part of it was done)."""
    for cls, original in _PATCHED.items():
        cls.__init__ = original
    _PATCHED.clear()
    if _ORIGINAL_INIT_SUBCLASS is not None:
        nn.Module.__init_subclass__ = _ORIGINAL_INIT_SUBCLASS
    elif "__init_subclass__" in nn.Module.__dict__:
        del nn.Module.__init_subclass__
    if _HOOK[0] is not None:
        _HOOK[0].remove()
        _HOOK[0] = None
