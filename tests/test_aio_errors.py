"""Bad input and failing I/O: an OSError subclass (or TypeError/ValueError
before any I/O) that names the path, never a hang, never a half-written new
file, and the handle stays usable."""

import errno
import os
import subprocess

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, file_size_limit, is_root, random_bytes


@pytest.fixture
def h():
    return nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=2)


def check_error(exc_info, path, offset, length):
    e = exc_info.value
    assert isinstance(e, nvmeio.AioError) and isinstance(e, OSError)
    assert e.filename == str(path)
    assert str(path) in str(e)
    assert (e.offset, e.length) == (offset, length)


@pytest.mark.parametrize("op", ["read", "write"])
def test_missing_directory(h, nvme_dir, op):
    path = nvme_dir / "no_such_dir" / "x.bin"
    buf = np.zeros(1000, np.uint8)
    call = h.sync_pread if op == "read" else h.sync_pwrite
    with pytest.raises(FileNotFoundError) as e:
        call(buf, path)
    check_error(e, path, 0, 1000)
    if op == "write":
        assert "directory" in str(e.value) and "does not exist" in str(e.value)


@pytest.mark.parametrize("op", ["read", "write"])
def test_path_is_a_directory(h, nvme_dir, op):
    call = h.sync_pread if op == "read" else h.sync_pwrite
    with pytest.raises(IsADirectoryError) as e:
        call(np.zeros(10, np.uint8), nvme_dir, 5)
    check_error(e, nvme_dir, 5, 10)


@pytest.mark.parametrize("op", ["read", "write"])
def test_path_through_a_regular_file(h, nvme_dir, op):
    (nvme_dir / "f").write_bytes(b"x")
    path = nvme_dir / "f" / "x.bin"
    call = h.sync_pread if op == "read" else h.sync_pwrite
    with pytest.raises(NotADirectoryError) as e:
        call(np.zeros(10, np.uint8), path)
    check_error(e, path, 0, 10)


def test_file_shorter_than_buffer_is_an_error_not_zeros(h, nvme_dir):
    path = nvme_dir / "short.bin"
    path.write_bytes(bytes(random_bytes(10_000)))
    buf = np.full(10_001, 7, np.uint8)
    with pytest.raises(nvmeio.ShortReadError, match="holds 10000 bytes") as e:
        h.async_pread(buf, path)
    check_error(e, path, 0, 10_001)
    assert e.value.errno == errno.ENODATA
    assert (buf == 7).all()                # untouched: refused before any I/O
    assert h.wait() == 0                   # the refused op was never counted


def test_offset_past_end_of_file(h, nvme_dir):
    path = nvme_dir / "eof.bin"
    path.write_bytes(b"a" * 8192)
    with pytest.raises(nvmeio.ShortReadError) as e:
        h.sync_pread(np.zeros(1, np.uint8), path, file_offset=8192)
    check_error(e, path, 8192, 1)


def test_write_past_file_size_limit_fails_before_any_write(h, nvme_dir):
    # The extending write preallocates its range first, so the limit is hit
    # at submit time: nothing written, no file left, nothing pending.
    path = nvme_dir / "big.bin"
    with file_size_limit(1 << 20):
        with pytest.raises(nvmeio.AioError) as e:
            h.async_pwrite(random_bytes(4 << 20), path)
    assert e.value.errno == errno.EFBIG
    assert e.value.filename == str(path) and "File too large" in str(e.value)
    assert not path.exists()
    assert h.wait() == 0
    # The handle is still usable after the error.
    src = random_bytes(4 << 20)
    assert h.sync_pwrite(src, path) == 1
    assert file_bytes(path) == src.tobytes()


def test_failed_extending_write_restores_the_old_size(h, nvme_dir):
    path = nvme_dir / "grow.bin"
    old = random_bytes(5000).tobytes()
    path.write_bytes(old)
    with file_size_limit(1 << 20):
        with pytest.raises(nvmeio.AioError, match="File too large"):
            h.sync_pwrite(random_bytes(2 << 20), path, file_offset=4096)
    assert file_bytes(path) == old


