"""zero.config errors: each names its key path and the values, all reported at once."""

import json
import os

import pytest

from zero.config import ConfigError, IgnoredSettingWarning, load_config
from zero.config import offload

STAGE3 = {"zero_optimization": {"stage": 3}}


def problems_of(config, **kwargs):
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return info.value, {p.path: p.message for p in info.value.problems}


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("config, path, suggestion", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_cout": 5}}},
     "zero_optimization.offload_param.buffer_cout", "buffer_count"),
    ({**STAGE3, "gradient_clipp1ng": 1.0}, "gradient_clipp1ng", "gradient_clipping"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_paramters": 1e9}},
     "zero_optimization.stage3_max_live_paramters", "stage3_max_live_parameters"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    ({**STAGE3, "aio": {"queue_dept": 8}}, "aio.queue_dept", "queue_depth"),
    ({**STAGE3, "fp16": {"enabled": True, "loss_scale_windw": 100}},
     "fp16.loss_scale_windw", "loss_scale_window"),
    ({**STAGE3, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     "optimizer.params.weight_decy", "weight_decay"),
    ({**STAGE3, "scheduler": {"type": "WarmupDecayLR",
                              "params": {"total_num_steps": 10, "warmup_max_lrr": 1e-3}}},
     "scheduler.params.warmup_max_lrr", "warmup_max_lr"),
    ({**STAGE3, "checkpoint": {"use_node_local_storag": True}},
     "checkpoint.use_node_local_storag", "use_node_local_storage"),
    ({**STAGE3, "train_micro_batch_size_per_gpus": 4},
     "train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu"),
])
def test_misspelled_key_names_its_path_and_the_closest_key(config, path, suggestion):
    error, problems = problems_of(config)
    assert problems[path] .startswith("unknown key")
    assert f"did you mean '{suggestion}'?" in problems[path]
    assert f"{path}: unknown key" in str(error)


def test_all_problems_are_reported_in_one_error():
    error, problems = problems_of({
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_cout": 5},
                              "reduce_bucket_size": 0.5},
        "fp16": {"enabled": "yes"},
        "gradient_clipp1ng": 1.0,
        "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}},
    })
    assert set(problems) == {"zero_optimization.offload_param.buffer_cout",
                             "zero_optimization.reduce_bucket_size", "fp16.enabled",
                             "gradient_clipp1ng", "optimizer.params.betas"}
    assert str(error).count("\n  - ") == 5
    assert "expected true or false, got 'yes'" in problems["fp16.enabled"]
    assert "expected two numbers [beta1, beta2], got [0.9]" in problems["optimizer.params.betas"]


def test_consistency_problems_of_different_sections_come_together(tmp_path):
    _, problems = problems_of({
        "zero_optimization": {"stage": 4, "offload_optimizer": {"device": "nvme"}},
        "optimizer": {"type": "Lamb"}})
    assert set(problems) == {"zero_optimization.stage", "zero_optimization.offload_optimizer.nvme_path",
                             "optimizer.type"}


def test_key_in_the_wrong_section_says_where_it_belongs():
    _, problems = problems_of({**STAGE3, "offload_param": {"device": "cpu"},
                               "optimizer": {"type": "Adam", "lr": 1e-3}})
    assert "'offload_param' is a key of zero_optimization" in problems["offload_param"]
    assert "'lr' is a key of optimizer.params" in problems["optimizer.lr"]


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    _, problems = problems_of({**STAGE3, "bf16": {"enabled": True, "xyz": 1}})
    assert problems["bf16.xyz"] == ("unknown key (known keys: check_grad_overflow, enabled, "
                                    "immediate_grad_update)")


@pytest.mark.parametrize("stage", [4, 5])
def test_a_stage_beyond_3_is_refused(stage):
    error, problems = problems_of({"zero_optimization": {"stage": stage}})
    assert problems["zero_optimization.stage"] == f"ZeRO stages are 0, 1, 2 and 3 (got {stage})"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_loads(stage):
    assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.stage == stage


