"""PartitionedParamSwapper.store_at: partitions whose bytes live in another owner's file (the fp32
master of an optimizer swap file), read from there at any byte offset, verified by their own
digests; fill() hands over values the owner still holds; settle() completes reads in flight."""
import os

import pytest
import torch

from swapper import (BufferTooSmallError, PackedSpans, PartitionedParamSwapper, SwapCorruptionError, SwapStateError,
                     WholeBuffers)
from swapper._errors import SwapFileTruncatedError
from swapper._param_swapper import HOME_SLACK_BYTES, PartitionState

SIZES = {"a": 1000, "b": 3, "c": 5000, "d": 1}  # back to back: offsets 0, 4000, 4012, 24012 (+ base)
BASE = 4096 + 8  # a header page, then 8 bytes: no home starts on a page


def owner_file(directory, values):
    """The owner's file: a header, then every partition's fp32 values back to back (no padding)."""
    path = directory / "owner.swp"
    flat = torch.cat([values[k] for k in SIZES])
    path.write_bytes(b"\xab" * BASE + flat.numpy().tobytes() + b"\xcd" * 5000)
    homes, offset = {}, BASE
    for key, n in SIZES.items():
        homes[key] = (str(path), offset)
        offset += n * 4
    return path, homes


@pytest.fixture(params=[False, True], ids=["buffers", "packed"])
def homed(request, tmp_path, tmp_path_factory, swappers):
    g = torch.Generator().manual_seed(0)
    values = {k: torch.randn(n, generator=g) for k, n in SIZES.items()}
    path, homes = owner_file(tmp_path_factory.mktemp("owner"), values)
    s = swappers(PartitionedParamSwapper(
        tmp_path, {"queue_depth": 8}, buffer_count=3, max_in_cpu=0, checksum="xxhash",
        buffer_size=max(SIZES.values()) + HOME_SLACK_BYTES // 4, read_queues=2,
        pool=PackedSpans() if request.param else WholeBuffers()))
    for key, n in SIZES.items():
        s.register(key, n)
    s.store_at(list(SIZES), [homes[k] for k in SIZES], [values[k] for k in SIZES])
    return s, values, path, homes


def test_partitions_read_from_unaligned_homes_hold_exactly_their_values(homed):
    s, values, _, _ = homed
    assert os.listdir(s.swap_dir.path) == []  # nothing written by the swapper itself
    assert s.nvme_bytes == 0
    for key in SIZES:
        assert s.state(key) is PartitionState.ON_NVME
        assert torch.equal(s.swap_in([key])[0], values[key]), key
        s.release([key])
    got = s.swap_in(["b", "c", "d"], async_op=True)  # one batch, reads in flight together
    s.synchronize()
    assert all(torch.equal(t, values[k]) for t, k in zip(got, "bcd"))


def test_a_changed_home_raises_naming_partition_and_file_and_neighbours_still_read(homed):
    s, values, path, homes = homed
    with open(path, "r+b") as f:
        f.seek(homes["c"][1] + 400)
        f.write(b"\x00" * 8)
    with pytest.raises(SwapCorruptionError, match=rf"partition 'c': swap file {path} changed since it was written"):
        s.swap_in(["c"])
    assert s.state("c") is PartitionState.ON_NVME  # its buffer is back
    assert torch.equal(s.swap_in(["a"])[0], values["a"])  # its pages overlap c's first bytes only


def test_store_at_updates_a_held_buffer_and_the_digest_for_new_bytes(homed):
    s, values, path, homes = homed
    held = s.swap_in(["a"])[0]
    new = values["a"] * 2
    with open(path, "r+b") as f:  # the owner writes the new values, as a step does
        f.seek(homes["a"][1])
        f.write(new.numpy().tobytes())
    s.store_at(["a"], [homes["a"]], [new])
    assert torch.equal(held, new) and s.state("a") is PartitionState.AVAILABLE
    s.release(["a"])
    assert torch.equal(s.swap_in(["a"])[0], new)  # read again, verified against the new digest


def test_fill_holds_values_the_owner_has_in_memory_without_reading(homed):
    s, values, path, homes = homed
    with open(path, "r+b") as f:  # the owner's write is still in flight: the file is stale
        f.seek(homes["b"][1])
        f.write(b"\xff" * 12)
    s.fill(["b"], [values["b"]])
    assert s.state("b") is PartitionState.AVAILABLE and torch.equal(s.swap_in(["b"])[0], values["b"])


