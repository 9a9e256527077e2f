"""zero.config: deprecated keys map to their new names and warn, old -> new."""

import warnings

import pytest

from zero.config import ConfigDeprecationWarning, ConfigError, load_config


def load_warning(config):
    """The loaded config and the deprecation messages its load emitted."""
    with pytest.warns(ConfigDeprecationWarning) as record:
        loaded = load_config(config)
    return loaded, [str(w.message) for w in record if w.category is ConfigDeprecationWarning]


def test_deprecation_warning_is_a_user_warning_shown_by_default():
    # DeprecationWarning is hidden outside __main__; people editing configs must see this one.
    assert issubclass(ConfigDeprecationWarning, UserWarning)
    assert not issubclass(ConfigDeprecationWarning, DeprecationWarning)


def test_cpu_offload_becomes_offload_optimizer_on_cpu():
    config, messages = load_warning({"zero_optimization": {"stage": 3, "cpu_offload": True}})
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.zero_optimization.offload_param.device == "none"
    assert messages == ['zero_optimization.cpu_offload is deprecated; use '
                        'zero_optimization.offload_optimizer.device = "cpu" instead']


def test_cpu_offload_param_becomes_offload_param_on_cpu():
    config, messages = load_warning({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert config.zero_optimization.offload_param.device == "cpu"
    assert messages == ['zero_optimization.cpu_offload_param is deprecated; use '
                        'zero_optimization.offload_param.device = "cpu" instead']


def test_cpu_offload_false_offloads_nothing():
    config, _ = load_warning({"zero_optimization": {"stage": 3, "cpu_offload": False}})
    assert config.zero_optimization.offload_optimizer.device == "none"


def test_cpu_offload_use_pin_memory_sets_pin_memory_of_both_sections():
    config, messages = load_warning({"zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}})
    zero = config.zero_optimization
    assert zero.offload_param.pin_memory is True and zero.offload_optimizer.pin_memory is True
    assert ("zero_optimization.cpu_offload_use_pin_memory is deprecated; use "
            "zero_optimization.offload_param.pin_memory and "
            "zero_optimization.offload_optimizer.pin_memory instead") in messages
    assert len(messages) == 3


def test_cpu_offload_use_pin_memory_does_not_override_an_explicit_pin_memory():
    config, _ = load_warning({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
        "cpu_offload_use_pin_memory": True}})
    assert config.zero_optimization.offload_param.pin_memory is False


def test_gather_fp16_weights_becomes_gather_16bit_weights():
    config, messages = load_warning({"zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert messages == ["zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated; "
                        "use zero_optimization.stage3_gather_16bit_weights_on_model_save instead"]


@pytest.mark.parametrize("where", ["top", "zero_optimization"])
def test_aio_thread_count_becomes_intra_op_parallelism(where):
    aio = {"thread_count": 8, "queue_depth": 32}
    config = {"zero_optimization": {"stage": 3}}
    if where == "top":
        config["aio"] = aio
        prefix = "aio"
    else:
        config["zero_optimization"]["aio"] = aio
        prefix = "zero_optimization.aio"
    loaded, messages = load_warning(config)
    assert loaded.aio.intra_op_parallelism == 8
    assert messages == [f"{prefix}.thread_count is deprecated; use {prefix}.intra_op_parallelism instead"]


def test_old_and_new_name_with_different_values_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 3}, "aio": {"thread_count": 2, "intra_op_parallelism": 4}})
    assert info.value.problems[0].path == "aio.thread_count"
    assert ("'thread_count' and 'intra_op_parallelism' are both given, with different values (2 and 4)"
            in str(info.value))


def test_old_and_new_name_with_the_same_value_is_fine():
    config, _ = load_warning({"zero_optimization": {"stage": 3},
                              "aio": {"thread_count": 4, "intra_op_parallelism": 4}})
    assert config.aio.intra_op_parallelism == 4


def test_cpu_offload_conflicting_with_an_nvme_offload_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path)}}})
    assert info.value.problems[0].path == "zero_optimization.offload_optimizer.device"
    assert "'cpu_offload: true' asks for device 'cpu' but offload_optimizer.device is 'nvme'" in str(info.value)


@pytest.mark.parametrize("value, stage", [(True, 1), (False, 0)])
def test_boolean_zero_optimization_is_the_old_stage_form_and_refused(value, stage):
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": value})
    assert info.value.problems[0].path == "zero_optimization"
    assert (f'"zero_optimization": {str(value).lower()} is DeepSpeed\'s old form of ZeRO stage {stage}; '
            f'write "zero_optimization": {{"stage": {stage}}}') in str(info.value)


def test_unprefixed_stage3_names_and_bfloat16_are_silent_aliases():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config({"zero_optimization": {
            "stage": 3, "prefetch_bucket_size": 1e6, "param_persistence_threshold": 1e3,
            "max_live_parameters": 1e8, "max_reuse_distance": 1e7,
            "gather_16bit_weights_on_model_save": True}, "bfloat16": {"enabled": True}})
    zero = config.zero_optimization
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (10**6, 10**3, 10**8, 10**7)
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert config.precision == "bf16"


def test_warnings_point_at_the_caller_of_load_config():
    with pytest.warns(ConfigDeprecationWarning) as record:
        load_config({"zero_optimization": {"stage": 3, "cpu_offload": True}})
    assert record[0].filename == __file__
