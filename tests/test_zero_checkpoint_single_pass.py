"""A load with swap checksums on reads each shard byte once (zero/checkpoint/load.py [Note: verified
while loading]): hashed as it streams into a staging swap file, published only when every
shard matched; a damaged shard found on the way leaves weights, optimizer states and counters
as they were, and no staging file behind."""
import os

import pytest
import torch

import zero
import zero.checkpoint.load as load_module
from zero.examples import GPTConfig, make_batches
from helpers import load_error, make_engine, same_weights, train_engine, weights

CFG = GPTConfig()
ONE_SUB_GROUP = 10 ** 9  # the whole partition: its staging buffer holds the master at publish


def copy_on_load(engine):
    """Loads into ``engine`` copy every byte, as where the checkpoint lies on another file system
    (they link each shard in as a swap file otherwise)."""
    store = engine.parts.optimizer_store
    store._link_state = lambda *args, **kwargs: False
    store.link_on_load = False


def states(engine):
    store = engine.parts.optimizer_store
    return [store.read(sg) for sg in engine.parts.rank_layout.sub_groups]


def same_states(a, b):
    return all(torch.equal(ma, mb) and all(torch.equal(sa[k], sb[k]) for k in sa)
               for (ma, sa), (mb, sb) in zip(a, b))


def shard_files(tag_dir):
    rank_dir = tag_dir / "rank00000"
    return sorted(rank_dir / n for n in os.listdir(rank_dir) if n.endswith(".safetensors"))


def leftovers(engine):
    return [n for n in os.listdir(engine.parts.optimizer_store.swap_dir) if n.endswith(".staged")]


class CountingIO(load_module.CheckpointIO):
    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountingIO.made.append(self)