def test_a_config_without_zero_section_is_stage_0_as_in_deepspeed():
    assert load_config({"train_batch_size": 8}).zero_optimization.stage == 0
    _, problems = problems_of({"train_batch_size": 8, "fp16": {"enabled": "maybe"}})
    assert set(problems) == {"fp16.enabled"}


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_optimizer_needs_stage_1_or_more(device, tmp_path):
    _, problems = problems_of({"zero_optimization": {"stage": 0, "offload_optimizer": {
        "device": device, "nvme_path": str(tmp_path)}}})
    assert problems["zero_optimization.offload_optimizer"] == (
        f"offload_optimizer (device '{device}') needs ZeRO stage 1, 2 or 3 (the optimizer states it moves are "
        f"partitioned from stage 1 on), but zero_optimization.stage is 0")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_keys_warn_below_stage_3(stage):
    with pytest.warns(IgnoredSettingWarning) as seen:
        load_config({"zero_optimization": {"stage": stage, "stage3_max_live_parameters": 10,
                                           "stage3_prefetch_bucket_size": 5}})
    messages = sorted(str(w.message) for w in seen if issubclass(w.category, IgnoredSettingWarning))
    assert messages == [
        "zero_optimization.stage3_max_live_parameters = 10 has no effect below ZeRO stage 3",
        "zero_optimization.stage3_prefetch_bucket_size = 5 has no effect below ZeRO stage 3"]


def test_offload_param_needs_stage_3():
    _, problems = problems_of({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme",
                                                                                   "nvme_path": "/"}}})
    assert problems["zero_optimization.offload_param"] == (
        "offload_param (device 'nvme') needs ZeRO stage 3, but zero_optimization.stage is 2")


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_device_needs_nvme_path(section):
    _, problems = problems_of({"zero_optimization": {"stage": 3, section: {"device": "nvme"}}})
    message = problems[f"zero_optimization.{section}.nvme_path"]
    assert "device is 'nvme' but nvme_path is not set" in message
    assert f"zero_optimization.{section}.nvme_path" in message


def test_nvme_path_that_does_not_exist_is_named_and_not_created(tmp_path):
    missing = tmp_path / "not_there" / "swap"
    _, problems = problems_of({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(missing)}}})
    message = problems["zero_optimization.offload_param.nvme_path"]
    assert f"'{missing}' does not exist" in message and f"mkdir -p {missing}" in message
    assert not missing.parent.exists()


def test_nvme_path_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "swapfile"
    file.write_text("")
    _, problems = problems_of({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(file)}}})
    assert problems["zero_optimization.offload_optimizer.nvme_path"] == f"'{file}' is not a directory"