@pytest.mark.parametrize("backend", nvmeio.available_backends())
def test_error_during_io_is_raised_by_wait(backend):
    # /dev/full accepts the open and fails every write with ENOSPC.
    h = nvmeio.aio_handle(backend=backend)
    with pytest.raises(nvmeio.AioError) as e:
        h.async_pwrite(random_bytes(100_000), "/dev/full")
        h.wait()
    assert e.value.errno == errno.ENOSPC and e.value.filename == "/dev/full"
    assert h.wait() == 0


def test_full_disk_fails_cleanly(h, tmp_path):
    if not is_root():
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mount -t tmpfs is not permitted in this sandbox")
    try:
        path = mnt / "full.bin"
        with pytest.raises(nvmeio.AioError) as e:
            h.sync_pwrite(random_bytes(3 << 20), path)
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
        assert not path.exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_failed_overwrite_keeps_existing_file(h, nvme_dir):
    path = nvme_dir / "keep.bin"
    old = random_bytes(5000).tobytes()
    path.write_bytes(old)
    with file_size_limit(1 << 20):
        with pytest.raises(nvmeio.AioError):
            h.write(random_bytes(2 << 20), path)   # whole-file write goes via a temporary
    assert file_bytes(path) == old
    assert os.listdir(nvme_dir) == ["keep.bin"]


def test_non_contiguous_tensor_is_refused_before_io(h, nvme_dir):
    t = torch.arange(100.0).reshape(10, 10).t()
    with pytest.raises(ValueError, match="not contiguous"):
        h.async_pwrite(t, nvme_dir / "nc.bin")
    assert not (nvme_dir / "nc.bin").exists()
    assert h.wait() == 0


def test_non_cpu_tensor_is_refused(h, nvme_dir):
    t = torch.empty(10, device="meta")
    with pytest.raises(ValueError, match="device 'meta'"):
        h.async_pwrite(t, nvme_dir / "meta.bin")


def test_read_only_targets_are_refused(h, nvme_dir):
    path = nvme_dir / "ro.bin"
    path.write_bytes(b"z" * 100)
    with pytest.raises(TypeError, match="bytes is read-only"):
        h.sync_pread(b"\0" * 100, path)
    a = np.zeros(100, np.uint8)
    a.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        h.sync_pread(a, path)


def test_non_contiguous_numpy_and_wrong_types(h, nvme_dir):
    with pytest.raises(ValueError, match="not C-contiguous"):
        h.sync_pwrite(np.zeros((10, 10))[:, 1], nvme_dir / "x.bin")
    with pytest.raises(TypeError, match="got list"):
        h.sync_pwrite([1, 2, 3], nvme_dir / "x.bin")


def test_bad_offset_and_settings(h, nvme_dir):
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(np.zeros(10, np.uint8), nvme_dir / "x.bin", file_offset=-1)
    with pytest.raises(ValueError, match="queue_depth must be a positive int"):
        nvmeio.aio_handle(queue_depth=0)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        nvmeio.aio_handle(intra_op_parallelism=1.5)


def test_unavailable_backend_names_the_available_ones():
    with pytest.raises(ValueError, match="available backends: " + ", ".join(nvmeio.available_backends())):
        nvmeio.aio_handle(backend="spdk")


def test_error_in_one_async_op_does_not_lose_the_others(h, nvme_dir):
    good = [random_bytes(20_000, i) for i in range(4)]
    for i, b in enumerate(good):
        h.async_pwrite(b, nvme_dir / f"g{i}.bin")
    h.async_pwrite(random_bytes(3 << 20), "/dev/full")     # fails inside the I/O
    with pytest.raises(nvmeio.AioError, match="/dev/full"):
        h.wait()
    for i, b in enumerate(good):
        assert file_bytes(nvme_dir / f"g{i}.bin") == b.tobytes()
    assert h.wait() == 0


@pytest.mark.parametrize("backend", nvmeio.available_backends())
def test_writing_to_a_character_device_is_not_an_fdatasync_error(backend):
    # /dev/null refuses O_DIRECT, so the write is buffered and then fdatasync'ed,
    # which a character device answers with EINVAL after the data went through.
    h = nvmeio.aio_handle(backend=backend)
    with pytest.warns(RuntimeWarning, match="no O_DIRECT for '/dev/null'"):
        assert h.sync_pwrite(random_bytes(100_000), "/dev/null") == 1
    assert h.sync_pwrite(random_bytes(5000), "/dev/null", file_offset=123) == 1
    assert h.wait() == 0
