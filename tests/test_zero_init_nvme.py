"""zero.Init(remote_device="nvme"): each parameter's slice goes to its swap file as its module is built.

Building costs about one module of memory, whatever the model's size (peak RSS
measured in a child Python); the slices gather back to the plain values, keep
changes made with ``modifier_rank``, and their files are gone once
``zero.initialize`` holds the values.
"""
import os

import pytest
import torch
import torch.nn as nn

import zero
from zero.examples import GPT, GPTConfig
from helpers import PEAK_RSS_CODE, run_child

CFG = GPTConfig()


def nvme_config(path, max_in_cpu=0, **offload) -> dict:
    param = {"device": "nvme", "nvme_path": str(path), "max_in_cpu": max_in_cpu, "min_swap_bytes": 0, **offload}
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_param": param, "stage3_param_persistence_threshold": 0}}


def swap_files(store) -> dict:
    return {f: os.path.getsize(os.path.join(store.path, f)) for f in os.listdir(store.path)}


BUILD_CODE = PEAK_RSS_CODE + '''
import json, os, sys
import torch, torch.nn as nn
import zero

path, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {
    "device": "nvme", "nvme_path": path, "max_in_cpu": 0, "min_swap_bytes": 0, "buffer_count": 2}}}
nn.Linear(8, 8)  # torch's first-use allocations, before the baseline
reset_peak_rss()
base = peak_rss_bytes()
with zero.Init(config_dict_or_path=config) as init:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    store = init.nvme_store
    on_disk = sum(os.path.getsize(os.path.join(store.path, f)) for f in os.listdir(store.path))
    pool = store.swapper.pool.nbytes
print(json.dumps({"growth": peak_rss_bytes() - base, "model": sum(p.ds_numel * 4 for p in model.parameters()),
                  "on_disk": on_disk, "pool": pool, "empty": all(p.numel() == 0 for p in model.parameters())}))
'''


def test_building_holds_one_module_not_the_model(tmp_path):
    layers, width = 24, 2048
    r = run_child(BUILD_CODE, str(tmp_path), str(layers), str(width))
    module_bytes = (width * width + width) * 4
    assert r["empty"] and r["model"] == layers * module_bytes
    assert r["on_disk"] == r["model"]  # every slice is in its swap file
    # One module being built, the pool, the heap not yet trimmed (32 MiB, zero/stores/malloc_trim.py), 24 MiB of slack.
    bound = module_bytes + r["pool"] + (32 << 20) + (24 << 20)
    assert r["growth"] < bound < 0.3 * r["model"], (r, bound)


def test_slices_on_nvme_gather_to_the_plain_values(tmp_path):
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=nvme_config(tmp_path)) as init:
        model = GPT(CFG)
    files = swap_files(init.nvme_store)
    unique = list(dict.fromkeys(model.parameters()))
    assert len(files) == len(unique)
    assert sum(files.values()) == sum(p.ds_numel * 4 for p in unique)
    assert all(p._zero_init_shard.on_nvme and p.numel() == 0 for p in unique)
    with zero.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name


def test_modifier_rank_rewrites_the_swap_file(tmp_path):
    with zero.Init(config_dict_or_path=nvme_config(tmp_path)):
        model = GPT(CFG)
    with zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
        with torch.no_grad():
            model.ln_f.weight.fill_(0.25)
    with zero.GatheredParameters(model.ln_f.weight):
        assert torch.equal(model.ln_f.weight, torch.full((CFG.d_model,), 0.25))


def test_initialize_takes_the_slices_and_deletes_their_files(tmp_path):
    torch.manual_seed(0)
    plain = GPT(CFG)
    config = nvme_config(tmp_path)
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=config) as init:
        model = GPT(CFG)
    path = init.nvme_store.path
    engine, _, _, _ = zero.initialize(model=model, config=config)
    assert not os.path.exists(path)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    with torch.no_grad():
        assert torch.equal(engine(x), plain(x))
    engine.destroy()


def test_max_in_cpu_keeps_the_first_slices_in_memory(tmp_path):
    first = 40 * 40 + 40
    with zero.Init(config_dict_or_path=nvme_config(tmp_path, max_in_cpu=first)) as init:
        a, b = nn.Linear(40, 40), nn.Linear(40, 40)
    assert not a.weight._zero_init_shard.on_nvme and not a.bias._zero_init_shard.on_nvme
    assert b.weight._zero_init_shard.on_nvme and b.bias._zero_init_shard.on_nvme
    assert len(swap_files(init.nvme_store)) == 2


def test_nvme_needs_a_path():
    with pytest.raises(ValueError, match=r"zero.Init\(remote_device='nvme'\) needs a directory for the swap "
                                         r"files: pass config_dict_or_path= a config with "
                                         r"zero_optimization.offload_param.nvme_path set"):
        zero.Init(remote_device="nvme")


def test_unknown_remote_device():
    with pytest.raises(ValueError, match=r"zero.Init remote_device must be one of 'none', 'cpu', 'nvme', "
                                         r"got 'disk'"):
        zero.Init(remote_device="disk")
