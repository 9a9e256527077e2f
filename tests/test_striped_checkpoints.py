"""Checkpoints of swap files striped over several drives (zero/checkpoint/format.py [Note: striped shards]).

A shard is the swap file taken part by part: a part on the checkpoint's file system is a hard
link of the drive's file (no byte copied), a part on another file system is copied; where no
part shares the checkpoint's file system the shard is one plain file. Every reader reads either
kind: a load into a striped engine (by links where the parts and the swap files are cut alike),
into a one-directory engine, and zero_to_fp32; a damaged or incomplete striped shard is refused,
naming it.
"""
import json
import os
import struct

import pytest
import torch

from helpers import make_engine, train_engine
from nvmeio import SafetensorsError, SafetensorsReader, StripedFile
from nvmeio._fast_reader import FastFileReader
from nvmeio._striped_reader import StripedPageReader
from test_striping import _striped_settings, assemble, drive_dirs, striped, tmpfs
from zero.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from zero.checkpoint.format import CheckpointCorruptionError, shard_source
from zero.examples import GPTConfig, make_batches

STEPS = 3


def inodes(dirs):
    """(device, inode) of every file under ``dirs``."""
    out = set()
    for d in dirs:
        for root, _, names in os.walk(d):
            for n in names:
                st = os.stat(os.path.join(root, n))
                out.add((st.st_dev, st.st_ino))
    return out


