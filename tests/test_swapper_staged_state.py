"""Staged state (swapper/_staged_state.py): a sub-group's state read once from another file,
hashed on the way, into a staging file that only ``publish_staged`` makes the swap file;
until then, and after ``discard_staged``, the sub-group is exactly as it was."""
import os
import shutil
import zlib

import pytest
import torch

from swapper import PartitionedOptimizerSwapper
from swapper.checksum import ChecksumAlgorithm
from swapper._staged_state import StagedRegion, stream_regions

NAMES = ("master", "exp_avg", "exp_avg_sq")


def _randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def write_shard(path, tensors, region_bytes):
    """A file in the swap layout: a header page, then each tensor padded to 4096 bytes."""
    with open(path, "wb") as f:
        f.write(b"H" * 4096)
        for t in tensors:
            raw = t.numpy().tobytes()
            f.write(raw + bytes(region_bytes - len(raw)))
    return {name: (str(path), 4096 + i * region_bytes) for i, name in enumerate(NAMES)}


@pytest.fixture
def setup(tmp_path, swappers):
    s = swappers(PartitionedOptimizerSwapper(tmp_path, {"queue_depth": 8}, buffer_count=2,
                                             checksum="crc32"))
    n = 5000  # not a multiple of 1024: each region ends in filler
    layout = s.register_sub_group(0, n)
    old = [_randn(n, i) for i in range(3)]
    s.initialize(0, old[0], {"exp_avg": old[1], "exp_avg_sq": old[2]})
    new = [_randn(n, 10 + i) for i in range(3)]
    (tmp_path / "ckpt").mkdir()
    shard = tmp_path / "ckpt" / "shard.bin"
    sources = write_shard(shard, new, layout.region_bytes)
    yield s, layout, old, new, shard, sources
    shutil.rmtree(tmp_path / "ckpt")


def state_of(s):
    t = s.swap_in(0)  # verified against the swapper's digests
    out = [t.master.clone(), t.exp_avg.clone(), t.exp_avg_sq.clone()]
    s.release(0)
    return out


@pytest.mark.parametrize("link", [True, False])
def test_a_staged_state_is_read_once_and_served_only_once_published(setup, link):
    s, layout, old, new, shard, sources = setup
    assert s.can_stage(0, sources)
    read_before = s.io_bytes.read
    staged = s.stage_state(0, sources, ChecksumAlgorithm.CRC32, link=link)
    assert s.io_bytes.read - read_before == 3 * layout.region_bytes  # each byte once
    assert staged.digests == {name: zlib.crc32(t.numpy().tobytes()) for name, t in zip(NAMES, new)}
    assert staged.linked == link and staged.bytes_written == (0 if link else 3 * layout.region_bytes)
    assert all(torch.equal(a, b) for a, b in zip(state_of(s), old))  # nothing changed yet

    master = s.publish_staged(staged, ("crc32", staged.digests))
    assert torch.equal(master, new[0])  # from the staging buffer, no read
    s.release_staged(staged)
    swap_file = s.swap_dir.file("subgroup0.swp")
    assert os.path.samefile(swap_file, shard) == link
    assert not any(n.endswith(".staged") for n in os.listdir(s.swap_dir.path))
    assert all(torch.equal(a, b) for a, b in zip(state_of(s), new))
    kept = shard.read_bytes()
    t = s.swap_in(0)
    t.master.add_(1.0)
    s.swap_out(0)  # a linked file is left to the checkpoint: the write goes to a new file
    assert shard.read_bytes() == kept


@pytest.mark.parametrize("link", [True, False])
def test_a_discarded_staged_state_leaves_the_sub_group_and_no_file(setup, link):
    s, layout, old, new, shard, sources = setup
    staged = s.stage_state(0, sources, ChecksumAlgorithm.CRC32, link=link)
    s.discard_staged(staged)
    assert sorted(os.listdir(s.swap_dir.path)) == ["subgroup0.swp"]
    assert all(torch.equal(a, b) for a, b in zip(state_of(s), old))
    assert s.pool.free_count == s.buffer_count
    with pytest.raises(Exception, match="no such staged state"):
        s.publish_staged(staged, ("crc32", staged.digests))


