"""FastFileWriter / FastFileReader: torch.save / torch.load through them, raw bytes
at odd sizes and chunkings, atomic replacement, and what a failed write leaves."""
import io
import os
import stat
import subprocess
import warnings

import numpy as np
import pytest
import torch

import nvmeio
from helpers import (all_dtypes, char_device_node, file_bytes, file_size_limit, loop_device_node,
                     random_bytes, random_tensor, same_bits)

SMALL = dict(buffer_size=8192)  # many buffer boundaries in small objects


def objects():
    yield "empty dict", {}
    yield "empty tensor", torch.empty(0)
    yield "every dtype", {str(d): random_tensor(d, (3, 7, 5), i) for i, d in enumerate(all_dtypes())}
    yield "odd sizes", [random_tensor(torch.uint8, (n,), n) for n in (1, 4095, 4096, 4097, 8191, 65537)]
    yield "nested", {"model": {"w": torch.randn(33, 17), "b": torch.zeros(17)},
                     "opt": {"step": 3, "state": [torch.arange(1001), (torch.ones(2, 3), "x")]},
                     "scalar": torch.tensor(2.5), "text": "héllo", "none": None}
    big = torch.randn(3 * (1 << 20) + 11)  # several default-size buffers of a small FastIO
    yield "views share storage", {"a": big, "a_view": big[5:100]}


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("name,obj", list(objects()), ids=[n for n, _ in objects()])
def test_torch_save_load_round_trip(nvme_dir, name, obj, double_buffer):
    path = nvme_dir / "obj.pt"
    with nvmeio.FastFileWriter(path, buffer_size=1 << 20, double_buffer=double_buffer) as f:
        torch.save(obj, f)
    reference = io.BytesIO()
    torch.save(obj, reference)
    assert file_bytes(path) == reference.getvalue()  # the same bytes torch.save writes to a file
    with nvmeio.FastFileReader(path, buffer_size=1 << 20, double_buffer=double_buffer) as f:
        back = torch.load(f, weights_only=True)
    assert same_bits(obj, back)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 8192 + 123])
def test_raw_bytes_any_chunking(nvme_dir, size):
    data = random_bytes(size, seed=size).tobytes()
    rng = np.random.default_rng(size)
    path = nvme_dir / "raw.bin"
    with nvmeio.FastFileWriter(path, **SMALL) as f:
        pos = 0
        while pos < size:
            k = int(rng.integers(1, 10000))
            assert f.write(memoryview(data)[pos:pos + k]) == len(data[pos:pos + k])
            pos += k
            assert f.tell() == min(pos, size)
    assert file_bytes(path) == data
    with nvmeio.FastFileReader(path, **SMALL) as f:
        got = bytearray()
        while chunk := f.read(int(rng.integers(1, 10000))):
            got += chunk
        assert bytes(got) == data
        for _ in range(50):  # random access
            start = int(rng.integers(0, size + 10))
            k = int(rng.integers(0, 20000))
            assert f.seek(start) == start
            assert f.read(k) == data[start:start + k]
        f.seek(0)
        assert f.read() == data
        f.seek(-min(size, 10), os.SEEK_END)
        assert f.read() == data[-min(size, 10):] if size else f.read() == b""


@pytest.mark.parametrize("double_buffer", [True, False])
def test_views_give_any_range_without_a_copy(nvme_dir, double_buffer):
    """views(offset, length): the range's bytes in order, out of the locked buffers; a read
    after them continues at the range's end; a range past the end is refused."""
    data = random_bytes(5 * 8192 + 777, seed=4).tobytes()
    path = nvme_dir / "v.bin"
    path.write_bytes(data)
    with nvmeio.FastFileReader(path, buffer_size=8192, double_buffer=double_buffer) as f:
        for offset, length in [(0, len(data)), (5, 100), (4095, 8194), (8192, 3 * 8192), (len(data), 0),
                               (100, len(data) - 100)]:
            views = list(bytes(v) for v in f.views(offset, length))
            assert b"".join(views) == data[offset:offset + length], (offset, length)
            assert all(len(v) <= 8192 for v in views) and f.tell() == offset + length
        f.seek(3)
        assert f.read(10) == data[3:13]  # the window is reloaded after views reused the buffers
        with pytest.raises(EOFError, match=r"pass its end"):
            next(f.views(len(data) - 5, 10))


