"""Saves and loads that fail half way: re-saving a tag never leaves ``latest`` without a complete
checkpoint and never deletes the only complete copy; a load whose checkpoint lacks a file
changes nothing (weights, optimizer, counters).
"""
import json
import os

import pytest
import torch

import zero
import zero.checkpoint.publish as checkpoint_module
from zero.examples import GPTConfig, make_batches
from helpers import load_error, make_engine, same_weights, train_engine, weights

CFG = GPTConfig()


def resave_setup(tmp_path):
    """Tag 't' saved after one step (weights `first`), then one more step (weights `second`)."""
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2)
    model = engine.module
    batches = make_batches(CFG, 2, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    first = weights(model)
    train_engine(engine, batches[1:], 1)
    return engine, model, first, weights(model)


def test_resave_exchanges_the_directories_and_a_crash_before_cleanup_loses_nothing(tmp_path, monkeypatch):
    engine, model, first, second = resave_setup(tmp_path)
    ckpt = tmp_path / "ckpt"

    def crash(path, *args, **kwargs):
        raise KeyboardInterrupt("killed while deleting the previous copy")

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(ckpt, tag="t")
    monkeypatch.undo()
    # `t` is the new complete copy already; the old one sits under the partial name.
    assert (ckpt / "latest").read_text() == "t"
    assert any(e.startswith(".partial-") for e in os.listdir(ckpt))
    engine.load_checkpoint(ckpt)
    assert same_weights(weights(model), second)
    engine.save_checkpoint(ckpt, tag="u")  # removes the leftover
    assert sorted(os.listdir(ckpt)) == ["latest", "t", "u"]
    engine.destroy()


def test_resave_without_exchange_cut_between_the_renames_keeps_the_only_copy(tmp_path, monkeypatch):
    engine, model, first, second = resave_setup(tmp_path)
    ckpt = tmp_path / "ckpt"
    monkeypatch.setattr(checkpoint_module, "exchange", lambda a, b: False)  # NFS, old kernels
    real_rename, calls = os.rename, []

    def dying_rename(src, dst, *args, **kwargs):
        calls.append((src, dst))
        if len(calls) == 2:  # t moved aside; the new copy is not in place yet
            raise KeyboardInterrupt("killed between the two renames")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(ckpt, tag="t")
    monkeypatch.undo()
    assert (ckpt / "latest").read_text() == "t" and not (ckpt / "t").exists()
    assert any(e.startswith(".t.old-") for e in os.listdir(ckpt))

    # latest still leads to a complete checkpoint: the copy moved aside.
    path, _ = engine.load_checkpoint(ckpt)
    assert ".t.old-" in path and same_weights(weights(model), first)
    fp32 = zero.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert torch.equal(fp32["wte.weight"], first["wte.weight"])

    # The next save (of another tag) puts the only copy of t back instead of deleting it.
    engine.save_checkpoint(ckpt, tag="u")
    assert sorted(os.listdir(ckpt)) == ["latest", "t", "u"]
    engine.load_checkpoint(ckpt, tag="t")
    assert same_weights(weights(model), first)
    engine.destroy()


def test_resave_without_exchange_never_trusts_a_half_deleted_copy(tmp_path, monkeypatch):
    """Deleting the copy a re-save moved aside can stop half way (an undeletable file, a kill).
    Then a second re-save is cut between its renames: the complete copy it moved aside is what a
    load and the next save find, never the half-deleted one (which, newer by mtime, was once
    loaded, and renamed back as the tag by the next save while the complete copy was deleted)."""
    engine, model, first, second = resave_setup(tmp_path)
    ckpt = tmp_path / "ckpt"
    monkeypatch.setattr(checkpoint_module, "exchange", lambda a, b: False)
    real_rmtree, real_rename, renames = checkpoint_module.shutil.rmtree, os.rename, []

    def half_rmtree(path, ignore_errors=False, **kwargs):  # removes one file, the rest is undeletable
        victim = next(os.path.join(d, f) for d, _, fs in sorted(os.walk(path)) for f in sorted(fs))
        os.unlink(victim)
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", victim)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", half_rmtree)
    engine.save_checkpoint(ckpt, tag="t")  # t is the new copy (second); the old one half deleted
    assert not any(e.startswith(".t.old-") for e in os.listdir(ckpt))  # not under a trusted name

    def dying_rename(src, dst, *args, **kwargs):
        renames.append((src, dst))
        if dst == str(ckpt / "t"):  # t moved aside; the new copy is not in place yet
            raise KeyboardInterrupt("killed between the two renames")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(ckpt, tag="t")
    monkeypatch.undo()
    assert not (ckpt / "t").exists()
    path, _ = engine.load_checkpoint(ckpt)  # the complete copy moved aside: weights `second`
    assert ".t.old-" in path and same_weights(weights(model), second)
    engine.save_checkpoint(ckpt, tag="u")  # puts that copy back as t, removes every leftover
    assert sorted(os.listdir(ckpt)) == ["latest", "t", "u"]
    engine.load_checkpoint(ckpt, tag="t")
    assert same_weights(weights(model), second)
    real_rmtree(ckpt)
    engine.destroy()


