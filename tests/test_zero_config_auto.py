"""zero.config: "auto" values, resolved from the hidden size or from known values."""

import pytest

from zero.config import ConfigError, DeepSpeedConfig, UnresolvedAutoError, load_config, resolve_auto
from zero.config.auto_rules import RULES
from zero.config.base import join

BUCKETS_AUTO = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                      "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"}}

FULL_AUTO = {
    **BUCKETS_AUTO,
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
}

KNOWN = dict(lr=2e-5, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, warmup_min_lr=0.0,
             warmup_num_steps=50, total_num_steps=1000, fp16=False, bf16=True,
             gradient_clipping=0.5, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)


@pytest.mark.parametrize("hidden", [64, 768, 4096, 12288])
def test_hidden_size_resolves_the_bucket_sizes(hidden):
    zero = load_config(BUCKETS_AUTO, hidden_size=hidden).zero_optimization
    assert zero.reduce_bucket_size == hidden * hidden
    assert zero.stage3_prefetch_bucket_size == int(0.9 * hidden * hidden)
    assert zero.stage3_param_persistence_threshold == 10 * hidden
    assert type(zero.stage3_prefetch_bucket_size) is int


def test_resolve_auto_with_hidden_size_gives_the_same_buckets():
    hidden = 2048
    late = resolve_auto(load_config(BUCKETS_AUTO), hidden_size=hidden)
    assert late == load_config(BUCKETS_AUTO, hidden_size=hidden)
    assert late.zero_optimization.reduce_bucket_size == hidden ** 2


def test_config_with_autos_loads_and_lists_them():
    config = load_config(FULL_AUTO)
    assert set(config.unresolved_autos()) == {
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "fp16.enabled", "bf16.enabled",
        "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
        "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps", "gradient_clipping"}
    assert config.model_dump()["optimizer"]["params"]["lr"] == "auto"


def test_reading_an_unresolved_auto_raises_naming_key_and_fix():
    config = load_config(FULL_AUTO)
    with pytest.raises(UnresolvedAutoError) as info:
        config.zero_optimization.reduce_bucket_size  # noqa: B018 - the read is the test
    message = str(info.value)
    assert "zero_optimization.reduce_bucket_size" in message
    assert "hidden_size=" in message and "resolve_auto" in message
    with pytest.raises(UnresolvedAutoError, match=r"optimizer\.params\.lr: still \"auto\"; pass lr="):
        config.optimizer.params.lr  # noqa: B018 - the read is the test
    with pytest.raises(UnresolvedAutoError, match=r"fp16\.enabled"):
        config.precision  # noqa: B018 - the read is the test
    assert issubclass(UnresolvedAutoError, ConfigError)
    # keys without "auto" read normally
    assert config.zero_optimization.stage == 3 and config.optimizer.type == "AdamW"


def test_resolve_auto_fills_everything_from_known_values():
    hidden, world = 1024, 4
    config = resolve_auto(load_config(FULL_AUTO, world_size=world), hidden_size=hidden,
                          world_size=world, **KNOWN)
    assert config.unresolved_autos() == []
    params = config.optimizer.params
    assert (params.lr, params.betas, params.eps, params.weight_decay) == (
        KNOWN["lr"], KNOWN["betas"], KNOWN["eps"], KNOWN["weight_decay"])
    scheduler = config.scheduler.params
    assert scheduler.warmup_max_lr == KNOWN["lr"]  # no warmup_max_lr given: the lr
    assert scheduler.total_num_steps == KNOWN["total_num_steps"]
    assert scheduler.warmup_num_steps == KNOWN["warmup_num_steps"]
    assert config.precision == "bf16" and config.gradient_clipping == KNOWN["gradient_clipping"]
    micro, accum = KNOWN["train_micro_batch_size_per_gpu"], KNOWN["gradient_accumulation_steps"]
    assert config.train_batch_size == micro * accum * world
    assert config.zero_optimization.stage3_param_persistence_threshold == 10 * hidden


def test_resolve_auto_returns_a_new_config():
    config = load_config(FULL_AUTO)
    resolve_auto(config, hidden_size=8, **KNOWN)
    assert config.is_auto("gradient_clipping") and len(config.unresolved_autos()) == 17


