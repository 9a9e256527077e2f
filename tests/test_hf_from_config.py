"""A transformers model built from its config in ``zero.Init`` gets the values it gets without it.

GPT-2 and Llama (tiny configs), built with the same seed by ``AutoModelForCausalLM.from_config``
inside ``zero.Init`` (memory or NVMe slices), under a stage-3 ``HfDeepSpeedConfig``, or as
``Model(config)`` inside ``zero.Init``, and on two ranks: every parameter equals the plain
``from_config``'s and the random number stream continues where the plain one does (the torch
initialisers run as modules are built, then ``post_init``'s ``_init_weights`` on gathered
slices: zero/partitioning/hf_hook.py). With only an engine active, ``from_config`` builds whole,
as without ZeRO.
"""
import pytest
import torch

import zero

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')
from transformers import AutoModelForCausalLM

from zero.examples import GPT, GPTConfig
from zero.hf import HfDeepSpeedConfig
from helpers import base_config, run_ranks

STAGE_3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def config_of(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        bos_token_id=1, eos_token_id=2)
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                   eos_token_id=2)  # tied head


def plain(kind: str):
    """(the plain from_config's state_dict, the next random number after building it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(kind))
    return model.state_dict(), torch.rand(4)


def gathered(model) -> dict:
    with zero.GatheredParameters(list(model.parameters())):
        return {name: t.detach().clone() for name, t in model.state_dict().items()}


def nvme_init_config(path) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0, "min_swap_bytes": 0}}}


def build(kind: str, how: str, path):
    torch.manual_seed(0)
    if how == "from_config in Init":
        with zero.Init(config_dict_or_path=STAGE_3):
            return AutoModelForCausalLM.from_config(config_of(kind))
    if how == "from_config in Init on NVMe":
        with zero.Init(config_dict_or_path=nvme_init_config(path)):
            return AutoModelForCausalLM.from_config(config_of(kind))
    if how == "Model(config) in Init":
        cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
        with zero.Init(config_dict_or_path=STAGE_3):
            return cls(config_of(kind))
    dschf = HfDeepSpeedConfig(STAGE_3)  # noqa: F841 - alive while the model is built
    return AutoModelForCausalLM.from_config(config_of(kind))


@pytest.mark.parametrize("how", ["from_config in Init", "from_config in Init on NVMe", "Model(config) in Init",
                                 "from_config under HfDeepSpeedConfig"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_built_partitioned_with_the_plain_values(tmp_path, kind, how):
    expected, next_random = plain(kind)
    model = build(kind, how, tmp_path)
    assert torch.equal(torch.rand(4), next_random)  # the stream went on as without ZeRO
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    if "NVMe" in how:
        assert all(p._zero_init_shard.on_nvme for p in model.parameters())
    got = gathered(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied after the init, as plainly


def test_with_only_an_engine_active_from_config_builds_whole():
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=base_config())
    assert transformers.integrations.is_deepspeed_zero3_enabled()
    expected, next_random = plain("gpt2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of("gpt2"))
    assert torch.equal(torch.rand(4), next_random)
    assert not any(hasattr(p, "ds_numel") for p in model.parameters())
    assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())
    engine.destroy()


def scenario_from_config(rank, world_size, scratch):
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=STAGE_3):
        model = AutoModelForCausalLM.from_config(config_of("gpt2"))
    after = torch.rand(4)
    path = f"{scratch}/rank{rank}.pt"
    torch.save({"weights": gathered(model), "after": after}, path)
    return path


def test_on_two_ranks_each_rank_gets_the_plain_values(tmp_path):
    expected, next_random = plain("gpt2")
    results = run_ranks(2, [("from_config", scenario_from_config, {})], tmp_path, timeout=300)
    for rank, result in enumerate(results):
        assert not isinstance(result["from_config"], dict), result["from_config"]["error"]
        saved = torch.load(result["from_config"])
        assert torch.equal(saved["after"], next_random), rank  # every rank ran the initialisers
        for name, value in expected.items():
            assert torch.equal(saved["weights"][name], value), (rank, name)