def test_writing_new_data_gives_the_partition_its_own_file_again(homed):
    s, values, path, homes = homed
    s.swap_out_tensors(["b"], [values["b"] + 1])
    assert os.listdir(s.swap_dir.path) == ["param_b.swp"] and s.nvme_bytes == SIZES["b"] * 4
    with open(path, "r+b") as f:  # b's old home changes: nobody checks it any more
        f.seek(homes["b"][1])
        f.write(b"\x00" * 12)
    assert torch.equal(s.swap_in(["b"])[0], values["b"] + 1)
    assert torch.equal(s.swap_in(["a"])[0], values["a"])  # a's last page holds all of b's old home
    s.release(["b"])
    with pytest.raises(SwapStateError, match=r"fill\(\) is for partitions stored with store_at"):
        s.fill(["b"], [values["b"]])


def test_settle_completes_a_read_in_flight(homed):
    s, values, _, _ = homed
    s.swap_in(["a", "c"], async_op=True)
    assert s.state("a") is PartitionState.READING
    s.settle(["a"])
    assert s.state("a") is PartitionState.AVAILABLE and torch.equal(s.swap_in(["a"])[0], values["a"])


def test_a_truncated_home_is_refused_naming_the_file(homed):
    s, _, path, homes = homed
    os.truncate(path, homes["c"][1] + 100)
    with pytest.raises(SwapFileTruncatedError, match=rf"file {path} holding partition 'c' is \d+ bytes"):
        s.swap_in(["c"])


def test_buffers_without_the_slack_are_refused(tmp_path, swappers):
    s = swappers(PartitionedParamSwapper(tmp_path, {"queue_depth": 8}, buffer_count=2, max_in_cpu=0,
                                         buffer_size=1024))
    s.register("w", 1024)
    with pytest.raises(BufferTooSmallError, match=r"partition 'w' stored at byte 4100 of .* needs 8192 bytes "
                                                  r"of buffer, the pool holds 4096"):
        s.store_at(["w"], [("/nonexistent/f", 4100)], [torch.zeros(1024)])
    assert s.state("w") is PartitionState.UNWRITTEN  # refused before anything changed


def test_partitions_kept_in_host_memory_just_copy(tmp_path, swappers):
    s = swappers(PartitionedParamSwapper(tmp_path, {"queue_depth": 8}, buffer_count=2,
                                         buffer_size=64, max_in_cpu=10))
    assert s.register("small", 10) is PartitionState.IN_CPU
    s.store_at(["small"], [("/nonexistent/f", 4)], [torch.arange(10.0)])
    assert torch.equal(s.swap_in(["small"])[0], torch.arange(10.0)) and os.listdir(s.swap_dir.path) == []


def test_a_packed_span_covers_its_homes_skew_and_widens_for_a_new_home_that_needs_more(homed, tmp_path_factory):
    s, values, path, homes = homed
    if isinstance(s.pool_kind, WholeBuffers):
        pytest.skip("whole buffers have the slack for any skew")
    held = s.swap_in(["a"])[0]  # 4000 bytes, 8 into a page: one page
    assert s.buffer_bytes("a") == 4096 and torch.equal(held, values["a"])
    new = values["a"] + 1
    moved = tmp_path_factory.mktemp("moved") / "owner.swp"
    moved.write_bytes(b"\x00" * (4096 + 200) + new.numpy().tobytes() + b"\x00" * 4096)  # 200 into a page: 2 pages
    s.store_at(["a"], [(str(moved), 4096 + 200)], [new])
    assert s.state("a") is PartitionState.AVAILABLE and s.buffer_bytes("a") == 2 * 4096
    assert torch.equal(s.swap_in(["a"])[0], new)
    s.release(["a"])
    assert torch.equal(s.swap_in(["a"])[0], new)  # read again from the new home
    s.release(["a"])


def test_read_ahead_copies_what_the_owner_still_holds_instead_of_reading(homed):
    s, values, path, homes = homed
    with open(path, "r+b") as f:  # the owner's write is still in flight: the file is stale
        f.seek(homes["c"][1])
        f.write(b"\xff" * 16)
    assert s.read_ahead(["c", "a"], copies={"c": values["c"]}) == 2
    assert s.state("c") is PartitionState.AVAILABLE and s.state("a") is PartitionState.READING
    s.synchronize()
    assert torch.equal(s.swap_in(["c"])[0], values["c"]) and torch.equal(s.swap_in(["a"])[0], values["a"])
    s.release(["a", "c"])
    with pytest.raises(SwapStateError, match="copies are for partitions stored with store_at"):
        s.swap_out_tensors(["b"], [values["b"]])
        s.read_ahead(["b"], copies={"b": values["b"]})
