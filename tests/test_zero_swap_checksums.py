"""Swap files damaged between steps (zeroed, random bytes, NaNs) are caught by the checksums the
config turns on (``offload_param.checksum`` / ``offload_optimizer.checksum``, default "auto"):
the error names the file and the unit, and resuming from the last checkpoint works."""
import math
import os

import numpy as np
import pytest
import torch

import zero
from swapper import SwapCorruptionError
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()


def make_engine(nvme, checksum=None):
    torch.manual_seed(0)
    config = base_config("nvme", "nvme", nvme, lr=1e-2)
    if checksum is not None:
        for key in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][key]["checksum"] = checksum
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    return engine


def damage(path, how):
    size = os.path.getsize(path)
    n = min(size, 1 << 16)
    if how == "zeros":
        data = bytes(n)
    elif how == "random":
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()
    else:
        data = np.full(n // 4, np.nan, dtype=np.float32).tobytes()
    with open(path, "r+b") as f:
        f.write(data)
        os.fsync(f.fileno())


@pytest.mark.parametrize("how", ["zeros", "random", "nans"])
@pytest.mark.parametrize("target", ["params", "optimizer"])
def test_damaged_swap_files_raise_naming_file_and_unit_and_resume_works(tmp_path, target, how):
    batches = make_batches(CFG, 4, 4)
    (tmp_path / "swap").mkdir()
    engine = make_engine(tmp_path / "swap")
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train_engine(engine, batches[1:3], 2)  # what the resumed run must reproduce

    engine.load_checkpoint(tmp_path / "ckpt")
    store = engine.parts.param_store if target == "params" else engine.parts.optimizer_store
    name = sorted(os.listdir(store.swap_dir))[1]
    path = os.path.join(store.swap_dir, name)
    damage(path, how)
    with pytest.raises(SwapCorruptionError) as info:
        train_engine(engine, batches[1:2], 1)
    message = str(info.value)
    assert path in message and "changed since it was written" in message
    if target == "params":
        assert message.startswith("partition 'unit") and name[len("param_"):-len(".swp")] in message
    else:
        assert message.startswith(f"sub-group {name[len('subgroup'):-len('.swp')]}:")

    engine.load_checkpoint(tmp_path / "ckpt")
    resumed = train_engine(engine, batches[1:3], 2)
    assert resumed == expected and all(math.isfinite(x) for x in resumed)
    engine.destroy()


def test_checksum_none_turns_them_off_and_the_default_is_on(tmp_path):
    from swapper.checksum import fastest_available

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    on = make_engine(tmp_path / "a")
    off = make_engine(tmp_path / "b", checksum="none")
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


def test_a_save_reads_and_verifies_the_swap_files_and_a_damaged_one_fails_it(tmp_path):
    (tmp_path / "swap").mkdir()
    engine = make_engine(tmp_path / "swap")
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="good")
    store = engine.parts.optimizer_store
    path = os.path.join(store.swap_dir, "subgroup0.swp")
    damage(path, "nans")
    with pytest.raises(SwapCorruptionError, match="sub-group 0: swap file"):
        engine.save_checkpoint(tmp_path / "ckpt", tag="bad")
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["good", "latest"]
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt", tag="again")
    engine.destroy()


def test_auto_without_a_fast_package_turns_checksums_off_and_says_so(tmp_path, monkeypatch, caplog):
    import swapper.checksum as checksum_module
    import zero.param_store as param_store

    monkeypatch.setattr(checksum_module, "fastest_available", lambda: checksum_module.ChecksumAlgorithm.CRC32)
    monkeypatch.setattr(param_store, "_WARNED_NO_FAST_CHECKSUM", False)
    (tmp_path / "a").mkdir()
    engine = make_engine(tmp_path / "a")
    assert engine.parts.param_store.swapper.checksum is None
    assert engine.parts.optimizer_store.swapper.checksum is None
    assert "swap-file checksums are off: neither xxhash nor crc32c is installed" in caplog.text
    engine.destroy()
    (tmp_path / "b").mkdir()
    explicit = make_engine(tmp_path / "b", checksum="crc32")
    assert explicit.parts.param_store.swapper.checksum is checksum_module.ChecksumAlgorithm.CRC32
    explicit.destroy()
