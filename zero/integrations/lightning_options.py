"""DeepSpeedStrategy's arguments for :class:`ZeroStrategy`: their defaults, the combinations refused (what
DeepSpeed would run while ignoring one of them), and the DeepSpeed config they build (lightning_strategy.py
says what each means)."""
from __future__ import annotations

import copy
import logging
import os
import warnings
from typing import Any, Dict, Mapping, Tuple

from nvmeio.hints import did_you_mean

from ..config import IgnoredSettingWarning
from .lightning_precision import LOSS_SCALE_DEFAULTS

# DeepSpeedStrategy's arguments (lightning 2.6) and their defaults, plus save_full_weights (Lightning 1.4's
# DeepSpeedPlugin).
OPTIONS: Dict[str, Any] = {
    "zero_optimization": True, "stage": 2, "remote_device": None, "offload_optimizer": False,
    "offload_parameters": False, "offload_params_device": "cpu", "nvme_path": "/local_nvme",
    "params_buffer_count": 5, "params_buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
    "offload_optimizer_device": "cpu", "optimizer_buffer_count": 4, "block_size": 1048576, "queue_depth": 8,
    "single_submit": False, "overlap_events": True, "thread_count": 1, "pin_memory": False,
    "sub_group_size": 1_000_000_000_000, "contiguous_gradients": True, "overlap_comm": True,
    "allgather_partitions": True, "reduce_scatter": True, "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000, "zero_allow_untested_optimizer": True, "logging_batch_size_per_gpu": "auto",
    "logging_level": logging.WARN, **LOSS_SCALE_DEFAULTS, "partition_activations": False, "cpu_checkpointing": False,
    "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
    "load_full_weights": False, "exclude_frozen_parameters": False, "save_full_weights": False,
}
ZERO_KEYS = ("sub_group_size", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
             "allgather_bucket_size", "reduce_bucket_size")
# DeepSpeedStrategy's activation_checkpointing section: cpu_checkpointing takes effect with train_batch
# windows, the others are DeepSpeed's model-parallel activation features (warned by the config).
ACTIVATION_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "synchronize_checkpoint_boundary")
# The arguments that still count beside config= (the others build the config it replaces).
BESIDE_CONFIG = ("remote_device", "logging_level", "load_full_weights", "exclude_frozen_parameters",
                 "save_full_weights", *LOSS_SCALE_DEFAULTS)


STAGES = (0, 1, 2, 3)


def _refusals(o: Dict[str, Any], given: Mapping[str, Any]) -> None:
    """The combinations of DeepSpeedStrategy's arguments that DeepSpeed would run while ignoring one of
    them: refused, the message naming the fix. ``given``: the arguments the caller passed."""
    if not o["zero_optimization"]:
        if "stage" in given:
            raise ValueError(f"ZeroStrategy(zero_optimization=False, stage={o['stage']!r}): zero_optimization=False "
                             "is ZeRO stage 0 (a config without a zero_optimization section); pass one of the two")
        for name in ("offload_optimizer", "offload_parameters"):
            if o[name]:
                raise ValueError(f"ZeroStrategy(zero_optimization=False, {name}=True): offload needs ZeRO "
                                 f"(zero_optimization=False is stage 0); drop zero_optimization=False and pass "
                                 f"stage={1 if name == 'offload_optimizer' else 3}")
        return
    stage = o["stage"]
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeroStrategy(stage={stage!r}): ZeRO stages are 0, 1, 2 and 3")
    if o["offload_parameters"] and stage < 3:
        raise ValueError(f"ZeroStrategy(stage={stage}, offload_parameters=True): parameters are partitioned, and "
                         f"so offloaded, only at ZeRO stage 3 (below it every rank keeps them whole); pass stage=3, "
                         f"or drop offload_parameters (offload_optimizer=True alone is ZeRO-Offload at stage "
                         f"{max(stage, 1)})")
    if o["offload_optimizer"] and stage == 0:
        raise ValueError("ZeroStrategy(stage=0, offload_optimizer=True): optimizer states are partitioned, and so "
                         "offloaded, from ZeRO stage 1 on; pass stage=1, 2 or 3")
    if o["remote_device"] is not None and stage < 3:
        raise ValueError(f"ZeroStrategy(stage={stage}, remote_device={o['remote_device']!r}): remote_device places "
                         "the parameters configure_model builds under zero.Init, which runs at ZeRO stage 3 only; "
                         "pass stage=3, or drop remote_device")