def test_large_reads_into_aligned_and_unaligned_memory(nvme_dir):
    data = random_bytes(5 * 8192 + 777, seed=3)
    path = nvme_dir / "raw.bin"
    with nvmeio.FastFileWriter(path, **SMALL) as f:
        f.write(data)
    with nvmeio.FastFileReader(path, direct_min=4096, **SMALL) as f:
        for shift in (0, 1, 4095):  # a read the size of the file, at every memory phase
            base = np.zeros(data.size + 8192, np.uint8)
            start = (-base.__array_interface__["data"][0]) % 4096 + shift
            f.seek(0)
            assert f.readinto(base[start:start + data.size]) == data.size
            assert np.array_equal(base[start:start + data.size], data)
        f.seek(4096)  # file and memory both on a page boundary: straight into the caller's memory
        out = nvmeio.aio_handle().new_cpu_locked_tensor(data.size - 4096, torch.empty(0, dtype=torch.uint8))
        assert f.readinto(out.numpy()) == data.size - 4096
        assert np.array_equal(out.numpy(), data[4096:])


def test_writer_numpy_and_tensor_sources(nvme_dir):
    a = np.arange(1000, dtype=np.float64)
    path = nvme_dir / "np.bin"
    with nvmeio.FastFileWriter(path, **SMALL) as f:
        np.save(f, a)
        f.write(torch.arange(10, dtype=torch.int32).numpy())
    with nvmeio.FastFileReader(path) as f:
        assert np.array_equal(np.load(f), a)
        assert np.frombuffer(f.read(), dtype=np.int32).tolist() == list(range(10))


def test_atomic_old_file_untouched_until_close(nvme_dir):
    path = nvme_dir / "model.pt"
    path.write_bytes(b"old")
    f = nvmeio.FastFileWriter(path, **SMALL)
    f.write(random_bytes(100000).tobytes())
    assert path.read_bytes() == b"old"  # nothing visible before close
    f.close()
    assert path.read_bytes() == random_bytes(100000).tobytes()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(nvme_dir)) == ["model.pt"]


def test_exception_in_with_block_keeps_old_file_and_no_temp(nvme_dir):
    path = nvme_dir / "model.pt"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with nvmeio.FastFileWriter(path, **SMALL) as f:
            f.write(b"x" * 50000)
            raise RuntimeError("boom")
    assert path.read_bytes() == b"old"
    assert os.listdir(nvme_dir) == ["model.pt"]
    with pytest.raises(ValueError, match="closed"):
        f.write(b"y")


