"""ActivationSwapper: blobs appended to one swap file per window, read back in any order (ahead
or not) bit for bit, checked against their checksums, and gone with their window."""
import os

import pytest
import torch

from swapper import SwapCorruptionError, SwapStateError
from swapper._activation_swapper import BUFFER_BYTES, ActivationSwapper


def _blob_bytes(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


SIZES = [1, 4095, 4096, 4097, 100_000, BUFFER_BYTES + 12_345]  # the last spans two pool buffers


def test_blobs_come_back_bit_for_bit_read_ahead_or_not(swappers, tmp_path):
    s = swappers(ActivationSwapper(tmp_path, job_id="job", checksum="crc32"))
    data = [_blob_bytes(n, i) for i, n in enumerate(SIZES)]
    blobs = [s.write(d.clone()) for d in data]  # the caller's copy dies at once: written from the pool
    assert [b.offset % 4096 for b in blobs] == [0] * len(SIZES)
    for b in blobs[::2]:
        s.read_ahead(b)
    for b, d in reversed(list(zip(blobs, data))):  # backward's order
        back = s.read(b)
        assert back.data_ptr() % 4096 == 0 and torch.equal(back, d)
    assert s.io_bytes.written == s.io_bytes.read == sum(SIZES)


def test_a_changed_swap_file_is_refused_naming_it(swappers, tmp_path):
    s = swappers(ActivationSwapper(tmp_path, job_id="job", checksum="crc32"))
    first, second = s.write(_blob_bytes(8192, 0)), s.write(_blob_bytes(8192, 1))
    s.read_ahead(first)  # completes the writes first
    s.read(first)
    path = s.swap_dir.file(s.file_name)
    with open(path, "r+b") as f:
        f.seek(second.offset + 5)
        f.write(b"\xff\x00\xff")
    with pytest.raises(SwapCorruptionError, match=rf"swap file {path} changed since it was written: crc32 of "
                                                  rf"bytes \[{second.offset}, {second.offset + 8192}\)"):
        s.read(second)


def test_the_window_file_goes_when_the_window_ends_and_its_blobs_with_it(swappers, tmp_path):
    s = swappers(ActivationSwapper(tmp_path, job_id="job"))
    blob = s.write(_blob_bytes(10_000, 0))
    s.read_ahead(s.write(_blob_bytes(10_000, 1)))  # a read still in flight when the window ends
    assert os.listdir(s.swap_dir.path) == ["window0"]
    s.end_window()
    assert os.listdir(s.swap_dir.path) == []
    with pytest.raises(SwapStateError, match="blob of window 0 asked for in window 1: its file was removed when "
                                             "that window ended"):
        s.read(blob)
    s.write(_blob_bytes(10, 2))
    assert os.listdir(s.swap_dir.path) == ["window1"]
    s.close()
    assert not os.path.exists(s.swap_dir.path)
    with pytest.raises(SwapStateError, match="the activation swapper was closed"):
        s.write(_blob_bytes(10, 3))
