"""zero.load_pretrained: checkpoint tensors into a partitioned model, one at a time.

safetensors (one file, or shards with their index) and torch ``.bin`` files
(``weights_only``) load into zero.Init slices (NVMe included), meta parameters
left without values, an engine's partitions, or a plain model, with the values
a plain ``load_state_dict`` gives; peak RSS while loading is about one tensor
(child Python); every refusal names what is wrong, before anything is written.
"""
import json
import os

import pytest
import torch
import torch.nn as nn

import zero
from zero.examples import GPT, GPTConfig
from helpers import PEAK_RSS_CODE, run_child, weights

safetensors_torch = pytest.importorskip("safetensors.torch", reason="writing test checkpoints needs safetensors "
                                                                     '(pip install "nvmeio[test]")')

CFG = GPTConfig()


def nvme_config(path) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0, "min_swap_bytes": 0}}}


def state_of(model: nn.Module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def save_shards(state: dict, directory, per_shard: int, fmt: str = "safetensors") -> None:
    """``state`` as shards of ``per_shard`` tensors with a Hugging Face index."""
    os.makedirs(directory, exist_ok=True)
    names = list(state)
    groups = [names[i:i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.{fmt}"
        part = {n: state[n] for n in group}
        if fmt == "safetensors":
            safetensors_torch.save_file(part, os.path.join(directory, shard))
        else:
            torch.save(part, os.path.join(directory, shard))
        weight_map.update({n: shard for n in group})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    with open(os.path.join(directory, index), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def untied_state(model: GPT) -> dict:
    state = state_of(model)
    state.pop("head.weight")  # tied to wte.weight: saved once, as Hugging Face does
    return state


@pytest.fixture
def reference():
    torch.manual_seed(11)
    return GPT(CFG)


@pytest.mark.parametrize("layout", ["one file", "shards", "bin", "bin shards"])
def test_meta_model_gets_the_checkpoint_values(tmp_path, reference, layout):
    state = untied_state(reference)
    ckpt = tmp_path / "ckpt"
    if layout == "one file":
        ckpt.mkdir()
        safetensors_torch.save_file(state, ckpt / "model.safetensors")
    elif layout == "bin":
        ckpt.mkdir()
        torch.save(state, ckpt / "pytorch_model.bin")
    else:
        save_shards(state, ckpt, 5, "safetensors" if layout == "shards" else "bin")
    config = nvme_config(tmp_path)
    with zero.Init(config_dict_or_path=config), torch.device("meta"):
        model = GPT(CFG)
    result = zero.load_pretrained(model, ckpt)
    assert result.missing_keys == [] and result.unexpected_keys == [] and result.loaded == len(state)
    assert not model.pos.is_meta and model.head.weight is model.wte.weight
    values = weights(model)
    for name, p in reference.named_parameters():
        assert torch.equal(values[name], p), name
    engine, _, _, _ = zero.initialize(model=model, config=config)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    engine.destroy()


def test_into_an_engine_and_into_a_plain_model(tmp_path, reference):
    safetensors_torch.save_file(untied_state(reference), tmp_path / "model.safetensors")
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=nvme_config(tmp_path))
    zero.load_pretrained(engine, tmp_path / "model.safetensors")
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    engine.destroy()
    plain = GPT(CFG)
    zero.load_pretrained(plain, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), reference.parameters()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_checkpoint_into_fp32_and_into_16bit(tmp_path, reference, dtype):
    state = {k: v.to(dtype) for k, v in untied_state(reference).items()}
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    with zero.Init(), torch.device("meta"):
        fp32 = GPT(CFG)
    zero.load_pretrained(fp32, tmp_path)
    values = weights(fp32)
    assert all(v.dtype == torch.float32 for v in values.values())
    assert torch.equal(values["blocks.0.fc.weight"], state["blocks.0.fc.weight"].float())
    with zero.Init(dtype=dtype), torch.device("meta"):
        half = GPT(CFG)
    zero.load_pretrained(half, tmp_path)
    values = weights(half)
    assert all(v.dtype == dtype for v in values.values())
    assert torch.equal(values["blocks.1.attn.qkv.bias"], state["blocks.1.attn.qkv.bias"])


def test_saved_by_our_streaming_writer_reloads_bit_identical(tmp_path):
    config = nvme_config(tmp_path)
    torch.manual_seed(5)
    with zero.Init(config_dict_or_path=config):
        model = GPT(CFG)
    original = weights(model)
    path = zero.save_pretrained(model, tmp_path / "saved")
    reader = pytest.importorskip("safetensors").safe_open(path, "pt")  # the reference reader agrees
    assert set(reader.keys()) == set(original) - {"head.weight"}
    assert torch.equal(reader.get_tensor("blocks.1.fc.weight"), original["blocks.1.fc.weight"])
    with zero.Init(config_dict_or_path=config), torch.device("meta"):
        again = GPT(CFG)
    zero.load_pretrained(again, tmp_path / "saved")
    reloaded = weights(again)
    assert all(torch.equal(reloaded[n], v) for n, v in original.items())
    engine, _, _, _ = zero.initialize(model=again, config=config)  # out of an engine, in bf16, sharded
    index = zero.save_pretrained(engine, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size=10_000)
    assert index.endswith("model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "bf16") if f.endswith(".safetensors")]) > 2
    engine.destroy()
    plain = GPT(CFG)
    zero.load_pretrained(plain, tmp_path / "bf16")
    assert all(torch.equal(p, original[n].bfloat16().float()) for n, p in plain.named_parameters())


def test_missing_shard(tmp_path, reference):
    save_shards(untied_state(reference), tmp_path, 5)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    os.remove(tmp_path / shards[1])
    with pytest.raises(ValueError, match=rf"checkpoint index .*model.safetensors.index.json names shard "
                                         rf"{shards[1]}, which is missing from "):
        zero.load_pretrained(GPT(CFG), tmp_path)


def test_shape_mismatch_is_refused_before_anything_is_written(tmp_path, reference):
    state = untied_state(reference)
    state["blocks.1.out.weight"] = torch.zeros(CFG.d_model, 2 * CFG.d_model)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    model = GPT(CFG)
    before = state_of(model)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'blocks.1.out.weight' in .*model.safetensors has "
                                         r"shape \(32, 64\), the model's parameter 'blocks.1.out.weight' has "
                                         r"\(32, 128\)$"):
        zero.load_pretrained(model, tmp_path)
    assert all(torch.equal(v, state_of(model)[k]) for k, v in before.items())  # all-or-nothing


def test_dtype_it_cannot_convert(tmp_path, reference):
    state = untied_state(reference)
    state["ln_f.weight"] = torch.ones(CFG.d_model, dtype=torch.int64)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint tensor 'ln_f.weight' in .* is torch.int64, the model's "
                                         r"parameter 'ln_f.weight' is torch.float32: zero.load_pretrained converts "
                                         r"between floating-point types and between integer types only"):
        zero.load_pretrained(GPT(CFG), tmp_path)


def test_missing_and_unexpected_names(tmp_path, reference):
    state = untied_state(reference)
    del state["pos"]
    state["extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint .* does not match the model: 1 name\(s\) of the model are "
                                         r"not in the checkpoint: pos; 1 tensor\(s\) of the checkpoint are not in "
                                         r"the model: extra.weight \(strict=False loads what matches\)$"):
        zero.load_pretrained(GPT(CFG), tmp_path)
    model = GPT(CFG)
    result = zero.load_pretrained(model, tmp_path, strict=False)
    assert result.missing_keys == ["pos"] and result.unexpected_keys == ["extra.weight"]
    assert torch.equal(model.ln_f.weight, reference.ln_f.weight)


def test_files_that_are_not_checkpoints(tmp_path):
    with pytest.raises(ValueError, match=r"no checkpoint in .*: expected one of model.safetensors.index.json, "
                                         r"model.safetensors, pytorch_model.bin.index.json, pytorch_model.bin$"):
        zero.load_pretrained(GPT(CFG), tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10 ** 9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"model.safetensors: damaged header: its length field says 1000000000 "
                                         r"bytes but the file holds 2 after it"):
        zero.load_pretrained(GPT(CFG), bad)
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nothing.safetensors does not exist"):
        zero.load_pretrained(GPT(CFG), tmp_path / "nothing.safetensors")


def test_truncated_safetensors(tmp_path, reference):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(untied_state(reference), path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' data_offsets \[\d+, \d+\] are out of "
                                         r"range \(the file holds \d+ data bytes\)"):
        zero.load_pretrained(GPT(CFG), path)


LOAD_CODE = PEAK_RSS_CODE + '''
import json, os, sys
import torch, torch.nn as nn
import zero

ckpt, swap, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {
    "device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "min_swap_bytes": 0, "buffer_count": 2}}}
with zero.Init(config_dict_or_path=config) as init:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
pool = init.nvme_store.swapper.pool.nbytes
reset_peak_rss()
base = peak_rss_bytes()
zero.load_pretrained(model, ckpt)
growth = peak_rss_bytes() - base
with zero.GatheredParameters([model[layers - 1].weight]):
    last = model[layers - 1].weight.sum().item()
print(json.dumps({"growth": growth, "pool": pool, "last": last}))
'''


def test_loading_holds_about_one_tensor(tmp_path):
    layers, width = 16, 2048
    torch.manual_seed(0)
    state = {}
    for i in range(layers):  # made and saved a few at a time: the test itself stays small
        state[f"{i}.weight"] = torch.randn(width, width)
        state[f"{i}.bias"] = torch.randn(width)
    save_shards(state, tmp_path / "ckpt", 8)
    expected = state[f"{layers - 1}.weight"].sum().item()
    model_bytes = layers * (width * width + width) * 4
    del state
    swap = tmp_path / "swap"
    swap.mkdir()
    r = run_child(LOAD_CODE, str(tmp_path / "ckpt"), str(swap), str(layers), str(width))
    tensor = width * width * 4
    assert r["last"] == pytest.approx(expected, rel=1e-6)
    # The tensor being read, a copy of it cast/sliced, the heap not yet trimmed (32 MiB), 24 MiB slack.
    bound = 2 * tensor + (32 << 20) + (24 << 20)
    assert r["growth"] < bound < 0.4 * model_bytes, (r, bound)


def test_the_core_imports_neither_transformers_nor_safetensors():
    code = ("import json, sys, nvmeio, swapper, zero\n"
            "import zero.partitioning.init_context, zero.checkpoint.pretrained, zero.engine.entry, zero.engine.build\n"
            "print(json.dumps({'loaded': [m for m in ('transformers', 'safetensors') if m in sys.modules]}))\n")
    assert run_child(code)["loaded"] == []