def test_resave_without_exchange_completes(tmp_path, monkeypatch):
    engine, model, first, second = resave_setup(tmp_path)
    monkeypatch.setattr(checkpoint_module, "exchange", lambda a, b: False)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "t"]
    engine.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(model), second)
    engine.destroy()


@pytest.mark.parametrize("missing", ["rank00000/subgroup00001.safetensors", "rank00000/engine.pt", "buffers.pt",
                                     "zero_meta.json"])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_load_missing_a_file_changes_nothing(tmp_path, missing, offload):
    engine = make_engine(tmp_path / "swap", offload, lr=1e-2)
    model = engine.module
    batches = make_batches(CFG, 4, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    train_engine(engine, batches[1:2], 1)
    before, steps, samples = weights(model), engine.global_steps, engine.global_samples
    adam_step = engine.optimizer.adam_step
    os.unlink(tmp_path / "ckpt" / "t" / missing)
    with pytest.raises(FileNotFoundError, match=os.path.basename(missing)):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(model), before)
    assert (engine.global_steps, engine.global_samples, engine.optimizer.adam_step) == (steps, samples, adam_step)

    # The engine goes on exactly as one that never tried the load.
    twin = make_engine(tmp_path / "twin" / "swap", offload, lr=1e-2)
    train_engine(twin, batches[:2], 2)
    assert train_engine(engine, batches[2:], 2) == train_engine(twin, batches[2:], 2)
    twin.destroy()
    engine.destroy()


@pytest.mark.parametrize("world_change", [False, True])
def test_a_load_with_a_truncated_shard_changes_nothing(tmp_path, world_change):
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2)
    model = engine.module
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    if world_change:  # another sub_group_size: the resharding reader's path
        meta_path = tmp_path / "ckpt" / "t" / "zero_meta.json"
        meta = json.loads(meta_path.read_text())
        meta["sub_group_size"] = 5000
        meta_path.write_text(json.dumps(meta))
    shard = tmp_path / "ckpt" / "t" / "rank00000" / "subgroup00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4096)
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    before, steps = weights(model), engine.global_steps
    with pytest.raises(ValueError, match="subgroup00001.safetensors"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(model), before) and engine.global_steps == steps
    engine.destroy()


def test_a_load_that_fails_while_writing_the_state_says_to_load_again(tmp_path, monkeypatch):
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2)
    model = engine.module
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    expected = weights(model)
    store = engine.parts.optimizer_store
    real_load = store.load

    def failing(sg, *args):
        if sg.index == 1:
            raise OSError(5, "Input/output error")
        return real_load(sg, *args)

    monkeypatch.setattr(store, "load", failing)
    with pytest.raises(OSError, match="Input/output error"):
        engine.load_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()
    for use in (lambda: engine(*make_batches(CFG, 1, 4)[0]), engine.step,
                lambda: engine.save_checkpoint(tmp_path / "ckpt", tag="mixed")):
        with pytest.raises(zero.EngineStateError, match="failed while writing the checked state.*Load a checkpoint again"):
            use()
    assert not (tmp_path / "ckpt" / "mixed").exists()
    engine.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(model), expected)
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.destroy()


def scenario_one_rank_missing_a_file(rank, world_size, scratch):
    import torch.distributed as dist

    engine = make_engine(None, "none", lr=1e-2, world_size=world_size, micro=4 * world_size)
    batches = make_batches(CFG, 2, 4 * world_size)
    train_engine(engine, batches[:1], 1, rank=rank, shards=world_size)
    engine.save_checkpoint(f"{scratch}/ckpt", tag="t")
    train_engine(engine, batches[1:], 1, rank=rank, shards=world_size)
    before = {n: v.sum().item() for n, v in weights(engine.module).items()}
    if rank == 1:
        os.unlink(f"{scratch}/ckpt/t/rank00001/engine.pt")
    dist.barrier()
    error = load_error(engine, f"{scratch}/ckpt")
    after = {n: v.sum().item() for n, v in weights(engine.module).items()}
    steps = engine.global_steps
    engine.destroy()
    return {"error": error, "unchanged": after == before, "steps": steps}


def test_a_file_missing_on_one_rank_makes_every_rank_refuse_the_load(tmp_path):
    from helpers import run_ranks

    got = run_ranks(2, [("missing", scenario_one_rank_missing_a_file, {})], tmp_path)
    rank0, rank1 = got[0]["missing"], got[1]["missing"]
    assert rank1["error"].startswith("FileNotFoundError") and "rank00001/engine.pt is missing" in rank1["error"]
    assert rank0["error"] == (f"RuntimeError: load_checkpoint({tmp_path}/missing/ckpt/t) failed on another "
                              f"rank (rank 1: {rank1['error']}); nothing was loaded")
    assert rank0["unchanged"] and rank1["unchanged"] and rank0["steps"] == rank1["steps"] == 2
