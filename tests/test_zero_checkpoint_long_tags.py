"""Checkpoint tags as long as a file name can be (issue 34): every tag of at most 255 bytes
(os.fsencode's, so a tag of 128 characters may already be too long) saves, re-saves and loads;
a longer one is refused up front, naming its byte length and the limit, before anything is
written. The temporary directory of a save does not hold the tag (see [Note: a checkpoint
becomes visible only when complete] in zero/checkpoint/publish.py)."""
import errno
import os

import pytest
import torch

import zero
import zero.checkpoint.publish as publish_module
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()
LONGEST = "t" * 255                     # 255 bytes
LONGEST_WIDE = "é" * 127 + "t"          # 128 characters, 255 bytes
LIMIT = "over the 255-byte limit of a file name"


def make_engine(tmp_path, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    engine, _, _, _ = zero.initialize(model=model, config=base_config(lr=1e-2))
    return engine, model


def weights(model):
    with zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def trained(tmp_path):
    """An engine after one step, its weights, and the next batch."""
    engine, model = make_engine(tmp_path)
    batches = make_batches(CFG, 2, 4)
    train_engine(engine, batches[:1], 1)
    yield engine, model, batches[1:]
    engine.destroy()


def snapshot(directory):
    """Every name under ``directory`` with its bytes (directories as None)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), directory)] = None
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = fh.read()
    return out


@pytest.mark.parametrize("tag", [LONGEST, LONGEST_WIDE], ids=["ascii", "two-byte-characters"])
def test_a_255_byte_tag_saves_resaves_and_loads(trained, tmp_path, tag):
    engine, model, rest = trained
    ckpt = tmp_path / "ckpt"
    assert len(os.fsencode(tag)) == 255
    engine.save_checkpoint(ckpt, tag=tag)
    first = weights(model)
    assert sorted(os.listdir(ckpt)) == sorted(["latest", tag])
    assert (ckpt / "latest").read_text(encoding="utf-8") == tag

    train_engine(engine, rest, 1)
    second = weights(model)
    engine.save_checkpoint(ckpt, tag=tag)  # the re-save exchanges the two directories
    assert sorted(os.listdir(ckpt)) == sorted(["latest", tag])

    fresh, fresh_model = make_engine(tmp_path, seed=1)
    path, _ = fresh.load_checkpoint(ckpt)
    assert path == str(ckpt / tag) and same(weights(fresh_model), second)
    fresh.destroy()
    assert not same(first, second)


@pytest.mark.parametrize("tag", ["t" * 256, "é" * 128, "t" * 300],
                         ids=["256-ascii", "256-two-byte-characters", "300"])
def test_a_longer_tag_is_refused_before_anything_is_written(trained, tmp_path, tag):
    engine, model, _ = trained
    ckpt = tmp_path / "ckpt"
    nbytes = len(os.fsencode(tag))
    with pytest.raises(zero.CheckpointTagError, match=f"is {nbytes} bytes long, {LIMIT}"):
        engine.save_checkpoint(ckpt, tag=tag)
    assert not ckpt.exists()  # not even the directory

    engine.save_checkpoint(ckpt, tag="kept")
    before = snapshot(ckpt)
    with pytest.raises(ValueError, match=f"is {nbytes} bytes long, {LIMIT}"):
        engine.save_checkpoint(ckpt, tag=tag)
    assert snapshot(ckpt) == before
    with pytest.raises(ValueError, match=f"is {nbytes} bytes long, {LIMIT}"):
        engine.load_checkpoint(ckpt, tag=tag)


def test_a_tag_that_is_not_utf8_is_refused_before_anything_is_written(trained, tmp_path):
    engine, _, _ = trained
    tag = os.fsdecode(b"step\xff")  # what os.fsdecode gives for a name that is not UTF-8
    with pytest.raises(zero.CheckpointTagError, match="is not UTF-8 text"):
        engine.save_checkpoint(tmp_path / "ckpt", tag=tag)
    assert not (tmp_path / "ckpt").exists()


def test_without_exchange_a_tag_too_long_to_move_aside_is_refused_and_loses_nothing(
        trained, tmp_path, monkeypatch):
    """Where the file system cannot exchange two directories, a re-save moves the old copy to
    ``.<tag>.old-<random>`` (14 bytes more than the tag): a longer tag's re-save is refused
    with ENAMETOOLONG, the old copy kept, what the save wrote removed. 241 bytes still fit."""
    engine, model, rest = trained
    ckpt = tmp_path / "ckpt"
    fits = "f" * 241
    for tag in (LONGEST, fits):
        engine.save_checkpoint(ckpt, tag=tag)
    first = weights(model)
    train_engine(engine, rest, 1)
    second = weights(model)
    monkeypatch.setattr(publish_module, "exchange", lambda a, b: False)  # NFS, old kernels

    before = snapshot(ckpt)
    with pytest.raises(OSError, match="at most 241 bytes") as caught:
        engine.save_checkpoint(ckpt, tag=LONGEST)
    assert caught.value.errno == errno.ENAMETOOLONG
    assert "the previous copy is untouched" in str(caught.value).lower()
    assert snapshot(ckpt) == before

    engine.save_checkpoint(ckpt, tag=fits)  # moved aside and back: a complete re-save
    assert sorted(os.listdir(ckpt)) == sorted(["latest", LONGEST, fits])
    monkeypatch.undo()
    engine.load_checkpoint(ckpt, tag=LONGEST)
    assert same(weights(model), first)
    engine.load_checkpoint(ckpt)
    assert same(weights(model), second)
