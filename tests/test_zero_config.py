"""zero.config: loading, value conversion, defaults, and what the engine reads."""

import copy
import json
import sys
import warnings

import pydantic
import pytest

from helpers import run_process
from zero.config import (AioConfig, ConfigError, DeepSpeedConfig, IgnoredSettingWarning,
                         OffloadOptimizerConfig, OffloadParamConfig, load_config)

STAGE3 = {"zero_optimization": {"stage": 3}}


def with_zero(**zero):
    return {"zero_optimization": {"stage": 3, **zero}}


def test_dict_is_not_mutated():
    config = {"zero_optimization": {"stage": 3, "cpu_offload": True,
                                    "aio": {"thread_count": 2}},
              "bfloat16": {"enabled": True}, "train_batch_size": 8}
    before = copy.deepcopy(config)
    with pytest.warns(UserWarning):
        load_config(config, world_size=2)
    assert config == before


def test_path_and_dict_give_the_same_config(tmp_path):
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e6},
              "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert load_config(path) == load_config(config) == load_config(str(path))


@pytest.mark.parametrize("written, expected", [(1e9, 10**9), (0.94e6, 940_000), (5e8, 500_000_000),
                                               (1e4, 10_000), (7, 7)])
def test_integral_float_becomes_int(written, expected):
    zero = load_config(with_zero(stage3_max_live_parameters=written)).zero_optimization
    assert zero.stage3_max_live_parameters == expected
    assert type(zero.stage3_max_live_parameters) is int


def test_float_for_an_int_key_everywhere_in_the_tree(tmp_path):
    config = load_config({
        "zero_optimization": {"stage": 3.0, "sub_group_size": 1e8,
                              "offload_param": {"device": "cpu", "buffer_count": 5.0,
                                                "buffer_size": 1e8, "max_in_cpu": 1e9},
                              "offload_optimizer": {"device": "cpu", "buffer_count": 4.0}},
        "aio": {"block_size": 1.048576e6, "queue_depth": 3.2e1},
        "train_batch_size": 1.6e1, "train_micro_batch_size_per_gpu": 4.0})
    zero = config.zero_optimization
    values = [zero.stage, zero.sub_group_size, zero.offload_param.buffer_count,
              zero.offload_param.buffer_size, zero.offload_param.max_in_cpu,
              zero.offload_optimizer.buffer_count, config.aio.block_size, config.aio.queue_depth,
              config.train_batch_size, config.train_micro_batch_size_per_gpu]
    assert values == [3, 10**8, 5, 10**8, 10**9, 4, 1048576, 32, 16, 4]
    assert all(type(v) is int for v in values)


def test_fractional_float_for_an_int_key_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config(with_zero(sub_group_size=2.5e-1))
    assert "zero_optimization.sub_group_size" in str(info.value)
    assert "expected a whole number, got 0.25" in str(info.value)


def test_bucket_sizes_computed_by_formula_are_rounded_down():
    # The Hugging Face docs' ZeRO-Inference config writes 0.9 * hidden_size * hidden_size.
    zc = load_config(with_zero(stage3_prefetch_bucket_size=0.9 * 1024 * 1024, reduce_bucket_size=1024.5,
                               stage3_param_persistence_threshold=10.7)).zero_optimization
    assert (zc.stage3_prefetch_bucket_size, zc.reduce_bucket_size, zc.stage3_param_persistence_threshold) == \
        (943718, 1024, 10)
    with pytest.raises(ConfigError, match=r"zero_optimization.reduce_bucket_size: must be at least 1, got 0"):
        load_config(with_zero(reduce_bucket_size=0.25))


@pytest.mark.parametrize("value", [True, "1e9", "500", None])
def test_bool_string_or_null_is_not_a_count(value):
    with pytest.raises(ConfigError, match=r"zero_optimization\.sub_group_size: expected a whole number"):
        load_config(with_zero(sub_group_size=value))


def test_boolean_strings_from_the_tuner_are_booleans():
    # ds_nvme_tune prints "single_submit": "false"; users paste that block.
    config = load_config({**STAGE3, "aio": {"single_submit": "false", "overlap_events": "TRUE",
                                            "use_gds": 0}})
    assert config.aio.single_submit is False
    assert config.aio.overlap_events is True
    assert config.aio.use_gds is False


def test_reference_defaults():
    config = load_config(with_zero(offload_param={"device": "nvme", "nvme_path": "/"},
                                   offload_optimizer={"device": "cpu"}))
    param = config.zero_optimization.offload_param
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 10**8, 10**9)
    optimizer = config.zero_optimization.offload_optimizer
    assert (optimizer.buffer_count, optimizer.ratio, optimizer.pipeline) == (4, 1.0, False)
    assert config.aio.model_dump() == {"block_size": 1048576, "queue_depth": 8,
                                       "intra_op_parallelism": 1, "single_submit": False,
                                       "overlap_events": True, "use_gds": False, "backend": "auto"}
    fp16 = config.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.loss_scale_window, fp16.initial_scale_power,
            fp16.hysteresis, fp16.min_loss_scale) == (False, 0.0, 1000, 16, 2, 1.0)
    zero = config.zero_optimization
    assert (zero.sub_group_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold, zero.stage3_max_live_parameters,
            zero.stage3_max_reuse_distance, zero.reduce_bucket_size,
            zero.allgather_bucket_size) == (10**9, 5 * 10**7, 10**5, 10**9, 10**9, 5 * 10**8, 5 * 10**8)
    assert zero.overlap_comm and zero.contiguous_gradients and zero.reduce_scatter
    assert zero.allgather_partitions and not zero.stage3_gather_16bit_weights_on_model_save
    assert config.optimizer is None and config.scheduler is None
    assert config.gradient_clipping == 0.0 and config.precision == "fp32"


