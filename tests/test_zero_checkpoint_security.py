"""Checkpoints received from someone else: nothing in them runs, no tag leads outside the
checkpoint directory, nothing planted in it is written through, and what a save writes is
private to the user (0600 files, 0700 directories) unless the config says otherwise.
"""
import os
import stat
import sys

import pytest
import torch

import zero
from zero.examples import GPTConfig, make_batches
from helpers import base_config, make_engine, run_process, same_weights, train_engine, weights

CFG = GPTConfig()


class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(tmp_path):
    """An engine trained one step and saved as tag 'good', then trained one more step."""
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2)
    model = engine.module
    batches = make_batches(CFG, 2, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="good")
    train_engine(engine, batches[1:], 1)
    yield engine, model, tmp_path / "ckpt"
    engine.destroy()


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(saved, tmp_path):
    engine, model, ckpt = saved
    marker = tmp_path / "pwned"
    engine_pt = ckpt / "good" / "rank00000" / "engine.pt"
    state = torch.load(engine_pt, weights_only=True)
    state["client_state"] = {"payload": RunsCode(marker)}
    os.unlink(engine_pt)
    torch.save(state, engine_pt)
    before, steps = weights(model), engine.global_steps

    with pytest.raises(zero.UnsafeCheckpointError) as info:
        engine.load_checkpoint(ckpt)
    message = str(info.value)
    assert f"refused to load {engine_pt}" in message and "system" in message
    assert "nothing in it was run" in message and "add_safe_globals" in message
    assert not marker.exists()
    assert same_weights(weights(model), before) and engine.global_steps == steps  # nothing loaded


def test_zero_to_fp32_refuses_a_pickle_that_runs_code(saved, tmp_path):
    _, _, ckpt = saved
    marker = tmp_path / "pwned"
    buffers = ckpt / "good" / "buffers.pt"
    os.unlink(buffers)
    torch.save({"x": RunsCode(marker)}, buffers)
    run = run_process([sys.executable, "-m", "zero.zero_to_fp32", str(ckpt), str(tmp_path / "o.bin")],
                      timeout=120)
    assert run.returncode == 1 and f"refused to load {buffers}" in run.stderr
    assert not marker.exists() and not (tmp_path / "o.bin").exists()


def test_a_sub_group_shard_replaced_by_a_pickle_is_refused(saved, tmp_path):
    engine, model, ckpt = saved
    marker = tmp_path / "pwned"
    shard = ckpt / "good" / "rank00000" / "subgroup00000.safetensors"
    os.unlink(shard)
    torch.save({"master": RunsCode(marker)}, shard)
    before = weights(model)
    with pytest.raises(ValueError, match="subgroup00000.safetensors"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="subgroup00000.safetensors"):
        zero.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert not marker.exists() and same_weights(weights(model), before)


def test_client_state_of_plain_types_round_trips_and_other_types_warn_at_save(tmp_path, caplog):
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2)
    engine.save_checkpoint(tmp_path / "ckpt", tag="plain", client_state={"epoch": 3, "lr": [0.1, 0.2],
                                                                          "name": "run", "t": torch.ones(2)})
    _, client = engine.load_checkpoint(tmp_path / "ckpt")
    assert client["epoch"] == 3 and client["lr"] == [0.1, 0.2] and torch.equal(client["t"], torch.ones(2))
    caplog.clear()
    engine.save_checkpoint(tmp_path / "ckpt", tag="odd", client_state={"obj": RunsCode("/nonexistent")})
    assert "client_state holds types that load_checkpoint refuses" in caplog.text
    with pytest.raises(zero.UnsafeCheckpointError):
        engine.load_checkpoint(tmp_path / "ckpt", tag="odd")
    engine.destroy()


@pytest.mark.parametrize("tag", ["../outside", "/abs/path", "sub/dir", "..", ".hidden", "latest"])
def test_a_tag_argument_that_leaves_the_directory_is_refused_naming_it(saved, tag):
    engine, model, ckpt = saved
    before = weights(model)
    with pytest.raises(zero.CheckpointTagError, match=f"checkpoint tag {tag!r}"):
        engine.load_checkpoint(ckpt, tag=tag)
    with pytest.raises(zero.CheckpointTagError, match=f"checkpoint tag {tag!r}"):
        engine.save_checkpoint(ckpt, tag=tag)
    with pytest.raises(zero.CheckpointTagError, match=f"checkpoint tag {tag!r}"):
        zero.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag)
    assert same_weights(weights(model), before)