def test_publishing_with_checksums_on_needs_the_digests(setup):
    s, layout, old, new, shard, sources = setup
    staged = s.stage_state(0, sources, ChecksumAlgorithm.CRC32, link=False)
    with pytest.raises(Exception, match="needs the staged bytes' digests by crc32"):
        s.publish_staged(staged, ("xxhash", staged.digests))
    assert all(torch.equal(a, b) for a, b in zip(state_of(s), old))
    s.discard_staged(staged)


def test_a_source_without_its_filler_is_not_staged(setup, tmp_path):
    s, layout, old, new, shard, sources = setup
    short = tmp_path / "ckpt" / "short.bin"
    short.write_bytes(shard.read_bytes()[:4096 + 3 * layout.region_bytes - 1])
    assert not s.can_stage(0, {k: (str(short), o) for k, (_, o) in sources.items()})
    assert not s.can_stage(0, {k: (p, o + 4) for k, (p, o) in sources.items()})  # unaligned
    assert not s.can_stage(0, {"master": sources["master"]})


def test_streamed_digests_equal_whole_digests_across_chunks(tmp_path, monkeypatch):
    """Regions longer than a chunk are hashed piece by piece, the filler never."""
    import nvmeio
    from swapper import _staged_state as staged_state

    monkeypatch.setattr(staged_state, "CHUNK_BYTES", 1 << 20)
    n = (5 * (1 << 20) + 3 * 4096 + 100) // 4
    t = _randn(n, 3)
    span = -(-n * 4 // 4096) * 4096
    path = tmp_path / "src.bin"
    path.write_bytes(t.numpy().tobytes() + b"\xff" * (span - n * 4))
    raw = torch.empty(span, dtype=torch.uint8)
    handles = [nvmeio.aio_handle(queue_depth=8), nvmeio.aio_handle(queue_depth=8)]
    try:
        digests, written = stream_regions(handles, handles[1], raw,
                                          [StagedRegion("t", (str(path), 0), 0, n * 4, span)],
                                          ChecksumAlgorithm.CRC32, None)
    finally:
        for h in handles:
            h.close()
    assert written == 0 and digests == {"t": zlib.crc32(t.numpy().tobytes())}
    assert bytes(raw.numpy()) == path.read_bytes()


def test_staging_frees_the_pool_without_changing_any_sub_group(tmp_path, swappers):
    """With one pool buffer: a sub-group held changed in memory is written out first, one being
    read ahead is dropped; both keep their state."""
    s = swappers(PartitionedOptimizerSwapper(tmp_path, {"queue_depth": 8}, buffer_count=1, checksum="crc32"))
    n = 3000
    layouts = [s.register_sub_group(i, n) for i in range(2)]
    for i in range(2):
        s.initialize(i, _randn(n, i))
    (tmp_path / "ckpt").mkdir()
    sources = write_shard(tmp_path / "ckpt" / "shard.bin", [_randn(n, 20 + i) for i in range(3)],
                          layouts[0].region_bytes)
    t = s.swap_in(1)
    t.master.add_(1.0)  # changed, in host memory
    expected = t.master.clone()
    staged = s.stage_state(0, sources, ChecksumAlgorithm.CRC32, link=False)
    s.discard_staged(staged)
    t = s.swap_in(1)
    assert torch.equal(t.master, expected)
    s.release(1)
    s.swap_in(1, async_op=True)  # a read ahead in flight
    staged = s.stage_state(0, sources, ChecksumAlgorithm.CRC32, link=False)
    s.discard_staged(staged)
    assert torch.equal(s.swap_in(1).master, expected)
    s.release(1)
    shutil.rmtree(tmp_path / "ckpt")