def _warn_replaced_by_config(given: Mapping[str, Any]) -> None:
    """Arguments that build a config, given beside ``config=``: the config replaces them (as in
    DeepSpeedStrategy), which is said, not done silently."""
    replaced = [f"{k}={v!r}" for k, v in given.items() if k not in BESIDE_CONFIG]
    if replaced:
        warnings.warn(f"ZeroStrategy({', '.join(replaced)}) has no effect beside config=: the config replaces the "
                      f"arguments that build one (as in DeepSpeedStrategy); set them in the config",
                      IgnoredSettingWarning, stacklevel=4)


def config_stage(config: Mapping[str, Any]):
    """The ZeRO stage a DeepSpeed config dict asks for (no ``zero_optimization`` section: 0, as in
    DeepSpeed); a malformed section is left for the engine's config check to report."""
    section = config.get("zero_optimization")
    if section is None:
        return 0
    return section.get("stage", 0) if isinstance(section, Mapping) else None


def _config_from_options(o: Dict[str, Any]) -> dict:
    """The DeepSpeed config DeepSpeedStrategy builds from its arguments (checked by :func:`_refusals`)."""
    config: Dict[str, Any] = {
        "aio": {"block_size": o["block_size"], "queue_depth": o["queue_depth"],
                "single_submit": o["single_submit"], "overlap_events": o["overlap_events"],
                "intra_op_parallelism": o["thread_count"]}}
    if o["logging_batch_size_per_gpu"] != "auto":
        config["train_micro_batch_size_per_gpu"] = o["logging_batch_size_per_gpu"]
    if not o["zero_optimization"]:
        return config  # no zero_optimization section: stage 0, as DeepSpeedStrategy's config is
    # Only the ZeRO keys the user gave: DeepSpeedStrategy's defaults are not the engine's (its
    # sub_group_size of 1e12 would step the whole model's optimizer state at once, in memory).
    zero_section: Dict[str, Any] = {"stage": o["stage"]}
    zero_section.update({key: o[key] for key in ZERO_KEYS if o[key] != OPTIONS[key]})
    if o["offload_optimizer"]:
        zero_section["offload_optimizer"] = {
            "device": o["offload_optimizer_device"], "nvme_path": o["nvme_path"],
            "buffer_count": o["optimizer_buffer_count"], "pin_memory": o["pin_memory"]}
    if o["offload_parameters"]:
        zero_section["offload_param"] = {
            "device": o["offload_params_device"], "nvme_path": o["nvme_path"],
            "buffer_count": o["params_buffer_count"], "buffer_size": o["params_buffer_size"],
            "max_in_cpu": o["max_in_cpu"], "pin_memory": o["pin_memory"]}
    config["zero_allow_untested_optimizer"] = o["zero_allow_untested_optimizer"]
    config["zero_optimization"] = zero_section
    return config


def _with_activation_keys(config: dict, o: Dict[str, Any]) -> dict:
    """DeepSpeedStrategy's activation_checkpointing section, the keys given (the config warns about those
    without effect here)."""
    section = {key: o[key] for key in ACTIVATION_KEYS if o[key] != OPTIONS[key]}
    if section:
        config["activation_checkpointing"] = section
    return config


def _read_config(config) -> dict:
    if isinstance(config, (str, os.PathLike)):
        from ..config.load import read_json

        if not os.path.isfile(config):
            raise FileNotFoundError(f"ZeroStrategy(config=...): no DeepSpeed config file at {os.fspath(config)}")
        return read_json(os.fspath(config))
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"ZeroStrategy(config=...) takes a path to a DeepSpeed JSON file or a dict, "
                    f"got {type(config).__name__}")


def strategy_config(config, options: Mapping[str, Any]) -> Tuple[dict, Dict[str, Any]]:
    """The DeepSpeed config of ``ZeroStrategy(config=config, **options)`` and every argument's value
    (defaults filled in); unknown arguments, refused combinations and arguments without effect are
    dealt with here."""
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        hints = []
        for name in unknown:
            close = did_you_mean(name, list(OPTIONS))
            hints.append(f"'{name}'" + (f" (did you mean '{close}'?)" if close else ""))
        raise TypeError(f"ZeroStrategy got unknown argument(s) {', '.join(hints)}; it takes "
                        f"DeepSpeedStrategy's arguments: {', '.join(sorted(OPTIONS))}")
    o = dict(OPTIONS, **options)
    if config is None:
        _refusals(o, options)
    else:
        _warn_replaced_by_config(options)
    built = _read_config(config) if config is not None else _with_activation_keys(_config_from_options(o), o)
    if config is not None and o["remote_device"] is not None and config_stage(built) in (0, 1, 2):
        raise ValueError(f"ZeroStrategy(remote_device={o['remote_device']!r}) with a config at ZeRO stage "
                         f"{config_stage(built)}: remote_device places the parameters configure_model builds "
                         "under zero.Init, which runs at ZeRO stage 3 only; set zero_optimization.stage to 3, "
                         "or drop remote_device")
    return built, o
