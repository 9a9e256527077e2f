"""``zero.initialize``: DeepSpeed's entry point, returning ``(engine, optimizer, dataloader, lr_scheduler)``."""
from __future__ import annotations

import tempfile
import warnings
from typing import Optional

import torch
import torch.nn as nn

from .build import OptimizerSpec, check_params_known
from ..runtime.comm import choose_compute_device, init_distributed, process_place
from ..config import ConfigDeprecationWarning, ConfigError, DeepSpeedConfig, Problem, load_config, resolve_auto
from .zero_engine import ZeroEngine
from .lr_schedules import build_scheduler
from .optimizer import AdamKind

_ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def _hidden_size(model: nn.Module) -> Optional[int]:
    value = getattr(getattr(model, "config", None), "hidden_size", None)
    return value if isinstance(value, int) and value > 0 else None


def _param_groups(model: nn.Module, model_parameters) -> list:
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _adam_hyper(group: dict) -> dict:
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}


def _optimizer_spec(model, config: DeepSpeedConfig, optimizer, model_parameters) -> Optional[OptimizerSpec]:
    if config.optimizer is not None and optimizer is not None:
        raise ConfigError([Problem("optimizer", (
            "an optimizer is given both in the config's optimizer section and as the optimizer "
            "argument of zero.initialize; keep one"))])
    if config.optimizer is not None:
        params = config.optimizer.params
        if not params.bias_correction:
            raise ConfigError([Problem("optimizer.params.bias_correction", (
                "false is not supported: torch's fused Adam always corrects the bias; remove the key"))])
        hyper = {"lr": params.lr, "betas": tuple(params.betas), "eps": params.eps,
                 "weight_decay": params.weight_decay}
        groups = [dict(hyper, **g) for g in _param_groups(model, model_parameters)]
        return OptimizerSpec(groups, AdamKind(config.optimizer.decoupled_weight_decay, params.amsgrad))
    if optimizer is None:
        return None
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable making one, "
                        f"got {type(optimizer).__name__}")
    groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
    if type(optimizer) in _ADAM_TYPES:
        first = optimizer.param_groups[0]
        if first.get("maximize"):
            raise ConfigError([Problem("optimizer", "maximize=True is not supported by the ZeRO optimizer")])
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(first.get("decoupled_weight_decay"))
        groups = [dict(_adam_hyper(g), params=g["params"]) for g in groups]
        return OptimizerSpec(groups, AdamKind(decoupled, bool(first.get("amsgrad", False))))
    if not config.zero_allow_untested_optimizer:
        raise ConfigError([Problem("zero_allow_untested_optimizer", (
            f"optimizer {type(optimizer).__name__} is not Adam or AdamW, which the ZeRO optimizer "
            f"implements; to step it on the partitions anyway (it must be elementwise) set "
            f'"zero_allow_untested_optimizer": true'))])
    if config.zero_optimization.offload_optimizer.device == "nvme":
        raise ConfigError([Problem("zero_optimization.offload_optimizer.device", (
            f"'nvme' swaps the states of the ZeRO Adam optimizer only; a script's own "
            f"{type(optimizer).__name__} keeps its states in memory: use device 'cpu' or 'none', or the "
            f"config's optimizer section (Adam/AdamW)"))])
    hyper_keys = set(optimizer.defaults)
    groups = [dict({k: v for k, v in g.items() if k in hyper_keys}, params=g["params"]) for g in groups]
    return OptimizerSpec(groups, None, torch_type=type(optimizer), torch_defaults=dict(optimizer.defaults))


def _check_nvme_writable(config: DeepSpeedConfig) -> None:
    problems = []
    zc = config.zero_optimization
    for section in ("offload_param", "offload_optimizer"):
        offload = getattr(zc, section)
        if offload.device != "nvme":
            continue
        paths = offload.nvme_path if isinstance(offload.nvme_path, list) else [offload.nvme_path]
        for path in paths:  # each drive of a striped nvme_path
            try:
                with tempfile.NamedTemporaryFile(dir=path, prefix=".zero-probe-"):
                    pass
            except OSError as error:
                problems.append(Problem(f"zero_optimization.{section}.nvme_path", (
                    f"cannot create a file in '{path}': {error.strerror or error}")))
    if problems:
        raise ConfigError(problems)


def _resolve(config, model, optimizer, world_size: int) -> DeepSpeedConfig:
    if not config.unresolved_autos():
        return config
    known = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        known.update(_adam_hyper(optimizer.param_groups[0]))
        known["betas"] = list(known["betas"]) if "betas" in known else None
        known = {k: v for k, v in known.items() if v is not None}
    return resolve_auto(config, hidden_size=_hidden_size(model), world_size=world_size, **known)


def refuse_mpu(caller: str, mpu) -> None:
    """``mpu`` (Megatron's model-parallel unit) would make the data-parallel group a subset of the ranks."""
    if mpu is not None:
        raise ValueError(f"{caller}(mpu=...): model parallelism is not supported by this engine: its data-parallel "
                         f"group is every rank of the process group, so with model-parallel ranks the gradients "
                         f"would be averaged across them too; run without model parallelism (mpu=None)")


