"""``zero_optimization``: partitioning, buckets, prefetch and offload.

Stages 0, 1, 2 and 3 run on one engine (engine/build.py, [Note: the ZeRO
ladder]); ``offload_param`` needs stage 3 and ``offload_optimizer`` stage 1 or
more, as in DeepSpeed. The ``stage3_`` keys have no effect below stage 3 (a
warning names each one set). Keys are named as users write them (the ``stage3_``
prefixed forms); DeepSpeed's unprefixed spellings are accepted as aliases.
Keys of DeepSpeed features nvmeio does not have (ZeRO++, MiCS, ...) and
tuning knobs of DeepSpeed's machinery that nvmeio does not share (gradient
buckets: nvmeio reduces each unit as one flat buffer) are accepted, and warn,
naming the key, when set to anything but their default.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar, Mapping, Optional

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .aio import AioConfig
from .base import StrictModel, problem_error, raise_problems
from .offload import OffloadOptimizerConfig, OffloadParamConfig
from .values import DirName, ElementCount, Flag, Int, Real, fail, flag, whole_number

STAGES = (0, 1, 2, 3)


class LocoParams(StrictModel):
    """``zeropp_loco_param`` of ZeRO++ (accepted, no effect in nvmeio)."""

    err_beta: Real(minimum=0.0) = 0.8
    reset_T: Int(minimum=1) = 1024


class ZeroConfig(StrictModel):
    """``zero_optimization``."""

    _aliases: ClassVar[Mapping[str, str]] = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    }
    _renamed: ClassVar[Mapping[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    _inert: ClassVar[frozenset[str]] = frozenset({
        "legacy_stage1", "elastic_checkpoint", "use_multi_rank_bucket_allreduce",
        "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients", "zeropp_loco_param",
        "mics_shard_size", "mics_hierarchical_params_gather", "pipeline_loading_checkpoint",
        # DeepSpeed's bucketing and scheduling knobs: nvmeio reduce-scatters and gathers one
        # unit at a time, with contiguous gradients (overlap_comm and reduce_bucket_size take effect:
        # runtime/grad_reducer.py, [Note: reductions in flight (overlap_comm)]).
        "allgather_bucket_size", "contiguous_gradients",
        "reduce_scatter", "allgather_partitions", "round_robin_gradients", "ignore_unused_parameters",
        "load_from_fp32_weights", "override_module_apply", "log_trace_cache_warnings",
    })

    stage: Int(minimum=0) = 0

    # offload
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    aio: Optional[AioConfig] = None
    """Given here instead of at the top level; the engine reads ``config.aio``."""
    sub_group_size: Int(minimum=1) = 1_000_000_000
    """Elements per optimizer step tile (the NVMe swap granularity)."""
    nvme_job_id: Optional[DirName] = None
    """The directory of this job's swap files under each nvme_path (``<nvme_path>/<job>/rank<r>/``);
    None: the NVMEIO_JOB_ID environment variable, else "zero_stage_3". Jobs sharing an
    nvme_path (a shared mount) need different ones."""

    # communication
    reduce_bucket_size: ElementCount(minimum=1, auto=True) = 500_000_000
    allgather_bucket_size: Int(minimum=1) = 500_000_000
    overlap_comm: Flag = True
    contiguous_gradients: Flag = True
    reduce_scatter: Flag = True
    allgather_partitions: Flag = True
    round_robin_gradients: Flag = False
    use_multi_rank_bucket_allreduce: Flag = True

    # stage 3 fetch and release
    stage3_prefetch_bucket_size: ElementCount(minimum=0, auto=True) = 50_000_000
    stage3_param_persistence_threshold: ElementCount(minimum=0, auto=True) = 100_000
    stage3_model_persistence_threshold: Int(minimum=0) = sys.maxsize
    stage3_max_live_parameters: Int(minimum=0) = 1_000_000_000
    stage3_max_reuse_distance: Int(minimum=0) = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Flag = False
    stage3_module_granularity_threshold: Int(minimum=0) = 0
    stage3_use_all_reduce_for_fetch_params: Flag = False

    # checkpoints and parameters
    load_from_fp32_weights: Flag = True
    elastic_checkpoint: Flag = False
    ignore_unused_parameters: Flag = True
    legacy_stage1: Flag = False
    memory_efficient_linear: Flag = True
    override_module_apply: Flag = True
    log_trace_cache_warnings: Flag = False
    pipeline_loading_checkpoint: Flag = False

    # ZeRO++ and MiCS
    zero_hpz_partition_size: Int(minimum=1) = 1
    zero_quantized_weights: Flag = False
    zero_quantized_nontrainable_weights: Flag = False
    """Stage 3: frozen units' shards stored int8 with fp32 group scales, dequantized on fetch
    (stores/quantized.py, [Note: frozen weights stored quantized]); no effect below stage 3."""
    zero_quantized_gradients: Flag = False
    zeropp_loco_param: Optional[LocoParams] = None
    mics_shard_size: Int(minimum=None) = -1
    mics_hierarchical_params_gather: Flag = False

    @model_validator(mode="before")
    @classmethod
    def _reject_bool_form(cls, data: Any) -> Any:
        if isinstance(data, bool):  # DeepSpeed's oldest form: true is stage 1, false stage 0
            fail("old_form", (
                f'"zero_optimization": {str(data).lower()} is DeepSpeed\'s old form of ZeRO stage '
                f'{int(data)}; write "zero_optimization": {{"stage": {int(data)}}}'))
        return data

    @classmethod
    def _upgrade(cls, data: dict, notes: list) -> dict:
        for section in ("offload_param", "offload_optimizer"):
            if section in data and data[section] is None:  # DeepSpeed's "not offloaded"
                del data[section]
        # DeepSpeed <= 0.5 booleans that became the offload sections.
        for old, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old not in data:
                continue
            on = cls._old_flag(data, old)
            notes.append((old, f"{section}.device = \"{'cpu' if on else 'none'}\""))
            if not on:
                continue
            given = data.get(section)
            if isinstance(given, Mapping):
                device = given.get("device") or "none"
                if str(device).lower() not in ("cpu", "none"):
                    raise_problems(cls.__name__, [((section, "device"), (
                        f"'{old}: true' asks for device 'cpu' but {section}.device is "
                        f"{device!r}; drop '{old}'"), device)])
                data[section] = {**given, "device": "cpu"}
            else:
                data[section] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            pin = cls._old_flag(data, "cpu_offload_use_pin_memory")
            notes.append(("cpu_offload_use_pin_memory",
                          ("offload_param.pin_memory", "offload_optimizer.pin_memory")))
            for section in ("offload_param", "offload_optimizer"):
                given = data.get(section)
                if isinstance(given, Mapping) and "pin_memory" not in given:
                    data[section] = {**given, "pin_memory": pin}
        return data

    @classmethod
    def _old_flag(cls, data: dict, key: str) -> bool:
        value = data.pop(key)
        try:
            return flag(value)
        except PydanticCustomError as error:
            raise problem_error(cls.__name__, [((key,), error.message(), value)]) from None

    @classmethod
    def _check_given(cls, data: dict) -> list:
        # Checked on the keys as given, so that a wrong stage is reported together
        # with every other problem of the section.
        try:
            stage = whole_number(data.get("stage", 0))
        except PydanticCustomError:
            return []  # reported by the field's own validation
        problems: list = []
        if stage not in STAGES:
            problems.append((("stage",), (
                f"ZeRO stages are 0, 1, 2 and 3 (got {stage})"), stage))
        param = data.get("offload_param")
        device = str(param.get("device") or "none").lower() if isinstance(param, Mapping) else "none"
        if device != "none" and stage < 3:
            problems.append((("offload_param",), (
                f"offload_param (device '{device}') needs ZeRO stage 3, but "
                f"zero_optimization.stage is {stage}"), device))
        opt = data.get("offload_optimizer")
        device = str(opt.get("device") or "none").lower() if isinstance(opt, Mapping) else "none"
        if device != "none" and stage == 0:
            problems.append((("offload_optimizer",), (
                f"offload_optimizer (device '{device}') needs ZeRO stage 1, 2 or 3 (the optimizer states "
                f"it moves are partitioned from stage 1 on), but zero_optimization.stage is 0"), device))
        return problems

    def inert_now(self) -> Mapping[str, str]:
        """Keys set here that have no effect with this section's values: the ``stage3_`` keys
        and ``zero_quantized_nontrainable_weights`` below stage 3 (parameters are whole on every
        rank there, in the compute dtype, as in DeepSpeed)."""
        if self.stage >= 3:
            return {}
        inert = {name: "has no effect below ZeRO stage 3" for name in self.model_fields_set
                 if name.startswith("stage3_")}
        if self.zero_quantized_nontrainable_weights:
            inert["zero_quantized_nontrainable_weights"] = (
                "has no effect below ZeRO stage 3: every rank holds the whole model in the compute dtype "
                "there, and no frozen weight is stored or fetched")
        return inert
