"""ZeRO stages 0-3 with ZeRO-Offload and ZeRO-Infinity (offload none / cpu / nvme), on nvmeio.

    engine, optimizer, _, scheduler = zero.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

Also: ``zero.init_distributed`` and ``zero.add_config_arguments`` (DeepSpeed's
script-level calls: the process group from torchrun, MPI or Slurm; the
``--deepspeed_config`` arguments ``initialize(args=...)`` reads),
``zero.Init`` (build a model partitioned from the start; also a decorator),
``zero.GatheredParameters``, ``zero.load_pretrained`` (checkpoint tensors into
partitions, one at a time), ``engine.save_checkpoint / load_checkpoint /
save_16bit_model``, ``get_fp32_state_dict_from_zero_checkpoint``,
``load_state_dict_from_zero_checkpoint`` (and ``python -m zero.zero_to_fp32``),
``estimate_zero2_model_states_mem_needs(_all_live / _all_cold)`` and
``estimate_zero3_model_states_mem_needs_all_live / _all_cold`` (DeepSpeed's
tables), ``estimate_rank_bytes`` (this engine's host, device and NVMe bytes
per rank at any stage).

Importing ``zero`` loads only the config layer (:mod:`zero.config`, no torch);
the engine's modules are imported on first use of their names. The public API is
this package's ``__all__`` and the modules ``zero.hf``, ``zero.lightning``,
``zero.zero_to_fp32``, ``zero.examples`` and ``zero.demo``; the sub-packages
(``config``, ``stores``, ``runtime``, ``partitioning``, ``checkpoint``,
``engine``, ``integrations``) are the implementation, mapped in
docs/architecture.md.
"""

from .config import ConfigError, DeepSpeedConfig, load_config, resolve_auto

_LAZY = {  # public name: the module it comes from
    "initialize": "engine.entry",
    "init_distributed": "engine.distributed",
    "add_config_arguments": "engine.entry",
    "ZeroEngine": "engine.zero_engine",
    "EngineStateError": "engine.backward_pass",
    "CheckpointTagError": "checkpoint.format",
    "CheckpointCorruptionError": "checkpoint.format",
    "UnsafeCheckpointError": "checkpoint.format",
    "Init": "partitioning.init_context",
    "GatheredParameters": "partitioning.gathered",
    "load_pretrained": "checkpoint.pretrained",
    "save_pretrained": "checkpoint.pretrained",
    "estimate_zero2_model_states_mem_needs": "stores.estimator",
    "estimate_zero2_model_states_mem_needs_all_live": "stores.estimator",
    "estimate_zero2_model_states_mem_needs_all_cold": "stores.estimator",
    "estimate_zero3_model_states_mem_needs_all_live": "stores.estimator",
    "estimate_zero3_model_states_mem_needs_all_cold": "stores.estimator",
    "estimate_rank_bytes": "stores.estimator",
    "get_fp32_state_dict_from_zero_checkpoint": "zero_to_fp32",
    "load_state_dict_from_zero_checkpoint": "zero_to_fp32",
}

__all__ = ["ConfigError", "DeepSpeedConfig", "load_config", "resolve_auto", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zero' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
