"""Swap files damaged between steps (zeroed, random bytes, NaNs) are caught by the checksums the
config turns on (``offload_param.checksum`` / ``offload_optimizer.checksum``, default "auto"):
the error names the file and the unit, and resuming from the last checkpoint works."""
import math
import os
import re

import numpy as np
import pytest

import zero
from swapper import SwapCorruptionError
from zero.examples import GPTConfig, make_batches
from helpers import base_config, make_engine, same_weights, train_engine, weights

CFG = GPTConfig()


def damage(path, how, offset=0):
    size = os.path.getsize(path) - offset
    n = min(size, 1 << 16)
    if how == "zeros":
        data = bytes(n)
    elif how == "random":
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()
    else:
        data = np.full(n // 4, np.nan, dtype=np.float32).tobytes()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        os.fsync(f.fileno())


def exp_avg_offset(engine, sub_group):
    return engine.parts.optimizer_store.swapper.stored_file(sub_group)[1]["exp_avg"]


# params: a bf16 parameter's own swap file. master: the fp32 master region of an optimizer swap
# file, which the forward reads the parameter shards from (zero/stores/param_store.py [Note]). optimizer: the
# Adam states of that file, which only the optimizer's swap-in reads.
@pytest.mark.parametrize("how", ["zeros", "random", "nans"])
@pytest.mark.parametrize("target", ["params", "master", "optimizer"])
def test_damaged_swap_files_raise_naming_file_and_unit_and_resume_works(tmp_path, target, how):
    batches = make_batches(CFG, 4, 4)
    engine = make_engine(tmp_path / "swap", lr=1e-2, precision="bf16" if target == "params" else "fp32")
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train_engine(engine, batches[1:3], 2)  # what the resumed run must reproduce

    engine.load_checkpoint(tmp_path / "ckpt")
    train_engine(engine, batches[1:2], 1)  # every swap file written anew: none is the checkpoint's now
    engine.parts.param_store.flush()  # the step's last writes land before the damage, not after it
    engine.parts.optimizer_store.swapper.synchronize()
    store = engine.parts.param_store if target == "params" else engine.parts.optimizer_store
    name = sorted(n for n in os.listdir(store.swap_dir) if n.endswith(".swp"))[1]
    path = os.path.join(store.swap_dir, name)
    damage(path, how, exp_avg_offset(engine, 1) if target == "optimizer" else 0)
    with pytest.raises(SwapCorruptionError) as info:
        train_engine(engine, batches[2:3], 1)
    message = str(info.value)
    assert path in message and "changed since it was written" in message
    if target == "params":
        assert message.startswith("partition 'unit") and name[len("param_"):-len(".swp")] in message
    elif target == "master":
        sub_group = engine.parts.rank_layout.sub_groups[1]
        assert name == "subgroup1.swp" and re.match(r"partition 'unit(\d+)\.", message)
        assert int(re.match(r"partition 'unit(\d+)\.", message).group(1)) in sub_group.units
    else:
        assert message.startswith(f"sub-group {name[len('subgroup'):-len('.swp')]}:")

    engine.load_checkpoint(tmp_path / "ckpt")
    resumed = train_engine(engine, batches[1:3], 2)
    assert resumed == expected and all(math.isfinite(x) for x in resumed)
    engine.destroy()


def test_checksum_none_turns_them_off_and_the_default_is_on(tmp_path):
    from swapper.checksum import fastest_available

    on = make_engine(tmp_path / "a", lr=1e-2)
    off = make_engine(tmp_path / "b", lr=1e-2, checksum="none")
    assert on.parts.param_store.swapper.checksum is fastest_available()
    assert on.parts.optimizer_store.swapper.checksum is fastest_available()
    assert off.parts.param_store.swapper.checksum is None
    assert off.parts.optimizer_store.swapper.checksum is None
    on.destroy()
    off.destroy()
    config = base_config("nvme", "nvme", tmp_path)
    config["zero_optimization"]["offload_param"]["checksum"] = "md5"
    with pytest.raises(zero.ConfigError, match="offload_param.checksum: checksum 'md5' is not supported"):
        zero.load_config(config)


def test_a_damaged_swap_file_saved_into_a_checkpoint_is_refused_by_its_load(tmp_path):
    """A save links (or copies) the swap file without reading it and the shard carries the
    checksums recorded when the state was written: the load reads every shard first and
    refuses the damaged one, naming file and tensor, before anything changes."""
    engine = make_engine(tmp_path / "swap", lr=1e-2)
    batches = make_batches(CFG, 3, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="good")
    train_engine(engine, batches[1:2], 1)  # the swap files are new files again, not good's
    store = engine.parts.optimizer_store
    # The Adam state: a save of a damaged master refuses already, gathering the module's weights.
    damage(os.path.join(store.swap_dir, "subgroup1.swp"), "nans", exp_avg_offset(engine, 1))
    engine.save_checkpoint(tmp_path / "ckpt", tag="bad")
    shard = tmp_path / "ckpt" / "bad" / "rank00000" / "subgroup00001.safetensors"
    assert os.stat(shard).st_nlink == 2  # linked: no byte was read or moved
    before = weights(engine.module)
    with pytest.raises(zero.CheckpointCorruptionError, match=f"{shard}.*'exp_avg'"):
        engine.load_checkpoint(tmp_path / "ckpt", tag="bad")
    assert same_weights(weights(engine.module), before)
    engine.load_checkpoint(tmp_path / "ckpt", tag="good")
    assert all(math.isfinite(x) for x in train_engine(engine, batches[2:], 1))
    engine.destroy()


def test_auto_without_a_fast_package_turns_checksums_off_and_says_so(tmp_path, monkeypatch, caplog):
    import swapper.checksum as checksum_module
    import zero.stores.param_store as param_store

    monkeypatch.setattr(checksum_module, "fastest_available", lambda: checksum_module.ChecksumAlgorithm.CRC32)
    monkeypatch.setattr(param_store, "_WARNED_NO_FAST_CHECKSUM", False)
    engine = make_engine(tmp_path / "a", lr=1e-2)
    assert engine.parts.param_store.swapper.checksum is None
    assert engine.parts.optimizer_store.swapper.checksum is None
    assert "swap-file checksums are off: neither xxhash nor crc32c is installed" in caplog.text
    engine.destroy()
    explicit = make_engine(tmp_path / "b", lr=1e-2, checksum="crc32")
    assert explicit.parts.param_store.swapper.checksum is checksum_module.ChecksumAlgorithm.CRC32
    explicit.destroy()
