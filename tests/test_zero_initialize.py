"""zero.initialize: what it returns, and every problem it checks, each with its message.

Config-file problems are tested in tests/test_zero_config*.py; these are the
checks that need the model, the script's optimizer or the real world size.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn

import zero
from zero.config import ConfigError, UnresolvedAutoError
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()


def problems(excinfo):
    return {p.path: p.message for p in excinfo.value.problems}


def test_returns_engine_optimizer_dataloader_scheduler_in_deepspeed_order(tmp_path):
    data = torch.utils.data.TensorDataset(torch.arange(20))
    config = base_config()
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    engine, optimizer, loader, scheduler = zero.initialize(model=GPT(CFG), config=config, training_data=data)
    assert isinstance(engine, zero.ZeroEngine) and optimizer is engine.optimizer
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert [len(b[0]) for b in loader] == [4] * 5
    assert scheduler is engine.lr_scheduler and engine.get_lr() == [0.0]  # WarmupLR starts at min lr
    assert engine.module.training
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training
    engine.destroy()


def test_optimizer_in_config_and_argument(tmp_path):
    model = GPT(CFG)
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=base_config())
    assert problems(e)["optimizer"] == ("an optimizer is given both in the config's optimizer section and as "
                                        "the optimizer argument of zero.initialize; keep one")


def test_untested_optimizer_needs_the_flag_and_then_runs_exactly(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    config = base_config()
    del config["optimizer"]
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert problems(e)["zero_allow_untested_optimizer"] == (
        "optimizer SGD is not Adam or AdamW, which the ZeRO optimizer implements; to step it on the "
        'partitions anyway (it must be elementwise) set "zero_allow_untested_optimizer": true')

    config["zero_allow_untested_optimizer"] = True
    config["gradient_clipping"] = 1.0
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = zero.initialize(model=model, optimizer=sgd, config=config)
    batches = make_batches(CFG, 5, 4)
    losses = train_engine(engine, batches, 5)
    engine.destroy()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in batches:
        loss = reference(x, y)
        expected.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    assert losses == expected


def test_untested_optimizer_with_nvme_optimizer_offload(tmp_path):
    model = GPT(CFG)
    config = base_config("none", "nvme", tmp_path)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert problems(e)["zero_optimization.offload_optimizer.device"].startswith(
        "'nvme' swaps the states of the ZeRO Adam optimizer only; a script's own SGD keeps its states in memory")


def test_bias_correction_false_is_refused():
    config = base_config()
    config["optimizer"]["params"]["bias_correction"] = False
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), config=config)
    assert problems(e)["optimizer.params.bias_correction"] == (
        "false is not supported: torch's fused Adam always corrects the bias; remove the key")


def test_train_batch_size_must_match_micro_times_accumulation_times_world_size():
    config = base_config(accumulation=2)
    config["train_batch_size"] = 6
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), config=config)
    assert problems(e)["train_batch_size"] == (
        "train_batch_size (6) must equal train_micro_batch_size_per_gpu (4) × gradient_accumulation_steps (2) "
        "× world_size (1) = 8")


def test_nvme_path_not_writable(tmp_path):
    if os.geteuid() == 0:
        path = "/proc/sys"  # not writable even by root: os.access says so, as for any user's 0500 directory
    else:
        path = str(tmp_path / "ro")
        os.mkdir(path, 0o500)
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), config=base_config("nvme", "none", path))
    assert problems(e)["zero_optimization.offload_param.nvme_path"] == (
        f"'{path}' is not writable by this user (uid {os.getuid()})")


def test_nvme_path_where_no_file_can_be_created(tmp_path, monkeypatch):
    # The engine also tries to create a file, which catches what access() cannot (read-only
    # mounts seen by root, full disks, quotas).
    import tempfile as tempfile_module

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile_module, "NamedTemporaryFile", refuse)
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), config=base_config("none", "nvme", tmp_path))
    assert problems(e)["zero_optimization.offload_optimizer.nvme_path"] == (
        f"cannot create a file in '{tmp_path}': Read-only file system")


def test_param_buffer_size_smaller_than_the_largest_partition(tmp_path):
    config = base_config("nvme", "cpu", tmp_path)
    config["zero_optimization"]["offload_param"]["buffer_size"] = 1000
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), config=config)
    largest = 3 * CFG.d_model * CFG.d_model + 3 * CFG.d_model  # a block's qkv Linear (or 4d x d MLP)
    largest = max(largest, 4 * CFG.d_model * CFG.d_model + 4 * CFG.d_model)
    assert problems(e)["zero_optimization.offload_param.buffer_size"] == (
        f"1000 elements is smaller than the largest parameter partition ({largest} elements, module "
        f"'blocks.0.fc' on this rank); each partition must fit one buffer: set buffer_size >= {largest}")


def test_unresolved_auto_names_the_key_and_how_to_fill_it():
    config = base_config()
    config["zero_optimization"]["reduce_bucket_size"] = "auto"
    with pytest.raises(UnresolvedAutoError) as e:
        zero.initialize(model=GPT(CFG), config=config)
    assert "zero_optimization.reduce_bucket_size" in problems(e)
    assert "pass hidden_size=<the model's hidden size>" in problems(e)["zero_optimization.reduce_bucket_size"]


def test_auto_values_come_from_the_model_and_the_scripts_optimizer():
    class WithConfig(GPT):
        pass

    model = WithConfig(CFG)
    model.config = type("HFConfig", (), {"hidden_size": 32})()
    config = base_config()
    del config["optimizer"]
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 3}}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    engine, _, _, scheduler = zero.initialize(model=model, optimizer=opt, config=config)
    assert engine.config.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * 32 * 32)
    assert scheduler.max_lrs == [3e-4]
    engine.destroy()


def test_model_parameters_must_belong_to_the_model():
    stranger = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ConfigError) as e:
        zero.initialize(model=GPT(CFG), model_parameters=[stranger], config=base_config())
    assert problems(e)["model_parameters"] == (
        "parameter group 0 holds a tensor of shape (3, 2) that is not a parameter of the model; pass "
        "model.parameters() or groups of them")


def test_a_config_is_required():
    with pytest.raises(ValueError, match=r"zero.initialize needs a config \(config=path or dict, or "
                                         r"args.deepspeed_config\)"):
        zero.initialize(model=GPT(CFG))


def test_param_groups_keep_their_own_settings(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, opt, _, _ = zero.initialize(model=model, model_parameters=groups, config=base_config(lr=1e-2))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    batches = make_batches(CFG, 5, 4)
    losses = train_engine(engine, batches, 5)
    engine.destroy()
    ref_groups = [{"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, fused=True)
    expected = []
    for x, y in batches:
        loss = reference(x, y)
        expected.append(loss.item())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert losses == expected