def test_config_is_frozen():
    config = load_config(STAGE3)
    with pytest.raises(pydantic.ValidationError):
        config.zero_optimization.stage = 2


def test_every_stage3_key_of_deepspeed_is_accepted():
    zero = {"stage": 3, "contiguous_gradients": True, "reduce_scatter": True,
            "reduce_bucket_size": 5e8, "allgather_partitions": True, "allgather_bucket_size": 5e8,
            "overlap_comm": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
            "offload_param": None, "offload_optimizer": None, "sub_group_size": 1e9,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
            "stage3_model_persistence_threshold": sys.maxsize, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": False,
            "stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": False,
            "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
            "use_multi_rank_bucket_allreduce": True, "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
            "zero_quantized_gradients": False, "mics_shard_size": -1,
            "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
            "pipeline_loading_checkpoint": False, "override_module_apply": True,
            "log_trace_cache_warnings": False,
            "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                    "single_submit": False, "overlap_events": True, "use_gds": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all at their defaults: nothing to warn about
        config = load_config({"zero_optimization": zero})
    assert not config.zero_optimization.offload_param.enabled
    assert not config.zero_optimization.offload_optimizer.enabled


def test_harmless_top_level_sections_are_accepted():
    config = load_config({
        **STAGE3, "prescale_gradients": False, "gradient_predivide_factor": 2.0,
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
        "communication_data_type": "bfp16", "steps_per_print": 100, "wall_clock_breakdown": True,
        "dump_state": False, "memory_breakdown": False,
        "checkpoint": {"use_node_local_storage": True, "tag_validation": "fail"},
        "data_types": {"grad_accum_dtype": "fp32"},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
        "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1,
                           "top_modules": 1, "detailed": True, "output_file": None},
        "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "run"},
        "wandb": {"enabled": False, "project": "p"},
        "csv_monitor": {"enabled": False, "output_path": "csv/", "job_name": "run"},
        "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False}})
    assert config.communication_data_type == "bf16"
    assert config.checkpoint.use_node_local_storage is True
    assert config.checkpoint.tag_validation == "Fail"
    assert config.gradient_predivide_factor == 2.0 and config.wall_clock_breakdown is True


def test_enabling_a_feature_nvmeio_lacks_warns_and_names_the_key():
    with pytest.warns(IgnoredSettingWarning) as record:
        load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                     "tensorboard": {"enabled": True}})
    messages = [str(w.message) for w in record]
    assert any("zero_optimization.zero_quantized_weights = True" in m for m in messages)
    assert any("tensorboard.enabled = True" in m and "no effect in nvmeio" in m for m in messages)


def test_aio_inside_zero_optimization_is_read_at_config_aio():
    config = load_config(with_zero(aio={"queue_depth": 64, "intra_op_parallelism": 4}))
    assert config.aio.queue_depth == 64 and config.aio.intra_op_parallelism == 4
    assert config.aio.handle_kwargs() == {"block_size": 1048576, "queue_depth": 64,
                                          "single_submit": False, "overlap_events": True,
                                          "intra_op_parallelism": 4, "backend": "auto"}


def test_aio_given_twice_with_the_same_values_is_fine():
    aio = {"block_size": 262144, "queue_depth": 32}
    config = load_config({**with_zero(aio=aio), "aio": aio})
    assert config.aio.block_size == 262144


def test_aio_backend_choice_is_checked():
    assert load_config({**STAGE3, "aio": {"backend": "IO_URING"}}).aio.backend == "io_uring"
    with pytest.raises(ConfigError) as info:
        load_config({**STAGE3, "aio": {"backend": "uring"}})
    assert "aio.backend" in str(info.value) and "did you mean 'io_uring'?" in str(info.value)


def test_optimizer_type_is_case_insensitive_and_canonical():
    config = load_config({**STAGE3, "optimizer": {"type": "adamw", "params": {"lr": 1e-4}}})
    assert config.optimizer.type == "AdamW" and config.optimizer.decoupled_weight_decay
    adam = load_config({**STAGE3, "optimizer": {"type": "ADAM"}}).optimizer
    assert adam.type == "Adam" and adam.decoupled_weight_decay  # DeepSpeed's adam_w_mode default
    plain = load_config({**STAGE3, "optimizer": {"type": "Adam",
                                                 "params": {"adam_w_mode": False}}}).optimizer
    assert not plain.decoupled_weight_decay


