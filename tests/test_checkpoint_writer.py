"""How engine checkpoints move their bytes (``checkpoint.writer``): fast and python
writers give the same checkpoint, NVMe-resident optimizer state is copied file to
file, shards are safetensors, config errors are clear, a full disk or a killed
save leaves the previous checkpoint loadable."""
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch

import zero
from zero.config import ConfigError
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, file_bytes, make_engine, same_weights, train_engine, wait_for_line, weights

CFG = GPTConfig()


def writer(**keys):
    """A config's ``checkpoint.writer`` section (for make_engine's ``overrides``)."""
    return {"checkpoint": {"writer": keys}}


def checkpoint_files(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = file_bytes(p)
    return out


@pytest.mark.parametrize("writer", [
    {"type": "mock"}, {"decoupled": True}, {"io_multiplier": 4}, {"type": "fsat"}, {"io_bufer_size": 1},
    {"io_buffer_size": 100}, {"data_parallel": "rack"}])
def test_writer_config_errors_are_clear(tmp_path, writer):
    config = base_config()
    config["checkpoint"] = {"writer": writer}
    key, value = next(iter(writer.items()))
    expected = {"mock": "'mock' writes nothing", "decoupled": "decoupled .* is not supported",
                "io_multiplier": "nvmeio writes each byte once", "fsat": "did you mean 'fast'",
                "io_bufer_size": "did you mean 'io_buffer_size'", "io_buffer_size": "at least 4096",
                "data_parallel": "supported: replica, socket, machine"}
    with pytest.raises(ConfigError, match=expected.get(value if isinstance(value, str) and value in expected
                                                       else key)) as e:
        zero.initialize(model=GPT(CFG), config=config)
    assert f"checkpoint.writer.{key}" in str(e.value)


def test_writer_config_accepts_deepspeeds_keys():
    config = base_config()
    config["checkpoint"] = {"writer": {"type": "FAST", "decoupled": False, "io_buffer_size": 64e6,
                                       "io_buffer_double": False, "show_statistics": True,
                                       "data_parallel": "replica", "io_multiplier": 1}}
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    w = engine.config.checkpoint.writer
    assert (w.type, w.io_buffer_size, w.io_buffer_double, w.data_parallel) == ("fast", 64_000_000, False, "replica")
    engine.destroy()


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_fast_and_python_writers_write_the_same_checkpoint(tmp_path, offload, caplog):
    """The same bytes either way; NVMe-resident state enters the checkpoint by a hard link of
    its swap file (no byte moved: see test_swapper_optimizer)."""
    trees = {}
    for kind in ("fast", "python"):
        # Swap checksums off: with them on, a save reads the state through the swapper, which
        # verifies it, instead of copying the swap file (tests/test_zero_swap_checksums.py).
        engine = make_engine(tmp_path / kind / "swap", offload, lr=1e-2, checksum="none",
                             overrides=writer(type=kind, io_buffer_size=8192, show_statistics=True))
        train_engine(engine, make_batches(CFG, 2, 4), 2)
        with caplog.at_level(logging.INFO, logger="zero"):
            engine.save_checkpoint(tmp_path / kind / "ckpt")
        engine.destroy()
        trees[kind] = checkpoint_files(tmp_path / kind / "ckpt")
        stats = [r.getMessage() for r in caplog.records if "checkpoint.writer" in r.getMessage()]
        assert stats and f"saved (checkpoint.writer {kind})" in stats[-1]
        if offload == "nvme":  # optimizer state linked from its swap files, nothing copied
            assert "linked 0 bytes" not in stats[-1] and "copied 0 bytes" in stats[-1]
        caplog.clear()
    assert trees["fast"].keys() == trees["python"].keys()
    for name in trees["fast"]:
        if name.endswith(".safetensors"):
            assert trees["fast"][name] == trees["python"][name], name


def test_shards_are_safetensors_with_master_and_states(tmp_path):
    engine = make_engine(tmp_path / "swap", lr=1e-2)
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    layout = engine.parts.rank_layout
    for sg in layout.sub_groups:
        shard = safetensors.torch.load_file(str(tmp_path / "ckpt" / "t" / "rank00000" / f"subgroup{sg.index:05d}.safetensors"))
        tensors = {k: v for k, v in shard.items() if not k.startswith("__pad__.")}  # filler to 4 KiB
        assert set(tensors) == {"master", "exp_avg", "exp_avg_sq"}
        assert all(t.shape == (sg.numel,) and t.dtype == torch.float32 for t in tensors.values())
        master, states = engine.parts.optimizer_store.read(sg)
        assert torch.equal(shard["master"], master) and torch.equal(shard["exp_avg_sq"], states["exp_avg_sq"])
    engine.destroy()


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("kind", ["fast", "python"])
def test_resume_is_bit_identical(tmp_path, offload, kind):
    batches = make_batches(CFG, 4, 4)
    engine = make_engine(tmp_path / "a" / "swap", offload, lr=1e-2, overrides=writer(type=kind, io_buffer_size=8192))
    train_engine(engine, batches[:2], 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    reference = train_engine(engine, batches[2:], 2)
    engine.destroy()
    resumed = make_engine(tmp_path / "b" / "swap", offload, lr=1e-2, seed=1,
                          overrides=writer(type=kind, io_buffer_double=False))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_engine(resumed, batches[2:], 2) == reference
    resumed.destroy()


@pytest.fixture
def small_tmpfs(tmp_path):
    def mount(size_bytes):
        mnt = tmp_path / "tiny"
        mnt.mkdir()
        if os.geteuid() != 0 or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mnt)],
                capture_output=True).returncode != 0:
            pytest.skip("needs permission to mount a small tmpfs (root, not in an unprivileged container)")
        mounted.append(mnt)
        return mnt
    mounted = []
    yield mount
    # Objects of the test kept alive only by reference cycles (a caught error's traceback and the
    # frames it holds) may still hold a file or a mapping in the mount: the one CI failure here was
    # umount's "target is busy". Collect them; retry briefly; then say what this process holds there.
    gc.collect()
    for mnt in mounted:
        for _ in range(20):
            done = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
            if done.returncode == 0:
                break
            time.sleep(0.25)
        else:
            held = [path for path in (os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd"))
                    if str(mnt) in path]
            with open("/proc/self/maps") as f:
                held += [line.split()[-1] for line in f if str(mnt) in line]
            raise AssertionError(f"umount {mnt} failed ({done.stderr.strip()}); this process holds there: {held}")


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, small_tmpfs):
    engine = make_engine(tmp_path / "swap", lr=1e-2)
    model = engine.module
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "probe")
    size = sum(len(b) for b in checkpoint_files(tmp_path / "probe").values())
    mnt = small_tmpfs(int(size * 1.5) // 4096 * 4096)  # room for one checkpoint, not two
    engine.save_checkpoint(mnt)
    first = weights(model)
    before = checkpoint_files(mnt)
    train_engine(engine, make_batches(CFG, 2, 4)[1:], 1)
    with pytest.raises(OSError) as e:
        engine.save_checkpoint(mnt)
    assert e.value.errno == 28 and "space" in str(e.value).lower()
    assert any("checkpoints saved before are untouched (latest: 'global_step1')" in n
               for n in getattr(e.value, "__notes__", []))
    assert checkpoint_files(mnt) == before  # nothing of the failed save is left
    assert (mnt / "latest").read_text() == "global_step1"
    engine.load_checkpoint(mnt)
    assert same_weights(weights(model), first)
    engine.destroy()


CHILD = r"""
import sys, torch, zero
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine  # on the PYTHONPATH tests/conftest.py sets
torch.manual_seed(0)
config = base_config("nvme", "nvme", sys.argv[2], lr=1e-2)
engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=config)
batches = make_batches(GPTConfig(), 2, 4)
train_engine(engine, batches[:1], 1)
engine.save_checkpoint(sys.argv[1])
train_engine(engine, batches[1:], 1)
print("ready", flush=True)
for i in range(1000):
    engine.save_checkpoint(sys.argv[1], tag=f"again{i % 2}")
"""


def test_a_save_killed_at_random_points_leaves_a_loadable_latest(tmp_path):
    engine = make_engine(tmp_path / "ref" / "swap", lr=1e-2)
    model = engine.module
    batches = make_batches(CFG, 2, 4)
    train_engine(engine, batches[:1], 1)
    step1 = weights(model)
    train_engine(engine, batches[1:], 1)
    step2 = weights(model)
    rng = random.Random(11)
    for attempt in range(3):
        ckpt, swap = tmp_path / f"ckpt{attempt}", tmp_path / f"swap{attempt}"
        swap.mkdir()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(ckpt), str(swap)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_for_line(child).strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        child.wait()
        tag = (ckpt / "latest").read_text()
        engine.load_checkpoint(ckpt)  # whatever latest names is complete
        expected = step1 if tag == "global_step1" else step2
        assert same_weights(weights(model), expected), tag
    engine.destroy()


@pytest.mark.parametrize("checksum", ["none", None])
def test_shards_never_change_after_the_save_or_the_load(tmp_path, checksum):
    """Training after a save, or after a load, leaves the checkpoint's files as they were,
    also where they are the swap files themselves (hard links)."""
    batches = make_batches(CFG, 4, 4)
    engine = make_engine(tmp_path / "a" / "swap", lr=1e-2, checksum=checksum)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    shards = list((tmp_path / "ckpt").glob("*/rank00000/subgroup*.safetensors"))
    assert shards and all(os.stat(p).st_nlink == 2 for p in shards)  # linked, not copied
    with safetensors.safe_open(str(shards[0]), "pt") as f:  # checksums travel with the state
        assert ("checksum" in f.metadata()) == (checksum is None)
    saved = checkpoint_files(tmp_path / "ckpt")
    train_engine(engine, batches[1:3], 2)
    assert checkpoint_files(tmp_path / "ckpt") == saved
    engine.load_checkpoint(tmp_path / "ckpt")
    assert all(os.stat(p).st_nlink == 2 for p in shards)  # linked back as the swap files
    train_engine(engine, batches[3:], 1)
    assert checkpoint_files(tmp_path / "ckpt") == saved
    engine.destroy()


@pytest.mark.parametrize("sub_group_size", [4096, 3000])
def test_a_damaged_shard_is_refused_before_the_load_changes_anything(tmp_path, sub_group_size):
    """Shards carry the checksums of their tensors: a load on the same layout and one that
    regroups the state (another sub_group_size) read every shard they use first."""
    batches = make_batches(CFG, 2, 4)
    engine = make_engine(tmp_path / "a" / "swap", lr=1e-2)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    shard = tmp_path / "ckpt" / "global_step1" / "rank00000" / "subgroup00000.safetensors"
    with open(shard, "r+b") as f:  # one bit of exp_avg_sq
        f.seek(4096 + 2 * -(-engine.parts.rank_layout.sub_groups[0].numel * 4 // 4096) * 4096 + 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    other = make_engine(tmp_path / "swap", lr=1e-2, sub_group_size=sub_group_size, seed=5)
    before = weights(other.module)
    with pytest.raises(zero.CheckpointCorruptionError, match="subgroup00000.safetensors .*'exp_avg_sq'"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(other.module), before)
    assert other.global_steps == 0
    other.destroy()


def test_a_checkpoint_loaded_right_after_its_save_again_and_again(tmp_path):
    """The shard is then the swap file itself (one file, two names): the load adopts it as it is,
    and saving and loading it repeatedly leaves no stray file and resumes exactly."""
    batches = make_batches(CFG, 3, 4)
    engine = make_engine(tmp_path / "a" / "swap", lr=1e-2)
    train_engine(engine, batches[:1], 1)
    for _ in range(3):
        engine.save_checkpoint(tmp_path / "ckpt", tag="t")
        engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    swap_dir = engine.parts.optimizer_store.swap_dir
    assert all(n.endswith((".swp", ".grad")) for n in os.listdir(swap_dir))
    saved = checkpoint_files(tmp_path / "ckpt")
    reference = train_engine(engine, batches[1:], 2)
    assert checkpoint_files(tmp_path / "ckpt") == saved
    engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert train_engine(engine, batches[1:], 2) == reference
    engine.destroy()