@pytest.mark.parametrize("link", [True, False], ids=["linked", "copied"])
def test_a_load_with_checksums_reads_each_shard_byte_once(tmp_path, monkeypatch, link):
    engine = make_engine(tmp_path / "swap", lr=1e-2, sub_group_size=ONE_SUB_GROUP)
    if not link:
        copy_on_load(engine)
    model = engine.module
    batches = make_batches(CFG, 3, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    saved = weights(model)
    train_engine(engine, batches[1:2], 1)
    shards = shard_files(tmp_path / "ckpt" / "t")
    data_bytes = sum(os.path.getsize(p) - 4096 for p in shards)  # after each header page
    other_bytes = sum(os.path.getsize(tmp_path / "ckpt" / "t" / d / n)
                      for d in ("", "rank00000") for n in os.listdir(tmp_path / "ckpt" / "t" / d)
                      if os.path.isfile(tmp_path / "ckpt" / "t" / d / n) and not n.endswith(".safetensors"))
    swapper = engine.parts.optimizer_store.swapper
    read_before = swapper.io_bytes.read
    CountingIO.made.clear()
    monkeypatch.setattr(load_module, "CheckpointIO", CountingIO)
    engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    # the shards' tensors, filler included, once: staged by the swapper, counted by the load
    assert swapper.io_bytes.read - read_before == data_bytes
    (cio,) = CountingIO.made
    assert data_bytes <= cio.stats.bytes_read <= data_bytes + other_bytes + 64 * 1024 * len(shards)
    swap_file = swapper.swap_dir.file("subgroup0.swp")
    assert os.path.samefile(swap_file, shards[0]) == link
    assert same_weights(weights(model), saved)
    assert engine.global_steps == 1 and not leftovers(engine)
    train_engine(engine, batches[2:], 1)  # trains on from the loaded state
    engine.destroy()


@pytest.mark.parametrize("link", [True, False], ids=["linked", "copied"])
@pytest.mark.parametrize("sub_group_size,tensor", [(ONE_SUB_GROUP, "master"), (ONE_SUB_GROUP, "exp_avg_sq"),
                                                   (4096, "exp_avg")])
def test_a_damaged_shard_found_while_loading_changes_nothing(tmp_path, monkeypatch, link, sub_group_size,
                                                            tensor):
    def second_read(*args, **kwargs):
        raise AssertionError("a shard was verified by a read of its own")

    monkeypatch.setattr(load_module.CheckpointIO, "verify_shard", second_read)
    engine = make_engine(tmp_path / "swap", lr=1e-2, sub_group_size=sub_group_size)
    if not link:
        copy_on_load(engine)
    model = engine.module
    batches = make_batches(CFG, 3, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    train_engine(engine, batches[1:2], 1)  # the engine moved on: a load would change it
    before_weights, before_states, before_steps = weights(model), states(engine), engine.global_steps
    shards = shard_files(tmp_path / "ckpt" / "t")
    damaged = shards[-1]  # the last: the shards before it are staged already when it is read
    numel = engine.parts.rank_layout.sub_groups[-1].numel
    region = -(-numel * 4 // 4096) * 4096
    with open(damaged, "r+b") as f:  # one bit of the tensor, past its first chunk's start
        f.seek(4096 + ("master", "exp_avg", "exp_avg_sq").index(tensor) * region + 4 * (numel // 2))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(zero.CheckpointCorruptionError, match=rf"{damaged.name} is damaged: .*'{tensor}'"):
        engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert same_weights(weights(model), before_weights)
    assert same_states(states(engine), before_states)
    assert engine.global_steps == before_steps and not leftovers(engine)
    pool = engine.parts.optimizer_store.swapper.pool
    assert pool.free_count == pool.buffer_count  # every staging buffer given back
    train_engine(engine, batches[2:], 1)  # still usable: nothing was marked half loaded
    engine.destroy()


def scenario_one_rank_damaged(rank, world_size, scratch):
    import torch.distributed as dist

    engine = make_engine(f"{scratch}/swap", lr=1e-2, world_size=world_size, micro=4 * world_size,
                         sub_group_size=ONE_SUB_GROUP)
    batches = make_batches(CFG, 2, 4 * world_size)
    train_engine(engine, batches[:1], 1, rank=rank, shards=world_size)
    engine.save_checkpoint(f"{scratch}/ckpt", tag="t")
    train_engine(engine, batches[1:], 1, rank=rank, shards=world_size)
    before_weights, before_states = weights(engine.module), states(engine)
    if rank == 1:  # one bit of this rank's exp_avg: rank 0 stages its own shards and verifies them
        shard = f"{scratch}/ckpt/t/rank00001/subgroup00000.safetensors"
        numel = engine.parts.rank_layout.sub_groups[0].numel
        with open(shard, "r+b") as f:
            f.seek(4096 + -(-numel * 4 // 4096) * 4096 + 4 * (numel // 3))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    error = load_error(engine, f"{scratch}/ckpt")
    unchanged = (same_weights(weights(engine.module), before_weights)
                 and same_states(states(engine), before_states))
    out = {"error": error, "unchanged": unchanged, "steps": engine.global_steps, "leftovers": leftovers(engine)}
    engine.destroy()
    return out


def test_a_shard_damaged_on_one_rank_leaves_every_rank_untouched(tmp_path):
    from helpers import run_ranks

    got = run_ranks(2, [("damaged", scenario_one_rank_damaged, {})], tmp_path)
    rank0, rank1 = got[0]["damaged"], got[1]["damaged"]
    assert rank1["error"].startswith("CheckpointCorruptionError") and \
        "rank00001/subgroup00000.safetensors is damaged" in rank1["error"] and "'exp_avg'" in rank1["error"]
    assert rank0["error"] == (f"RuntimeError: load_checkpoint({tmp_path}/damaged/ckpt/t) failed on another "
                              f"rank (rank 1: {rank1['error']}); nothing was loaded")
    for r in (rank0, rank1):
        assert r["unchanged"] and r["steps"] == 2 and r["leftovers"] == []
