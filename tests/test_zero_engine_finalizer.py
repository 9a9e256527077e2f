"""An engine dropped without destroy() gives back its I/O threads, kernel AIO contexts, locked
buffers, open files and swap files when it is collected, as destroy() does."""
import gc
import os

import pytest
import torch

import zero
from nvmeio import resources
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()


def settled():
    gc.collect()
    return resources.snapshot()


@pytest.mark.parametrize("drop", ["collected", "destroyed"])
def test_a_dropped_engine_releases_threads_aio_contexts_and_swap_files(tmp_path, drop):
    torch.manual_seed(0)
    model = GPT(CFG)
    batches = make_batches(CFG, 2, 4)
    GPT(CFG)(*batches[0]).backward()  # torch's own worker threads start here, not in the engine
    before = settled()
    engine, optimizer, _, _ = zero.initialize(model=model, config=base_config("nvme", "nvme", tmp_path))
    train_engine(engine, batches, 2)
    param_dir, optimizer_dir = engine.parts.param_store.swap_dir, engine.parts.optimizer_store.swap_dir
    during = resources.snapshot()
    # fp32 shards are read from the optimizer's master: the parameter swap directory stays empty.
    assert during.threads > before.threads and os.listdir(optimizer_dir) and os.path.isdir(param_dir)
    if drop == "destroyed":
        engine.destroy()
    del engine, optimizer
    assert resources.grown_since(before) == {}
    assert os.listdir(tmp_path) == []
    # The model is a plain module again: no hook of the dead engine runs.
    assert not model._forward_pre_hooks and all(not m._forward_pre_hooks for m in model.modules())


def test_a_new_engine_after_a_dropped_one_reuses_the_job_id(tmp_path):
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=base_config("nvme", "nvme", tmp_path))
    job = engine.parts.job_id
    del engine
    gc.collect()
    again, _, _, _ = zero.initialize(model=GPT(CFG), config=base_config("nvme", "nvme", tmp_path))
    assert again.parts.job_id == job
    again.destroy()
