"""DeepSpeed's fd overload: ``async_pwrite(buffer, fd, file_offset=0)`` and the keyword
names of every method; the fd stays the caller's; O_DIRECT or not, any offset."""
import inspect
import os

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, random_bytes


@pytest.fixture
def h():
    with nvmeio.aio_handle(block_size=8192, queue_depth=4, intra_op_parallelism=2) as handle:
        yield handle


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_fd_keyword_with_offsets(h, nvme_dir, direct):
    path = nvme_dir / "f.bin"
    flags = os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)  # as DeepSpeed's own tests open it
    pieces = [(0, 8192), (8192, 4096), (12288, 5000), (17288, 1), (20000, 12345)]
    expected = bytearray(32345)
    try:
        for i, (offset, n) in enumerate(pieces):
            data = torch.from_numpy(random_bytes(n, seed=i))
            assert h.async_pwrite(buffer=data, fd=fd, file_offset=offset) == 0
            expected[offset:offset + n] = data.numpy().tobytes()
        assert h.wait() == len(pieces)
        os.fstat(fd)  # still open: the handle never closes the caller's fd
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # nor moves it
    finally:
        os.close(fd)
    assert file_bytes(path) == bytes(expected)  # gaps are zero, tails exact

    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        out = np.zeros(12345, np.uint8)
        assert h.sync_pread(buffer=out, fd=fd, file_offset=20000) == 1
        assert out.tobytes() == bytes(expected[20000:])
        out = np.zeros(5000, np.uint8)
        h.async_pread(out, fd, 12288)  # positional, like the filename form
        h.wait()
        assert out.tobytes() == bytes(expected[12288:17288])
    finally:
        os.close(fd)


def test_positional_fd_and_sync_pwrite(h, nvme_dir):
    path = nvme_dir / "f.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        assert h.sync_pwrite(np.full(100, 7, np.uint8), fd, 3) == 1
    finally:
        os.close(fd)
    assert file_bytes(path) == b"\0" * 3 + b"\7" * 100


def test_fd_argument_errors(h, nvme_dir):
    buf = np.zeros(10, np.uint8)
    with pytest.raises(TypeError, match="either filename or fd"):
        h.async_pwrite(buf, str(nvme_dir / "x"), fd=3)
    with pytest.raises(TypeError, match="pass filename .* or fd="):
        h.async_pwrite(buf)
    with pytest.raises(TypeError, match="open file descriptor"):
        h.async_pwrite(buf, fd=-1)
    with pytest.raises(OSError):
        h.sync_pwrite(buf, fd=987654)  # not open


def test_keyword_names_are_deepspeeds():
    params = lambda m: list(inspect.signature(getattr(nvmeio.aio_handle, m)).parameters)[1:]
    for m in ("async_pread", "async_pwrite", "sync_pread", "sync_pwrite"):
        assert params(m)[:3] == ["buffer", "filename", "file_offset"] and "fd" in params(m)
    for m in ("pread", "pwrite"):  # the 4th is `async` in DeepSpeed: a Python keyword, taken by **kwargs
        assert params(m)[:5] == ["buffer", "filename", "validate", "async_op", "file_offset"]
    for m in ("read", "write"):
        assert params(m) == ["buffer", "filename", "validate"]


def test_async_keyword_of_pwrite(h, nvme_dir):
    path = str(nvme_dir / "f.bin")
    assert h.pwrite(buffer=np.ones(10, np.uint8), filename=path, validate=True, file_offset=0,
                    **{"async": True}) == 0
    assert h.wait() == 1
    assert file_bytes(path) == b"\1" * 10
