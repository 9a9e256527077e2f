"""zero.Init over models built on the meta device (``with torch.device("meta")``, as Hugging Face does).

Each module is materialised when its constructor returns: real memory, values
from its ``reset_parameters()`` (the values a plain construction gives with the
same seed), then partitioned, to NVMe too. Meta parameters of modules without
``reset_parameters`` keep no values: ``zero.initialize`` refuses them by name
until a value is assigned, and an assigned value is partitioned at once.
"""
import os

import pytest
import torch
import torch.nn as nn

import zero
from zero.examples import GPT, GPTConfig


def torch_modules() -> nn.Module:
    return nn.Sequential(nn.Embedding(50, 16, padding_idx=0), nn.Linear(16, 24), nn.LayerNorm(24),
                         nn.Conv1d(24, 8, 3), nn.Linear(8, 4, bias=False))


def nvme_config(path) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0, "min_swap_bytes": 0}}}


@pytest.mark.parametrize("where", ["memory", "nvme"])
def test_meta_construction_gives_the_values_of_a_plain_one(tmp_path, where):
    torch.manual_seed(3)
    plain = torch_modules()
    config = nvme_config(tmp_path) if where == "nvme" else None
    torch.manual_seed(3)
    with zero.Init(config_dict_or_path=config), torch.device("meta"):
        model = torch_modules()
    assert all(p.numel() == 0 and not p.is_meta for p in model.parameters())
    assert all(p._zero_init_shard.on_nvme == (where == "nvme") for p in model.parameters())
    with zero.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert p.device.type == "cpu" and torch.equal(p, q), name
    assert torch.equal(torch.rand(4), (torch.manual_seed(3), torch_modules(), torch.rand(4))[2])  # same RNG use


def test_meta_parameters_without_reset_parameters_are_refused_by_name():
    with zero.Init(), torch.device("meta"):
        model = GPT(GPTConfig())
    assert model.pos.is_meta  # GPT sets pos in its constructor: the meta device kept no value
    assert not model.wte.weight.is_meta and model.head.weight is model.wte.weight
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=r"^1 parameter\(s\) are on the meta device and have no values: pos\. "
                                         r"zero.Init materialises meta parameters of modules with "
                                         r"reset_parameters\(\) only; load the values first "
                                         r"\(zero.load_pretrained\(model, checkpoint\)\) or build these "
                                         r"modules off the meta device$"):
        zero.initialize(model=model, config=config)


def test_a_value_assigned_after_construction_is_partitioned_at_once(tmp_path):
    c = GPTConfig()
    with zero.Init(config_dict_or_path=nvme_config(tmp_path)) as init:
        with torch.device("meta"):
            model = GPT(c)
        before = len(os.listdir(init.nvme_store.path))
        value = torch.randn(c.seq, c.d_model)
        model.pos = nn.Parameter(value.clone())
        assert len(os.listdir(init.nvme_store.path)) == before + 1
    assert model.pos.numel() == 0 and model.pos.ds_shape == (c.seq, c.d_model)
    with zero.GatheredParameters(model.pos):
        assert torch.equal(model.pos, value)
    config = nvme_config(tmp_path)
    engine, _, _, _ = zero.initialize(model=model, config=config)  # no meta parameter left
    engine.destroy()


def test_a_module_built_outside_the_context_is_left_alone():
    outside = nn.Linear(4, 4)
    with zero.Init():
        outside.weight = nn.Parameter(torch.ones(4, 4))
    assert outside.weight.numel() == 16 and not hasattr(outside.weight, "_zero_init_shard")