def test_unresolvable_autos_are_all_named_with_the_keyword_to_pass():
    with pytest.raises(UnresolvedAutoError) as info:
        resolve_auto(load_config(FULL_AUTO), lr=1e-4)
    problems = {p.path: p.message for p in info.value.problems}
    assert "optimizer.params.lr" not in problems
    assert "scheduler.params.warmup_max_lr" not in problems  # falls back to lr
    assert "pass betas=<value>" in problems["optimizer.params.betas"]
    assert "pass fp16=<value>" in problems["fp16.enabled"]
    assert "pass hidden_size=" in problems["zero_optimization.reduce_bucket_size"]
    assert "pass gradient_clipping=<value>" in problems["gradient_clipping"]
    # with no batch size known, none can be derived; the accumulation then defaults to 1
    assert "give two of train_batch_size" in problems["train_micro_batch_size_per_gpu"]
    assert "gradient_accumulation_steps" not in problems
    assert len(problems) == len(load_config(FULL_AUTO).unresolved_autos()) - 3


def test_a_batch_auto_is_derived_from_the_other_two():
    config = load_config({**BUCKETS_AUTO, "train_batch_size": "auto",
                          "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    resolved = resolve_auto(config, hidden_size=16, world_size=3)
    assert resolved.train_batch_size == 4 * 2 * 3


def test_a_batch_auto_that_cannot_be_derived_is_named():
    config = load_config({**BUCKETS_AUTO, "train_batch_size": "auto",
                          "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(UnresolvedAutoError) as info:
        resolve_auto(config, hidden_size=16)
    paths = [p.path for p in info.value.problems]
    assert paths == ["train_batch_size", "train_micro_batch_size_per_gpu"]
    assert "pass train_batch_size=<value>" in str(info.value)
    assert "give two of train_batch_size, train_micro_batch_size_per_gpu" in str(info.value)


def test_resolved_batch_sizes_are_checked_against_the_world_size():
    config = load_config({**BUCKETS_AUTO, "train_batch_size": 64,
                          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match=r"train_batch_size \(64\) must equal .* = 48"):
        resolve_auto(config, hidden_size=16, world_size=3, train_micro_batch_size_per_gpu=8)


def test_known_values_fill_autos_only():
    config = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 12345},
                          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    resolved = resolve_auto(config, hidden_size=4096, lr=5.0)
    assert resolved.optimizer.params.lr == 1e-3
    assert resolved.zero_optimization.reduce_bucket_size == 12345


def test_bad_known_value_is_reported_at_its_key():
    config = load_config({**BUCKETS_AUTO, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    with pytest.raises(ConfigError) as info:
        resolve_auto(config, hidden_size=8, lr=-1.0)
    assert str(info.value.problems[0]) == "optimizer.params.lr: must be at least 0, got -1"


def test_resolving_fp16_and_bf16_both_true_is_refused():
    config = load_config({**BUCKETS_AUTO, "fp16": {"enabled": "auto"}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        resolve_auto(config, hidden_size=8, fp16=True)


def test_unknown_known_value_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown keyword 'lrr'; did you mean 'lr'\?"):
        resolve_auto(load_config(BUCKETS_AUTO), hidden_size=8, lrr=1e-3)


@pytest.mark.parametrize("hidden", [0, -4, 1.5, True])
def test_hidden_size_must_be_a_positive_integer(hidden):
    with pytest.raises(ConfigError, match=rf"hidden_size: must be a positive integer, got {hidden!r}"):
        load_config(BUCKETS_AUTO, hidden_size=hidden)


def test_resolve_auto_needs_a_loaded_config():
    with pytest.raises(TypeError, match="load_config"):
        resolve_auto(BUCKETS_AUTO, hidden_size=8)


def _auto_keys(cls, path=""):
    keys = {join(path, name) for name in cls._auto_fields}
    for name in cls.model_fields:
        for child in cls.child_models(name):
            keys |= _auto_keys(child, join(path, name))
    return keys


def test_every_key_that_accepts_auto_has_a_rule_and_back():
    assert _auto_keys(DeepSpeedConfig) == {".".join(rule.path) for rule in RULES}