def test_writer_dropped_without_close_discards(nvme_dir):
    path = nvme_dir / "model.pt"
    f = nvmeio.FastFileWriter(path, **SMALL)
    f.write(b"x" * 10000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del f
    assert any(issubclass(w.category, ResourceWarning) and "discarded" in str(w.message) for w in caught)
    assert os.listdir(nvme_dir) == []


def test_symlink_at_target_is_replaced_not_followed(nvme_dir):
    victim = nvme_dir / "victim"
    victim.write_bytes(b"keep me")
    link = nvme_dir / "model.pt"
    link.symlink_to(victim)
    with nvmeio.FastFileWriter(link) as f:
        f.write(b"new")
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert victim.read_bytes() == b"keep me"


def test_not_atomic_writes_in_place(nvme_dir):
    path = nvme_dir / "a.bin"
    path.write_bytes(b"z" * 10000)
    with nvmeio.FastFileWriter(path, atomic=False, **SMALL) as f:
        f.write(b"abc")
    assert path.read_bytes() == b"abc"
    assert os.listdir(nvme_dir) == ["a.bin"]


def test_write_past_file_size_limit_keeps_old_file(nvme_dir):
    path = nvme_dir / "model.pt"
    path.write_bytes(b"old")
    with file_size_limit(64 * 1024):
        with pytest.raises(OSError) as e:
            with nvmeio.FastFileWriter(path, **SMALL) as f:
                f.write(random_bytes(200000).tobytes())
    assert e.value.errno == 27  # EFBIG
    assert path.read_bytes() == b"old"
    assert os.listdir(nvme_dir) == ["model.pt"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs permission to mount a 1 MiB tmpfs (root, not in an unprivileged container)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_keeps_old_file_and_says_so(tiny_tmpfs):
    path = tiny_tmpfs / "model.pt"
    path.write_bytes(b"old")
    with pytest.raises(OSError) as e:
        with nvmeio.FastFileWriter(path, **SMALL) as f:
            f.write(random_bytes(4 << 20).tobytes())
    assert e.value.errno == 28  # ENOSPC
    assert e.value.strerror.endswith("No space left on device") and os.fspath(e.value.filename) == str(path)
    assert path.read_bytes() == b"old"
    assert os.listdir(tiny_tmpfs) == ["model.pt"]


def test_writer_seeks_only_to_its_position(nvme_dir):
    with nvmeio.FastFileWriter(nvme_dir / "a.bin") as f:
        f.write(b"12345")
        assert f.seek(5) == 5 and f.seek(0, os.SEEK_CUR) == 5
        with pytest.raises(io.UnsupportedOperation, match="front to back"):
            f.seek(0)
        assert f.writable() and not f.seekable() and isinstance(f.fileno(), int)


def test_errors_name_the_problem(nvme_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        nvmeio.FastFileWriter(nvme_dir / "nope" / "a.pt")
    with pytest.raises(IsADirectoryError):
        nvmeio.FastFileWriter(nvme_dir)
    with pytest.raises(FileNotFoundError):
        nvmeio.FastFileReader(nvme_dir / "missing.pt")
    with pytest.raises(IsADirectoryError):
        nvmeio.FastFileReader(nvme_dir)
    with pytest.raises(ValueError, match="buffer_size"):
        nvmeio.FastIO(buffer_size=0)


def test_fast_io_lends_buffers_to_one_file_at_a_time(nvme_dir):
    with nvmeio.FastIO(buffer_size=8192) as fio:
        for i in range(3):
            with fio.writer(nvme_dir / f"{i}.bin") as f:
                f.write(bytes([i]) * 10000)
        w = fio.writer(nvme_dir / "x.bin")
        with pytest.raises(RuntimeError, match="one open file at a time"):
            fio.reader(nvme_dir / "0.bin")
        w.close()
        for i in range(3):
            with fio.reader(nvme_dir / f"{i}.bin") as f:
                assert f.read() == bytes([i]) * 10000
        assert fio.stats.files_written == 4 and fio.stats.bytes_written == 30000
        assert fio.stats.files_read == 3 and fio.stats.bytes_read == 30000


def test_a_block_device_is_written_in_place_not_replaced(nvme_dir):
    old = random_bytes(1 << 20, seed=1).tobytes()
    data = random_bytes(3 * 8192 + 123, seed=2).tobytes()
    with loop_device_node(nvme_dir, old) as (node, backing):
        with nvmeio.FastFileWriter(node, **SMALL) as f:
            f.write(data)
        assert stat.S_ISBLK(os.stat(node).st_mode)
        with open(node, "rb") as dev:
            assert dev.read() == data + old[len(data):]
    assert sorted(os.listdir(nvme_dir)) == ["backing.img", "loop"]


def test_a_character_device_is_written_in_place_not_replaced(nvme_dir):
    node = char_device_node(nvme_dir / "null")
    with nvmeio.FastFileWriter(node, **SMALL) as f:       # fsync's EINVAL is no error
        torch.save({"w": torch.ones(5000)}, f)
    assert stat.S_ISCHR(os.stat(node).st_mode) and os.listdir(nvme_dir) == ["null"]


@pytest.mark.parametrize("written,reserved", [(5000, 10 << 20), (3 * 8192 + 7, 3 * 8192 + 7), (100, 0)])
def test_reserved_bytes_not_written_are_cut_off_at_close(tmp_path, written, reserved):
    """reserve() allocates the whole file up front; the file still ends at its last byte."""
    data = random_bytes(written, 3).tobytes()
    path = tmp_path / "f.bin"
    with nvmeio.FastFileWriter(path, **SMALL) as f:
        f.reserve(reserved)
        f.write(data)
    assert file_bytes(path) == data


def test_a_reservation_the_disk_cannot_hold_fails_before_writing(tmp_path):
    path = tmp_path / "f.bin"
    f = nvmeio.FastFileWriter(path, **SMALL)
    with pytest.raises(OSError, match="cannot allocate"):
        f.reserve(1 << 60)
    f.abort()
    assert not path.exists() and os.listdir(tmp_path) == []