def add_config_arguments(parser):
    """DeepSpeed's ``deepspeed.add_config_arguments``: ``--deepspeed``, ``--deepspeed_config`` and the
    deprecated ``--deepscale`` / ``--deepscale_config`` on an ``argparse`` parser; pass the parsed
    ``args`` to :func:`initialize`, which reads ``args.deepspeed_config``. Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def config_from_args(args):
    """``args.deepspeed_config``, or the deprecated ``args.deepscale_config`` (warned), as DeepSpeed reads them."""
    if args is None:
        return None
    config, old = getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None)
    if old is not None:
        if config is not None:
            raise ValueError("args has both deepscale_config and deepspeed_config; keep --deepspeed_config "
                             "(--deepscale_config is its deprecated name)")
        warnings.warn("--deepscale_config is deprecated; use --deepspeed_config", ConfigDeprecationWarning,
                      stacklevel=3)
        config = old
    return config


def initialize(args=None, model: nn.Module = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required: Optional[bool] = None, collate_fn=None,
               config=None, config_params=None, compute_device=None):
    """Wrap ``model`` in a :class:`~zero.engine.ZeroEngine`.

    ``config`` (or ``config_params``, or ``args.deepspeed_config`` of an
    ``argparse`` namespace, see :func:`add_config_arguments`: one of them) is a
    DeepSpeed JSON path, dict or :class:`~zero.config.DeepSpeedConfig`. ``mpu``
    (model parallelism) is refused. ``dist_init_required``: None joins the process
    group a launcher started the ranks for (none for a single process), True also
    makes one for a single process, False never makes one (the script's is used).
    ``optimizer``: a torch optimizer (Adam/AdamW run as the ZeRO optimizer;
    others need ``zero_allow_untested_optimizer``) or a callable making one;
    omit it to use the config's ``optimizer`` section. ``lr_scheduler``: a
    scheduler or a callable taking the returned optimizer; omit it to use the
    config's ``scheduler`` section. Returns ``(engine, optimizer, dataloader,
    lr_scheduler)``; ``dataloader`` is None without ``training_data``.
    ``compute_device`` (ours: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or
    ``"auto"``/None) comes before the config's ``compute_device``, then ``$DS_ACCELERATOR``,
    then CUDA when available (runtime/comm.py, [Note: which device computes]).
    """
    if model is None:
        raise ValueError("zero.initialize needs model=")
    refuse_mpu("zero.initialize", mpu)
    if config is not None and config_params is not None:
        raise ValueError("pass the config as config= or config_params=, not both")
    source = config if config is not None else config_params
    from_args = config_from_args(args)
    if from_args is not None and source is not None:
        raise ValueError(f"zero.initialize got a config both in args.deepspeed_config ({from_args!r}) and as "
                         f"config=; pass one (DeepSpeed refuses both too)")
    source = from_args if source is None else source
    if source is None:
        raise ValueError("zero.initialize needs a config (config=path or dict, or args.deepspeed_config)")

    if dist_init_required:  # DeepSpeed's: make the process group even for one process
        from .distributed import init_distributed as make_process_group

        make_process_group(verbose=False)
    place = process_place()  # the device (and so the process group's backend) comes from the config
    world = place.world_size if dist_init_required is not False else 1  # False: no group is joined
    loaded = load_config(source, world_size=world, hidden_size=_hidden_size(model))
    device = choose_compute_device(place.local_rank, compute_device, loaded.compute_device)
    comm = init_distributed(device=device, join=dist_init_required is not False)
    loaded = _resolve(loaded, model, optimizer, comm.world_size)
    _check_nvme_writable(loaded)
    spec = _optimizer_spec(model, loaded, optimizer, model_parameters)
    if spec is not None:
        check_params_known(model, spec)
    if training_data is not None and loaded.train_micro_batch_size_per_gpu is None:  # before the model is taken
        raise ConfigError([Problem("train_micro_batch_size_per_gpu", (
            "is needed to batch training_data; set it (or train_batch_size) in the config"))])

    engine = ZeroEngine(model, loaded, comm, device, spec)
    try:  # the caller never sees an engine that failed here: it goes with what it took
        scheduler = None
        if lr_scheduler is not None:
            scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and not hasattr(
                lr_scheduler, "step") else lr_scheduler
        elif loaded.scheduler is not None and engine.optimizer is not None:
            scheduler = build_scheduler(loaded.scheduler, engine.optimizer)
        engine.lr_scheduler = scheduler

        dataloader = None
        if training_data is not None:
            dataloader = _dataloader(training_data, loaded, comm, collate_fn, device)
    except BaseException as error:
        engine._release_failed(error)
        raise
    return engine, engine.optimizer, dataloader, scheduler


def _dataloader(data, config: DeepSpeedConfig, comm, collate_fn, device: torch.device):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    micro = config.train_micro_batch_size_per_gpu
    sampler = DistributedSampler(data, num_replicas=comm.world_size, rank=comm.rank)
    return DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      pin_memory=device.type == "cuda")


__all__ = ["add_config_arguments", "initialize"]