def test_latest_naming_a_checkpoint_outside_is_refused(saved, tmp_path):
    engine, model, ckpt = saved
    # A valid checkpoint outside the directory, and latest pointing at it.
    engine.save_checkpoint(tmp_path, tag="outside")
    before = weights(model)
    for text in ("../outside", str(tmp_path / "outside"), "good/../../outside"):
        (ckpt / "latest").write_text(text)
        with pytest.raises(zero.CheckpointTagError) as info:
            engine.load_checkpoint(ckpt)
        assert f"the tag in {ckpt / 'latest'} {text!r}" in str(info.value)
        with pytest.raises(zero.CheckpointTagError):
            zero.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert same_weights(weights(model), before)
    (ckpt / "latest").write_text("good\n")  # a hand-written latest with a newline still works
    assert engine.load_checkpoint(ckpt)[0] == str(ckpt / "good")


@pytest.mark.parametrize("tag", [" t", "t ", "t\n", "a\nb", "\tt"])
def test_a_tag_with_whitespace_or_a_newline_is_refused_on_save(saved, tag):
    engine, _, ckpt = saved
    with pytest.raises(zero.CheckpointTagError, match="whitespace|control character"):
        engine.save_checkpoint(ckpt, tag=tag)
    assert (ckpt / "latest").read_text() == "good"
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]


def test_symlinks_planted_at_temporary_names_are_never_written_through(saved, tmp_path):
    engine, _, ckpt = saved
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # The names the old code used for its temporary files, and the partial directory.
    for name in (f"latest.tmp-{os.getpid()}", ".next.partial", "latest.tmp"):
        os.symlink(victim, ckpt / name)
    engine.save_checkpoint(ckpt, tag="next")
    assert victim.read_text() == "precious"
    assert (ckpt / "latest").read_text() == "next" and not (ckpt / "latest").is_symlink()
    assert engine.load_checkpoint(ckpt)[0] == str(ckpt / "next")


def _modes(root):
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            found[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return found


def test_checkpoint_files_are_0600_and_directories_0700(tmp_path):
    old = os.umask(0o022)
    try:
        engine = make_engine(tmp_path / "swap", "none", lr=1e-2, stage3_gather_16bit_weights_on_model_save=True)
        engine.save_checkpoint(tmp_path / "ckpt")
        engine.save_16bit_model(tmp_path / "export")
        engine.destroy()
        zero.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "fp32.bin")
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "ckpt")
    assert {p: m for p, m in modes.items() if os.path.isdir(tmp_path / "ckpt" / p)} == {
        "global_step0": 0o700, "global_step0/rank00000": 0o700}
    files = {p: m for p, m in modes.items() if not os.path.isdir(tmp_path / "ckpt" / p)}
    assert "latest" in files and "global_step0/rank00000/engine.pt" in files and len(files) >= 5
    assert set(files.values()) == {0o600}
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "export" / "pytorch_model.bin").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "fp32.bin").st_mode) == 0o600


def test_checkpoint_file_mode_in_the_config(tmp_path):
    engine = make_engine(tmp_path / "swap", "none", lr=1e-2, overrides={"checkpoint": {"file_mode": "0640"}})
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    modes = _modes(tmp_path / "ckpt")
    assert modes["global_step0"] == modes["global_step0/rank00000"] == 0o750
    assert modes["global_step0/rank00000/engine.pt"] == modes["global_step0/zero_meta.json"] == 0o640
    with pytest.raises(zero.ConfigError, match="checkpoint.file_mode: mode 0o400 does not let the owner"):
        zero.load_config({**base_config(), "checkpoint": {"file_mode": "0400"}})
    with pytest.raises(zero.ConfigError, match="bits beyond 0o777"):
        zero.load_config({**base_config(), "checkpoint": {"file_mode": 640}})