def test_nvme_path_not_writable_is_refused(tmp_path, monkeypatch):
    # os.access is patched: the suite may run as root, for whom every directory is writable.
    real_access = os.access
    monkeypatch.setattr(offload.os, "access",
                        lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    _, problems = problems_of({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    assert f"'{tmp_path}' is not writable by this user" in problems["zero_optimization.offload_param.nvme_path"]


def test_nvme_path_is_accepted_as_a_pathlike(tmp_path):
    config = load_config({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": tmp_path}}})
    assert config.zero_optimization.offload_param.nvme_path == str(tmp_path)


def test_fp16_and_bf16_both_enabled_is_refused():
    _, problems = problems_of({**STAGE3, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert problems["bf16.enabled"] == "fp16.enabled and bf16.enabled are both true; enable at most one"


@pytest.mark.parametrize("count", [1, 2, 3])
def test_too_few_optimizer_buffers_for_nvme_explains_why(tmp_path, count):
    _, problems = problems_of({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": count}}})
    message = problems["zero_optimization.offload_optimizer.buffer_count"]
    assert f"buffer_count = {count} is too small for device 'nvme'" in message
    assert "at least 4" in message and "exp_avg" in message


def test_three_optimizer_buffers_are_fine_on_cpu():
    config = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "buffer_count": 3}}})
    assert config.zero_optimization.offload_optimizer.buffer_count == 3


def test_unknown_optimizer_type_lists_the_supported_ones():
    _, problems = problems_of({**STAGE3, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    assert problems["optimizer.type"] == "optimizer type 'Lamb' is not supported (supported: Adam, AdamW)"


def test_unknown_scheduler_type_lists_the_supported_ones_and_the_closest():
    _, problems = problems_of({**STAGE3, "scheduler": {"type": "WarmupDecay"}})
    message = problems["scheduler.type"]
    assert "'WarmupDecay' is not supported" in message
    assert "supported: WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest" in message
    assert "did you mean 'WarmupDecayLR'?" in message


def test_required_scheduler_params_are_named():
    _, problems = problems_of({**STAGE3, "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}})
    assert problems == {"scheduler.params.cycle_min_lr": "required key is missing"}


def test_offload_device_must_be_known():
    _, problems = problems_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}})
    assert problems["zero_optimization.offload_param.device"] == (
        "device 'disk' is not supported (supported: none, cpu, nvme)")


@pytest.mark.parametrize("micro, accum, world", [(4, 2, 2), (3, 5, 1), (2, 2, 8)])
def test_batch_size_mismatch_shows_the_product(micro, accum, world):
    train = micro * accum * world + 1
    _, problems = problems_of({**STAGE3, "train_batch_size": train,
                               "train_micro_batch_size_per_gpu": micro,
                               "gradient_accumulation_steps": accum}, world_size=world)
    assert problems["train_batch_size"] == (
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) × "
        f"gradient_accumulation_steps ({accum}) × world_size ({world}) = {micro * accum * world}")


def test_batch_size_that_cannot_be_split_is_refused():
    _, problems = problems_of({**STAGE3, "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
                              world_size=2)
    assert problems["train_batch_size"] == (
        "train_batch_size (30) is not a multiple of train_micro_batch_size_per_gpu (4) × "
        "world_size (2) = 8, so gradient_accumulation_steps cannot be derived")
    _, problems = problems_of({**STAGE3, "train_batch_size": 9}, world_size=2)
    assert "train_batch_size (9) is not a multiple of world_size (2)" in problems["train_batch_size"]


@pytest.mark.parametrize("key, value, text", [
    ("train_batch_size", 0, "must be at least 1, got 0"),
    ("gradient_clipping", -1.0, "must be at least 0, got -1"),
    ("gradient_clipping", "1.0", "expected a number, got '1.0'"),
])
def test_out_of_range_values_name_key_and_value(key, value, text):
    _, problems = problems_of({**STAGE3, key: value})
    assert problems[key] == text


def test_auto_where_no_rule_fills_it_is_refused():
    _, problems = problems_of({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}})
    assert problems["zero_optimization.sub_group_size"] == (
        "'auto' is not accepted for this key; give a value")


def test_section_given_as_a_non_object():
    _, problems = problems_of({**STAGE3, "fp16": True})
    assert problems["fp16"] == "expected a JSON object (a section of keys), got True"


def test_world_size_must_be_positive():
    _, problems = problems_of(STAGE3, world_size=0)
    assert problems == {"world_size": "must be a positive integer, got 0"}


def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "line 2" in str(info.value)


def test_duplicated_json_key_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].path == "stage"
    assert "appears twice in the same JSON object" in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stag": 3}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"invalid DeepSpeed config {path}: zero_optimization.stag")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.json")


def test_wrong_stage_is_reported_with_the_other_problems_of_its_section():
    _, problems = problems_of({"zero_optimization": {
        "stage": 7, "offload_param": {"device": "cpu", "buffer_cout": 1}, "overlap_comm": "x"}})
    assert set(problems) == {"zero_optimization.stage", "zero_optimization.offload_param.buffer_cout",
                             "zero_optimization.overlap_comm"}
    assert "did you mean 'buffer_count'?" in problems["zero_optimization.offload_param.buffer_cout"]
    assert problems["zero_optimization.stage"] == "ZeRO stages are 0, 1, 2 and 3 (got 7)"


def test_aio_given_twice_with_different_values_is_refused():
    _, problems = problems_of({"zero_optimization": {"stage": 3, "aio": {"queue_depth": 32}},
                               "aio": {"queue_depth": 64}})
    assert problems["aio"] == ("aio is given both at the top level ({'queue_depth': 64}) and in "
                               "zero_optimization ({'queue_depth': 32}) with different values; keep one")


@pytest.mark.parametrize("section, message", [
    ("amp", 'NVIDIA Apex AMP is not supported by this engine; use fp16 / bf16 instead ("bf16": {"enabled": true}, '
            'or "fp16": {"enabled": true} with its loss scaling)'),
    ("pipeline", "pipeline parallelism is not supported by this engine: every rank holds the whole model "
                 "(partitioned by ZeRO); remove the section"),
    ("tensor_parallel", "tensor parallelism (AutoTP) is not supported by this engine: every rank holds the whole "
                        "model (partitioned by ZeRO); remove the section"),
    ("sparse_attention", "DeepSpeed's sparse attention kernels are not supported by this engine; remove the "
                         "section (the model's own attention runs)"),
])
def test_a_section_of_a_deepspeed_feature_this_engine_lacks_says_so(section, message):
    _, problems = problems_of({**STAGE3, section: {"enabled": True}})
    assert problems == {section: message}  # not a did-you-mean to a key of another meaning
