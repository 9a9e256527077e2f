"""Keys accepted for DeepSpeed compatibility that change nothing here say so, once, by name;
``offload_optimizer.ratio`` (partial offload) is refused with the way out."""
import warnings

import pytest

from zero.config import ConfigError, IgnoredSettingWarning, load_config


def _messages(zero_extra, top=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"zero_optimization": {"stage": 3, **zero_extra}, **(top or {})})
    return [str(w.message) for w in caught if w.category is IgnoredSettingWarning]


@pytest.mark.parametrize("key, value", [
    ("allgather_bucket_size", 12345), ("contiguous_gradients", False), ("round_robin_gradients", True), ("reduce_scatter", False),
    ("allgather_partitions", False), ("ignore_unused_parameters", False), ("load_from_fp32_weights", False)])
def test_a_zero_key_without_effect_warns_naming_it(key, value):
    shown = "True" if value is True else "False" if value is False else str(value)
    assert _messages({key: value}) == [
        f"zero_optimization.{key} = {shown} is accepted for DeepSpeed compatibility but has no effect in nvmeio"]


def test_offload_and_top_level_keys_without_effect_warn():
    messages = _messages({"offload_optimizer": {"device": "cpu", "fast_init": True, "buffer_count": 8}},
                         {"prescale_gradients": True})
    assert sorted(m.split(" = ")[0] for m in messages) == [
        "prescale_gradients", "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init"]


def test_defaults_auto_and_the_bounds_nvmeio_honours_are_silent():
    assert _messages({"reduce_bucket_size": 12345, "overlap_comm": False}) == []
    assert _messages({"reduce_bucket_size": "auto", "overlap_comm": True, "contiguous_gradients": True,
                      "stage3_max_live_parameters": 10**6, "stage3_max_reuse_distance": 10**6,
                      "stage3_prefetch_bucket_size": 10**6}) == []


def test_partial_optimizer_offload_ratio_is_refused_with_the_way_out():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert info.value.problems[0].path == "zero_optimization.offload_optimizer.ratio"
    assert ("ratio = 0.3: partial optimizer offload (part of the optimizer step on the compute device) is "
            "not implemented in nvmeio; drop ratio to offload the whole optimizer, or set "
            "offload_optimizer.device to 'none'") in str(info.value)
    config = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.0}}})
    assert config.zero_optimization.offload_optimizer.ratio == 1.0


def test_node_local_storage_takes_effect_and_warns_nothing():
    """Implemented (zero/checkpoint/storage.py): neither value warns."""
    assert _messages({}, {"checkpoint": {"use_node_local_storage": True}}) == []
    assert _messages({}, {"checkpoint": {"use_node_local_storage": False}}) == []