def ident(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def shards(checkpoint):
    """The sub-group shards of rank 0 (their first parts) and every file of that rank."""
    rank = os.path.join(checkpoint, "rank00000")
    files = sorted(os.listdir(rank))
    return [os.path.join(rank, f) for f in files if f.endswith(".safetensors")], files


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses and the consolidated checkpoint of one-directory training: the striped runs match them."""
    root = tmp_path_factory.mktemp("one")
    batches = make_batches(GPTConfig(), 2 * STEPS, 4)
    engine = make_engine(root / "swap", overrides=_striped_settings(str(root / "swap")))
    losses = train_engine(engine, batches[:STEPS], STEPS)
    engine.save_checkpoint(root / "ckpt")
    losses += train_engine(engine, batches[STEPS:], STEPS)
    engine.destroy()
    return batches, losses, get_fp32_state_dict_from_zero_checkpoint(root / "ckpt")


def _save_striped(dirs, checkpoint, reference, **engine_args):
    batches, losses, _ = reference
    engine = make_engine(dirs[0], overrides=_striped_settings(dirs), **engine_args)
    assert train_engine(engine, batches[:STEPS], STEPS) == losses[:STEPS]
    engine.save_checkpoint(checkpoint)
    return engine


def _resume(target, checkpoint, reference, tag=None):
    """A fresh engine over ``target`` loads ``checkpoint`` and continues exactly as the reference."""
    batches, losses, _ = reference
    engine = make_engine(target if isinstance(target, str) else target[0], seed=1, overrides=_striped_settings(target))
    assert engine.load_checkpoint(checkpoint, tag=tag)[0] is not None
    return engine, train_engine(engine, batches[STEPS:], STEPS) == losses[STEPS:]


def _same_state(got, expected):
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_parts_on_the_checkpoints_file_system_are_linked_the_others_copied(tmp_path, reference):
    """Two drives on the disk and one tmpfs, the checkpoint on the disk: each shard is three parts,
    the disk's two hard links of the swap files' parts, the tmpfs's a copy; zero_to_fp32 reads it as
    the one-directory checkpoint, and it resumes training exactly into a striped engine and into a
    one-directory one."""
    with tmpfs(tmp_path / "tmpfs", size="256m") as fast:
        dirs = [*drive_dirs(tmp_path, 2), fast]
        checkpoint = tmp_path / "ckpt" / "global_step3"
        engine = _save_striped(dirs, tmp_path / "ckpt", reference)
        disk = inodes(dirs[:2])
        first_parts, files = shards(checkpoint)
        assert first_parts
        for path in first_parts:
            source = shard_source(path)
            assert isinstance(source, StripedFile) and len(source.parts) == 3
            assert [os.path.basename(p) for p in source.parts] == [
                os.path.basename(path), os.path.basename(path) + ".stripe1", os.path.basename(path) + ".stripe2"]
            assert ident(source.parts[0]) in disk and ident(source.parts[1]) in disk  # linked: no byte moved
            assert os.stat(source.parts[2]).st_nlink == 1  # copied (the tmpfs's part cannot be linked here)
            with pytest.raises(SafetensorsError):  # its first part alone is no safetensors file
                SafetensorsReader(path, direct=False)
        assert len(files) == 3 * len(first_parts) + 1  # the parts and engine.pt, nothing else
        _same_state(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), reference[2])
        batches, losses, _ = reference
        assert train_engine(engine, batches[STEPS:], STEPS) == losses[STEPS:]  # the swap files moved on
        engine.destroy()
        _same_state(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), reference[2])  # the shard did not

        for target in (dirs, str(tmp_path / "one")):
            resumed, same = _resume(target, tmp_path / "ckpt", reference)
            resumed.destroy()
            assert same


@pytest.mark.parametrize("checksum", ["auto", "none"])
def test_drives_on_the_checkpoints_file_system_are_linked_both_ways(tmp_path, reference, checksum):
    """Every drive on the checkpoint's file system: every part of every shard is a link, and a load
    into an engine striped alike links them back as its swap files (staged with checksums on, adopted
    with them off) and trains on exactly."""
    dirs = drive_dirs(tmp_path, 2)
    engine = _save_striped(dirs, tmp_path / "ckpt", reference, checksum=checksum)
    live = inodes(dirs)
    first_parts, _ = shards(tmp_path / "ckpt" / "global_step3")
    parts = [p for path in first_parts for p in shard_source(path).parts]
    assert parts and all(ident(p) in live for p in parts)
    engine.destroy()

    resumed = make_engine(dirs[0], seed=1, overrides=_striped_settings(dirs), checksum=checksum)
    resumed.load_checkpoint(tmp_path / "ckpt")
    swap = inodes(dirs)
    assert all(ident(p) in swap for p in parts)  # the loaded swap files are the checkpoint's parts
    batches, losses, _ = reference
    assert train_engine(resumed, batches[STEPS:], STEPS) == losses[STEPS:]
    resumed.destroy()
    _same_state(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), reference[2])


def test_drives_off_the_checkpoints_file_system_give_one_plain_shard(tmp_path, reference):
    """No drive shares the checkpoint's file system: each shard is one plain safetensors file (no
    parts), which loads back into a striped engine."""
    with tmpfs(tmp_path / "tmpfs", size="256m"):
        dirs = drive_dirs(tmp_path / "tmpfs", 2)
        engine = _save_striped(dirs, tmp_path / "ckpt", reference)
        engine.destroy()
        first_parts, files = shards(tmp_path / "ckpt" / "global_step3")
        assert not [f for f in files if ".stripe" in f]
        for path in first_parts:
            assert shard_source(path) == path
            with SafetensorsReader(path, direct=False) as r:
                assert "stripes" not in r.metadata()
        resumed, same = _resume(dirs, tmp_path / "ckpt", reference)
        resumed.destroy()
        assert same


def test_parts_that_no_link_can_take_give_one_plain_shard(tmp_path, reference, monkeypatch):
    """The drives share the checkpoint's device but every link is refused (a bind mount of it: EXDEV):
    each shard is still one plain file, not a striped shard of copies, and nothing else is left."""
    import swapper._sub_group_files as files

    dirs = drive_dirs(tmp_path, 2)
    monkeypatch.setattr(files, "_hard_link", lambda src, dst: False)
    engine = _save_striped(dirs, tmp_path / "ckpt", reference)
    monkeypatch.undo()
    first_parts, rank_files = shards(tmp_path / "ckpt" / "global_step3")
    assert first_parts and not [f for f in rank_files if ".stripe" in f]
    assert all(shard_source(p) == p and os.stat(p).st_nlink == 1 for p in first_parts)
    batches, losses, _ = reference
    assert train_engine(engine, batches[STEPS:], STEPS) == losses[STEPS:]
    engine.destroy()
    _same_state(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), reference[2])


def test_the_same_state_saved_twice_is_linked_twice(tmp_path, reference):
    """Two saves with no step between them: the second links the very parts the first did (the
    swap files are a checkpoint's already, never rewritten), and each loads."""
    dirs = drive_dirs(tmp_path, 2)
    engine = _save_striped(dirs, tmp_path / "ckpt", reference)
    engine.save_checkpoint(tmp_path / "ckpt", tag="again")
    engine.destroy()
    first, _ = shards(tmp_path / "ckpt" / "global_step3")
    again, _ = shards(tmp_path / "ckpt" / "again")
    assert [[ident(p) for p in shard_source(f).parts] for f in first] == \
        [[ident(p) for p in shard_source(f).parts] for f in again]
    for tag in ("global_step3", "again"):
        engine, same = _resume(dirs, tmp_path / "ckpt", reference, tag=tag)
        engine.destroy()
        assert same


@pytest.mark.parametrize("drives,block", [(3, 4096), (2, 131072)])
def test_a_striped_shard_loads_into_drives_cut_otherwise(tmp_path, reference, drives, block):
    """Saved over two drives in 64 KiB units; loaded over three drives, or two in 128 KiB units: the
    parts cannot become the swap files, so their bytes are read and copied, and training goes on exactly."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _save_striped(drive_dirs(tmp_path / "a", 2), tmp_path / "ckpt", reference).destroy()
    dirs = drive_dirs(tmp_path / "b", drives)
    settings = _striped_settings(dirs)
    settings["aio"]["block_size"] = block
    engine = make_engine(dirs[0], seed=1, overrides=settings)
    engine.load_checkpoint(tmp_path / "ckpt")
    parts = [p for f in shards(tmp_path / "ckpt" / "global_step3")[0] for p in shard_source(f).parts]
    assert not set(map(ident, parts)) & inodes(dirs)  # copied, not linked
    batches, losses, _ = reference
    assert train_engine(engine, batches[STEPS:], STEPS) == losses[STEPS:]
    engine.destroy()


def _damage_setup(tmp_path, reference):
    dirs = drive_dirs(tmp_path, 2)
    _save_striped(dirs, tmp_path / "ckpt", reference).destroy()  # (its swap files linked no more)
    first_parts, _ = shards(tmp_path / "ckpt" / "global_step3")
    return dirs, first_parts[0]


def _load_fails(dirs, tmp_path, error, match):
    engine = make_engine(dirs[0], seed=1, overrides=_striped_settings(dirs))
    with pytest.raises(error, match=match):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert engine.global_steps == 0
    engine.destroy()


def test_a_missing_part_is_named(tmp_path, reference):
    dirs, path = _damage_setup(tmp_path, reference)
    os.unlink(path + ".stripe1")
    _load_fails(dirs, tmp_path, FileNotFoundError, r"striped over 2 files and .*stripe1 is missing")
    with pytest.raises(FileNotFoundError, match="stripe1 is missing"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")


def test_changed_bytes_in_a_part_are_caught_by_the_checksums(tmp_path, reference):
    dirs, path = _damage_setup(tmp_path, reference)
    with open(path + ".stripe1", "r+b") as f:  # the second stripe unit: master's values
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    _load_fails(dirs, tmp_path, CheckpointCorruptionError, "is damaged")


@pytest.mark.parametrize("stripes,unit", [("1", None), ("x", None), ("999", None), ("2", "100"), ("\u00b2", None),
                                          ("2", "9" * 40)])
def test_stripes_out_of_range_are_refused(tmp_path, reference, stripes, unit):
    dirs, path = _damage_setup(tmp_path, reference)
    with open(path, "r+b") as f:  # rewrite the header in its page, same length (padded with spaces)
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header["__metadata__"]["stripes"] = stripes
        if unit is not None:
            header["__metadata__"]["stripe_unit"] = unit
        raw = json.dumps(header).encode()
        assert len(raw) <= n
        f.seek(8)
        f.write(raw.ljust(n, b" "))
    _load_fails(dirs, tmp_path, CheckpointCorruptionError, "damaged: its header says it is striped")


# -- the readers ------------------------------------------------------------------------------------

def _striped_tensors(tmp_path, n=3, unit=65536):
    """A safetensors file written as one, then cut into ``n`` parts as a striped file would hold it."""
    tensors = {"a": torch.randn(70_001), "b": torch.arange(33_333, dtype=torch.int32), "c": torch.randn(5)}
    plain = tmp_path / "plain.safetensors"
    from nvmeio.safetensors_file import save_file
    save_file(tensors, plain)
    data = plain.read_bytes()
    dirs = drive_dirs(tmp_path, n)
    f = striped(dirs, "s.safetensors", unit)
    units = [data[i:i + unit] for i in range(0, len(data), unit)]
    for k, p in enumerate(f.parts):
        with open(p, "wb") as out:
            out.write(b"".join(units[k::n]))
    assert assemble(f) == data
    return tensors, f, data


@pytest.mark.parametrize("direct", [True, False])
def test_safetensors_reader_reads_a_striped_file_as_the_plain_one(tmp_path, direct):
    tensors, f, _ = _striped_tensors(tmp_path)
    with SafetensorsReader(f, direct=direct, buffer_size=1 << 20) as r:
        assert r.name == f.parts[0] and r.source == f
        for name, t in tensors.items():
            assert torch.equal(r.get_tensor(name), t)
        assert torch.equal(r.read_range("a", 65_000, 70_001), tensors["a"][65_000:])
        assert b"".join(bytes(v) for v in r.views("b")) == tensors["b"].numpy().tobytes()


def test_fast_file_reader_over_a_striped_file(tmp_path):
    _, f, data = _striped_tensors(tmp_path)
    with FastFileReader(f, buffer_size=1 << 20) as r:
        assert r.size == len(data)
        assert r.read() == data
        r.seek(65_530)
        assert r.read(20) == data[65_530:65_550]  # across a unit (and a part) boundary
        assert b"".join(bytes(v) for v in r.views(4096, 200_000)) == data[4096:204_096]
        with pytest.raises(OSError, match="striped over several files"):
            r.fileno()
    os.truncate(f.parts[1], 4096)
    with pytest.raises(OSError, match="part 2 of 3"):
        FastFileReader(f)


def test_striped_page_reader_stops_at_a_part_cut_short(tmp_path):
    _, f, data = _striped_tensors(tmp_path)
    with StripedPageReader(f) as r:
        assert r.size == len(data) and r.read() == data
        r.seek(-10, os.SEEK_END)
        assert r.read() == data[-10:]
    os.truncate(f.parts[1], 1000)  # unit 1 now holds 1000 bytes
    with StripedPageReader(f) as r:
        assert r.read(200_000) == data[:65536 + 1000]


def test_the_shard_reader_keeps_few_shards_open_and_reads_the_same(tmp_path, reference, monkeypatch):
    """zero_to_fp32 through a ShardReader that may hold one shard open (each striped one holds a
    descriptor per part): the same tensors, never more than one shard open at once."""
    import zero.checkpoint.format as fmt

    dirs = drive_dirs(tmp_path, 2)
    settings = _striped_settings(dirs)
    settings["zero_optimization"]["sub_group_size"] = 20_000  # several shards (the values are the same)
    batches, losses, _ = reference
    engine = make_engine(dirs[0], overrides=settings)
    assert train_engine(engine, batches[:STEPS], STEPS) == losses[:STEPS]
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    assert len(shards(tmp_path / "ckpt" / "global_step3")[0]) > 1
    opened = []
    real = fmt.open_shard

    def counted(path, **how):
        reader = real(path, **how)
        opened.append(reader)
        return reader

    monkeypatch.setattr(fmt.ShardReader, "OPEN_SHARDS", 1)
    monkeypatch.setattr(fmt, "open_shard", counted)
    peak = []
    read = fmt.ShardReader.read

    def watched(self, *args, **kwargs):
        peak.append(sum(not r._file.closed for r in opened))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(fmt.ShardReader, "read", watched)
    _same_state(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), reference[2])
    assert len(opened) > 1 and max(peak) <= 1


def test_a_load_links_the_parts_it_can_and_writes_the_others(tmp_path, reference):
    """A disk drive and a tmpfs one, the checkpoint on the disk (checksums on: a staged load): the
    loaded swap file's disk part is the checkpoint's own (linked both ways), its tmpfs part written
    from the copy the save made; training resumes exactly, and the checkpoint is never written."""
    with tmpfs(tmp_path / "tmpfs", size="256m") as fast:
        dirs = [*drive_dirs(tmp_path, 1), fast]
        _save_striped(dirs, tmp_path / "ckpt", reference).destroy()
        sources = [shard_source(f) for f in shards(tmp_path / "ckpt" / "global_step3")[0]]
        before = {p: open(p, "rb").read() for s in sources for p in s.parts}
        engine = make_engine(dirs[0], seed=1, overrides=_striped_settings(dirs))
        engine.load_checkpoint(tmp_path / "ckpt")
        disk, other = inodes(dirs[:1]), inodes([fast])
        assert all(ident(s.parts[0]) in disk for s in sources)  # linked back
        assert not {ident(s.parts[1]) for s in sources} & other  # written: another file system
        batches, losses, _ = reference
        assert train_engine(engine, batches[STEPS:], STEPS) == losses[STEPS:]
        engine.destroy()
        assert {p: open(p, "rb").read() for p in before} == before
