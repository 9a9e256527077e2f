"""Hugging Face ``from_pretrained`` under zero.Init, and ``zero.hf.HfDeepSpeedConfig``.

GPT-2 and Llama built from small configs and saved with ``save_pretrained``
(local directories, no hub) load straight into partitions, NVMe included, and
give the plain model's logits and ``generate`` output through the engine.
"""
import gc

import pytest
import torch

import zero

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')
from zero.hf import HfDeepSpeedConfig, check_transformers_version

VOCAB = 96


def small(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)  # tied head


@pytest.fixture(params=["gpt2", "llama"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    small(request.param).save_pretrained(path, max_shard_size="100KB")  # several shards and an index
    return request.param, path


def inference_config(tmp_path, device="nvme") -> dict:
    """The Hugging Face docs' ZeRO-Inference shape: no optimizer, no scheduler."""
    param = {"device": device}
    if device == "nvme":
        param.update(nvme_path=str(tmp_path), max_in_cpu=0, min_swap_bytes=0)
    return {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": False},
            "zero_optimization": {"stage": 3, "offload_param": param, "stage3_param_persistence_threshold": 0}}


def cls_of(kind):
    return transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel


def check_same_outputs(engine, model, plain):
    x = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(engine(x).logits, plain(x).logits)
    prompt = x[:1, :5]
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("device", ["nvme", "none"])
def test_from_pretrained_under_init_gives_the_plain_logits(tmp_path, saved, device):
    kind, path = saved
    plain = cls_of(kind).from_pretrained(path)
    config = inference_config(tmp_path, device)
    with zero.Init(config_dict_or_path=config) as init:
        model = cls_of(kind).from_pretrained(path)
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    if device == "nvme":
        assert all(p._zero_init_shard.on_nvme for p in model.parameters())
        assert init.nvme_store.files == len(list(model.parameters()))
    engine, optimizer, _, _ = zero.initialize(model=model, config=config)
    assert optimizer is None
    check_same_outputs(engine, model, plain)
    engine.destroy()


def test_hf_deepspeed_config_kept_alive(tmp_path, saved):
    kind, path = saved
    plain = cls_of(kind).from_pretrained(path)
    config = inference_config(tmp_path)
    dschf = HfDeepSpeedConfig(config)  # kept alive, as with DeepSpeed
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert all(p.numel() == 0 for p in model.parameters())
    engine, _, _, _ = zero.initialize(model=model, config=config)
    check_same_outputs(engine, model, plain)
    engine.destroy()
    del dschf
    again = cls_of(kind).from_pretrained(path)
    assert all(p.numel() > 0 for p in again.parameters())


def test_hf_deepspeed_config_below_stage_3_leaves_from_pretrained_alone(tmp_path):
    # HF's guide's stage-2 config: transformers' zero3 branches are not taken, models load whole.
    import os

    small("gpt2").save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    gc.collect()  # an engine an earlier test dropped keeps transformers' flag on until it is collected
    before = transformers.integrations.is_deepspeed_zero3_enabled()
    dschf = HfDeepSpeedConfig(os.path.join(os.path.dirname(__file__), "data", "ds_config_zero2_auto.json"))
    assert dschf.is_zero3() is False
    assert transformers.integrations.is_deepspeed_zero3_enabled() is before  # a stage-2 config turns nothing on
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(hasattr(p, "ds_numel") for p in model.parameters())
    assert model.state_dict().keys() == plain.keys()
    assert all(torch.equal(value, plain[key]) for key, value in model.state_dict().items())
    del dschf


def test_weights_missing_from_the_checkpoint_are_initialised_by_transformers(tmp_path):
    base = small("llama")
    base.model.save_pretrained(tmp_path / "base")  # no lm_head: the head is new
    with zero.Init(config_dict_or_path=inference_config(tmp_path)):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    with zero.GatheredParameters([model.lm_head.weight, model.model.embed_tokens.weight]):
        head = model.lm_head.weight.detach().clone()
        assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert head.abs().sum() > 0 and head.std().item() == pytest.approx(base.config.initializer_range, rel=0.2)


def test_unsupported_transformers_version():
    with pytest.raises(ImportError, match=r"zero's from_pretrained support needs transformers >= 5.0, < 6.0 "
                                          r"\(tested with 5.17, 5.23 and 5.24\); found 4.46.3"):
        check_transformers_version("4.46.3")


def test_a_model_made_under_init_saved_by_our_writer_loads_in_transformers(tmp_path):
    config = inference_config(tmp_path)
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=config):
        made = transformers.LlamaForCausalLM(small("llama").config)
    zero.save_pretrained(made, tmp_path / "saved")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    with zero.GatheredParameters(list(made.parameters())):
        assert all(torch.equal(p, q) for p, q in zip(made.parameters(), plain.parameters()))
    with zero.Init(config_dict_or_path=config):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    engine, _, _, _ = zero.initialize(model=model, config=config)
    check_same_outputs(engine, model, plain)
    engine.destroy()


def t0_inference_config(hidden: int, nvme_path) -> dict:
    """The Hugging Face docs' ZeRO-Inference example (T0), with parameters on NVMe: no optimizer,
    no scheduler, bucket sizes computed as floats."""
    return {
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": 0.9 * hidden * hidden,
            "stage3_param_persistence_threshold": 10 * hidden,
        },
        "steps_per_print": 2000,
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "wall_clock_breakdown": False,
    }


def test_zero_inference_with_the_docs_config_generates_from_nvme(tmp_path, saved):
    kind, path = saved
    plain = cls_of(kind).from_pretrained(path)
    config = t0_inference_config(64, tmp_path)
    dschf = HfDeepSpeedConfig(config)  # noqa: F841 - kept alive: from_pretrained builds under zero.Init while it lives
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    engine, optimizer, _, scheduler = zero.initialize(model=model, config=config)
    assert optimizer is None and scheduler is None
    assert engine.parts.param_store.swap_dir.startswith(str(tmp_path))
    engine.eval()
    check_same_outputs(engine, model, plain)
    engine.destroy()


def test_a_bf16_checkpoint_trains_from_fp32_masters_or_infers_in_bf16(tmp_path):
    small("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    expected = plain.model.layers[0].mlp.up_proj.weight.detach().float()
    train = dict(inference_config(tmp_path), optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with zero.Init(config_dict_or_path=train):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    engine, _, _, _ = zero.initialize(model=model, config=train)
    unit = model.model.layers[0].mlp.up_proj.weight._zero_unit
    layout = engine.parts.rank_layout
    sg = layout.sub_group_of(unit.index)
    master, _ = engine.parts.optimizer_store.read(sg)
    start = layout.offsets[unit.index] - sg.start
    assert master.dtype == torch.float32
    assert torch.equal(master[start:start + expected.numel()].view_as(expected), expected)
    engine.destroy()
    infer = dict(inference_config(tmp_path), bf16={"enabled": True})
    infer.pop("fp16")
    with zero.Init(config_dict_or_path=infer):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight._zero_init_shard.dtype == torch.bfloat16
    engine, _, _, _ = zero.initialize(model=model, config=infer)
    plain.to(torch.bfloat16)  # the engine computes in bf16 throughout, buffers included (as DeepSpeed does)
    x = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        assert torch.equal(engine(x).logits, plain(x).logits)
    engine.destroy()
