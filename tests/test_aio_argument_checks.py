"""Arguments the kernel or pybind would misread are refused up front with a
ValueError naming the argument: NUL bytes in paths (which would cut the path
short), integers out of range, settings too large to be sane."""

import os

import numpy as np
import pytest
import torch

import nvmeio
from nvmeio import _native
from nvmeio.settings import MAX_BLOCK_SIZE

NUL_MESSAGE = "filename contains a NUL byte, which would cut the path short"

CALLS = {
    "async_pread": lambda h, b, p: h.async_pread(b, p),
    "async_pwrite": lambda h, b, p: h.async_pwrite(b, p),
    "sync_pread": lambda h, b, p: h.sync_pread(b, p),
    "sync_pwrite": lambda h, b, p: h.sync_pwrite(b, p),
    "pread": lambda h, b, p: h.pread(b, p, False, True),
    "pwrite": lambda h, b, p: h.pwrite(b, p, False, True),
    "read": lambda h, b, p: h.read(b, p),
    "write": lambda h, b, p: h.write(b, p),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("kind", ["str", "bytes", "pathlike"])
def test_nul_in_a_path_is_refused_before_any_file_is_touched(nvme_dir, call, kind):
    victim = nvme_dir / "victim"
    if call in ("async_pread", "sync_pread", "pread", "read"):
        victim.write_bytes(b"v" * 1000)
    before = sorted(os.listdir(nvme_dir))
    raw = f"{victim}\0.ignored"
    path = {"str": raw, "bytes": os.fsencode(raw), "pathlike": _PathLike(raw)}[kind]
    h = nvmeio.aio_handle()
    with pytest.raises(ValueError, match=NUL_MESSAGE):
        CALLS[call](h, np.zeros(1000, np.uint8), path)
    assert sorted(os.listdir(nvme_dir)) == before
    assert h.wait() == 0


class _PathLike:
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


def test_the_native_core_refuses_a_nul_too(nvme_dir):
    h = _native.Handle(block_size=1 << 20, queue_depth=4, single_submit=False,
                       overlap_events=False, intra_op_parallelism=1, backend="psync",
                       direct_io=True)
    buf = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="path contains a NUL byte"):
        h.submit(True, buf.ctypes.data, 10, f"{nvme_dir}/victim\0.x", 0)
    assert os.listdir(nvme_dir) == []


@pytest.mark.parametrize("setting, value, message", [
    ("block_size", 8 << 30, "block_size must be at most 268435456, got 8589934592"),
    ("block_size", 1 << 70, "block_size must be at most 268435456"),
    ("queue_depth", 1 << 40, "queue_depth must be at most 32768"),
    ("intra_op_parallelism", 1 << 33, "intra_op_parallelism must be at most 1024"),
])
def test_settings_out_of_range_name_the_setting(setting, value, message):
    with pytest.raises(ValueError, match=message):
        nvmeio.aio_handle(**{setting: value})


def test_the_largest_block_size_is_accepted():
    h = nvmeio.aio_handle(block_size=MAX_BLOCK_SIZE)
    assert h.get_block_size() == 256 << 20
    h.close()


def test_offsets_and_descriptors_out_of_range_name_the_argument(nvme_dir):
    h = nvmeio.aio_handle()
    buf = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="file_offset 9223372036854775800 is out of range"):
        h.sync_pwrite(buf, nvme_dir / "x.bin", file_offset=(1 << 63) - 8)
    with pytest.raises(ValueError, match="file_offset must be a non-negative int"):
        h.sync_pwrite(buf, nvme_dir / "x.bin", file_offset=-1)
    with pytest.raises(ValueError, match=r"filename: file descriptor 1099511627776 is out of range"):
        h.sync_pwrite(buf, 1 << 40)
    assert os.listdir(nvme_dir) == []


def test_a_locked_tensor_too_large_to_size_names_num_elem():
    h = nvmeio.aio_handle()
    with pytest.raises(ValueError, match="num_elem 4611686018427387904 is out of range"):
        h.new_cpu_locked_tensor(1 << 62, torch.empty(0, dtype=torch.float32))