def test_optimizer_params_accept_deepspeed_extras():
    params = load_config({**STAGE3, "optimizer": {"type": "Adam", "params": {
        "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "adam_w_mode": True,
        "torch_adam": True, "amsgrad": False, "bias_correction": True}}}).optimizer.params
    assert params.betas == (0.9, 0.95) and params.torch_adam is True


@pytest.mark.parametrize("kind, params, check", [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1e3,
                  "warmup_type": "linear"}, ("warmup_num_steps", 1000)),
    ("WarmupDecayLR", {"total_num_steps": 1e4, "warmup_num_steps": 100}, ("total_num_steps", 10000)),
    ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 1e3},
     ("cycle_first_step_size", 1000)),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_staircase": True},
     ("lr_range_test_staircase", True)),
])
def test_each_scheduler_type_validates_its_own_params(kind, params, check):
    scheduler = load_config({**STAGE3, "scheduler": {"type": kind, "params": params}}).scheduler
    assert scheduler.type == kind
    assert getattr(scheduler.params, check[0]) == check[1]


def test_scheduler_params_of_another_type_are_unknown_keys():
    with pytest.raises(ConfigError) as info:
        load_config({**STAGE3, "scheduler": {"type": "WarmupLR",
                                             "params": {"cycle_min_lr": 0.1, "warmup_num_steps": 10}}})
    assert "scheduler.params.cycle_min_lr: unknown key" in str(info.value)
    assert len(info.value.problems) == 1


def test_scheduler_without_params_uses_the_type_defaults():
    assert load_config({**STAGE3, "scheduler": {"type": "WarmupLR"}}).scheduler.params.warmup_num_steps == 1000


def test_offload_pipeline_turns_on_read_and_write():
    optimizer = load_config(with_zero(offload_optimizer={"device": "cpu", "pipeline": True})
                            ).zero_optimization.offload_optimizer
    assert optimizer.pipeline_read and optimizer.pipeline_write and optimizer.pipeline
    only_read = load_config(with_zero(offload_optimizer={"device": "cpu", "pipeline_read": True})
                            ).zero_optimization.offload_optimizer
    assert only_read.pipeline and not only_read.pipeline_write
    read_off = load_config(with_zero(offload_optimizer={"device": "cpu", "pipeline": True,
                                                        "pipeline_read": False})
                           ).zero_optimization.offload_optimizer
    assert read_off.pipeline_write and not read_off.pipeline_read and read_off.pipeline


@pytest.mark.parametrize("section, message", [
    ({"pipeline": True, "pipeline_read": False, "pipeline_write": False},
     "pipeline is true but pipeline_read and pipeline_write are both false"),
    ({"pipeline": False, "pipeline_write": True}, "pipeline is false but pipeline_write is true"),
])
def test_contradicting_pipeline_keys_are_refused(section, message):
    with pytest.raises(ConfigError) as info:
        load_config(with_zero(offload_optimizer={"device": "cpu", **section}))
    assert info.value.problems[0].path == "zero_optimization.offload_optimizer.pipeline"
    assert message in str(info.value)


@pytest.mark.parametrize("given, world", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2),
    ({"train_batch_size": 24}, 3),
    ({"train_micro_batch_size_per_gpu": 5}, 2),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 4),
])
def test_missing_batch_size_is_derived(given, world):
    config = load_config({**STAGE3, **given}, world_size=world)
    train, micro, accum = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                           config.gradient_accumulation_steps)
    assert train == micro * accum * world
    for key, value in given.items():
        assert getattr(config, key) == value
    if len(given) == 1:  # one size given: one accumulation step, as in DeepSpeed
        assert accum == 1


def test_reloading_a_config_for_another_world_size_derives_again():
    config = load_config({**STAGE3, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert config.gradient_accumulation_steps == 8
    assert load_config(config, world_size=4).gradient_accumulation_steps == 2


def test_sections_can_be_built_alone():
    assert OffloadParamConfig(device="cpu", buffer_size=1e6).buffer_size == 10**6
    assert OffloadOptimizerConfig().device == "none"
    assert AioConfig(block_size=4096).block_size == 4096
    assert isinstance(load_config(STAGE3), DeepSpeedConfig)


def test_importing_the_config_layer_pulls_in_neither_torch_nor_numpy():
    # It reads nvmeio's settings type and did-you-mean, which import neither.
    code = ("import sys, zero, zero.config; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = run_process([sys.executable, "-c", code], check=True)
    assert out.stdout.strip() == "[]"


def test_a_dumped_config_loads_back_to_the_same_config(tmp_path):
    with pytest.warns(UserWarning):  # aio.thread_count
        config = load_config({"zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "cpu", "pipeline": True}, "aio": {"thread_count": 2}},
            "fp16": {"enabled": True}, "optimizer": {"type": "adam"},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}},
            "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_config(json.loads(config.model_dump_json()), world_size=2)
    assert again == config
    assert again.gradient_accumulation_steps == 4 and again.aio.intra_op_parallelism == 2
