"""DeepSpeed aio_handle parity: return values, getters, file sizes, the
combined pread/pwrite forms, whole-file read/write and validate."""

import os
import time

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, random_bytes

DEEPSPEED_METHODS = ("async_pread async_pwrite free_cpu_locked_tensor get_alignment get_block_size "
                     "get_intra_op_parallelism get_overlap_events get_queue_depth get_single_submit "
                     "is_pinned new_cpu_locked_tensor pread pwrite read sync_pread sync_pwrite wait "
                     "write").split()


def test_has_every_deepspeed_method():
    h = nvmeio.aio_handle()
    missing = [m for m in DEEPSPEED_METHODS if not callable(getattr(h, m, None))]
    assert missing == []


def test_defaults_and_getters_match_deepspeed():
    h = nvmeio.aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == (1048576, 128, False, False, 1)
    h = nvmeio.aio_handle(block_size=262144, queue_depth=32, single_submit=True,
                          overlap_events=True, intra_op_parallelism=8)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == (262144, 32, True, True, 8)
    assert h.get_alignment() == 8 * 512


def test_async_pwrite_then_wait_returns_one_and_exact_size(nvme_dir):
    h = nvmeio.aio_handle(queue_depth=32)
    t = torch.arange(3 * 1048576 + 7, dtype=torch.int8)
    assert h.async_pwrite(t, nvme_dir / "t.bin") == 0
    assert h.wait() == 1
    assert os.path.getsize(nvme_dir / "t.bin") == t.numel() * t.element_size()
    assert file_bytes(nvme_dir / "t.bin") == t.numpy().tobytes()


def test_wait_with_nothing_pending_returns_zero():
    assert nvmeio.aio_handle().wait() == 0


def test_many_async_ops_one_wait_counts_them(nvme_dir):
    h = nvmeio.aio_handle(intra_op_parallelism=2)
    bufs = [random_bytes(1000 + 4099 * i, seed=i) for i in range(10)]
    for i, b in enumerate(bufs):
        h.async_pwrite(b, nvme_dir / f"{i}.bin")
    assert h.wait() == 10
    outs = [np.empty_like(b) for b in bufs]
    for i, o in enumerate(outs):
        h.async_pread(o, nvme_dir / f"{i}.bin")
    assert h.wait() == 10
    for b, o in zip(bufs, outs):
        assert np.array_equal(b, o)


def test_sync_op_also_counts_earlier_pending_async_ops(nvme_dir):
    h = nvmeio.aio_handle()
    a, b = random_bytes(5000, 1), random_bytes(7000, 2)
    h.async_pwrite(a, nvme_dir / "a.bin")
    assert h.sync_pwrite(b, nvme_dir / "b.bin") == 2
    assert file_bytes(nvme_dir / "a.bin") == a.tobytes()


def test_pread_pwrite_fourth_positional_argument_is_async(nvme_dir):
    h = nvmeio.aio_handle()
    src = random_bytes(123457)
    assert h.pwrite(src, str(nvme_dir / "p.bin"), False, True) == 0   # async
    assert h.wait() == 1
    dst = np.empty_like(src)
    assert h.pread(dst, str(nvme_dir / "p.bin"), False, False) == 1   # sync
    assert np.array_equal(src, dst)
    dst[:] = 0
    assert h.pread(dst, nvme_dir / "p.bin", **{"async": True}) == 0
    assert h.wait() == 1 and np.array_equal(src, dst)


def test_pwrite_with_file_offset(nvme_dir):
    h = nvmeio.aio_handle()
    a, b = random_bytes(10_000, 1), random_bytes(5_000, 2)
    h.pwrite(a, nvme_dir / "o.bin")
    h.pwrite(b, nvme_dir / "o.bin", False, False, 3000)
    expected = bytearray(a.tobytes())
    expected[3000:8000] = b.tobytes()
    assert file_bytes(nvme_dir / "o.bin") == bytes(expected)


def test_async_pwrite_accepts_an_open_fd(nvme_dir):
    h = nvmeio.aio_handle()
    src = random_bytes(70_001)
    fd = os.open(nvme_dir / "fd.bin", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        assert h.async_pwrite(src, fd, 100) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    assert file_bytes(nvme_dir / "fd.bin") == b"\0" * 100 + src.tobytes()


def test_write_replaces_whole_file_and_read_requires_equal_size(nvme_dir):
    h = nvmeio.aio_handle()
    path = nvme_dir / "w.bin"
    path.write_bytes(b"x" * 1_000_000)             # longer than what we write
    src = random_bytes(300_001)
    assert h.write(src, path) == 0
    assert file_bytes(path) == src.tobytes()        # replaced, not overwritten in place
    assert sorted(os.listdir(nvme_dir)) == ["w.bin"]  # no temporary left
    dst = np.empty_like(src)
    assert h.read(dst, path) == 0 and np.array_equal(src, dst)
    with pytest.raises(ValueError, match=r"holds 300001 bytes but the buffer has 300002"):
        h.read(np.empty(300_002, np.uint8), path)


def test_validate_passes_for_good_io(nvme_dir):
    h = nvmeio.aio_handle()
    src = random_bytes(99_999)
    assert h.pwrite(src, nvme_dir / "v.bin", True) == 1
    dst = np.empty_like(src)
    assert h.pread(dst, nvme_dir / "v.bin", True) == 1
    assert h.write(src, nvme_dir / "v2.bin", True) == 0


def test_validate_raises_when_file_differs(nvme_dir):
    h = nvmeio.aio_handle()
    src = random_bytes(50_000)
    path = nvme_dir / "v.bin"
    h.pwrite(src, path, True, True)  # async + validate: checked by wait()
    while h.pending():
        time.sleep(0.001)
    with open(path, "r+b") as f:       # change a byte behind the handle's back
        f.seek(12_345)
        f.write(bytes([src[12_345] ^ 0xFF]))
    with pytest.raises(nvmeio.ValidationError, match="differ at byte 12345") as e:
        h.wait()
    assert e.value.filename == str(path)


def test_pending_counts_ops_until_they_finish_and_wait_then_does_not_block(nvme_dir):
    from swapper._io_queue import IoKind, IoQueue

    h = nvmeio.aio_handle()
    src = random_bytes(1 << 20)
    assert h.pending() == 0
    h.async_pwrite(src, nvme_dir / "p.bin")
    assert h.pending() in (0, 1)  # 1 until the worker finishes it
    assert h.wait() == 1 and h.pending() == 0
    queue, dst, done = IoQueue(h), torch.empty(1 << 20, dtype=torch.uint8), []
    assert queue.landed()  # nothing in flight
    queue.submit(IoKind.READ, dst, str(nvme_dir / "p.bin"), 0, done.append)
    deadline = time.monotonic() + 30
    while not queue.landed():
        assert time.monotonic() < deadline, "a 1 MiB read never finished"
        time.sleep(0.001)
    assert done == [] and queue.drain() == 1 and done == [None]  # callbacks run at drain only
    assert bytes(dst.numpy()) == bytes(src)


def test_unknown_keyword_is_a_type_error(nvme_dir):
    with pytest.raises(TypeError, match="asyn"):
        nvmeio.aio_handle().pwrite(random_bytes(10), nvme_dir / "k.bin", asyn=True)


def test_pathlike_and_bytes_paths(nvme_dir):
    h = nvmeio.aio_handle()
    src = random_bytes(4096 * 3)
    h.sync_pwrite(src, os.fsencode(nvme_dir / "b.bin"))
    dst = np.empty_like(src)
    h.sync_pread(dst, nvme_dir / "b.bin")
    assert np.array_equal(src, dst)


def test_bytearray_and_memoryview_buffers(nvme_dir):
    h = nvmeio.aio_handle()
    src = bytes(random_bytes(10_007))
    h.sync_pwrite(src, nvme_dir / "m.bin")            # read-only source is fine
    dst = bytearray(len(src))
    h.sync_pread(memoryview(dst), nvme_dir / "m.bin")
    assert bytes(dst) == src


def _aio_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "[aio]" in line)


def test_close_frees_kernel_aio_contexts_at_once(nvme_dir):
    if "aio" not in nvmeio.available_backends():
        pytest.skip("kernel AIO is refused here")
    before = _aio_mappings()
    h = nvmeio.aio_handle(backend="aio", intra_op_parallelism=4)
    assert _aio_mappings() == before + 4          # one context per worker
    src = random_bytes(100_000)
    h.async_pwrite(src, nvme_dir / "c.bin")
    h.close()                                      # completes the pending write first
    assert _aio_mappings() == before
    assert file_bytes(nvme_dir / "c.bin") == src.tobytes()
    assert h.closed
    with pytest.raises(ValueError, match="closed aio_handle"):
        h.sync_pwrite(src, nvme_dir / "d.bin")
    assert not (nvme_dir / "d.bin").exists()
    h.close()                                      # twice is harmless


def test_handle_as_context_manager(nvme_dir):
    src = random_bytes(5000)
    with nvmeio.aio_handle() as h:
        h.async_pwrite(src, nvme_dir / "cm.bin")
    assert h.closed and file_bytes(nvme_dir / "cm.bin") == src.tobytes()


@pytest.mark.parametrize("backend", nvmeio.available_backends())
def test_an_empty_write_at_a_large_offset_does_not_extend_the_file(nvme_dir, backend):
    # As pwrite(2) of 0 bytes: no byte moves, so the size stays; a missing file is created empty.
    h = nvmeio.aio_handle(backend=backend)
    path = nvme_dir / "small.bin"
    path.write_bytes(b"x" * 100)
    assert h.sync_pwrite(np.empty(0, np.uint8), path, file_offset=1 << 40) == 1
    assert os.path.getsize(path) == 100
    assert h.sync_pwrite(np.empty(0, np.uint8), nvme_dir / "new.bin", file_offset=1 << 30) == 1
    assert os.path.getsize(nvme_dir / "new.bin") == 0
    assert h.sync_pread(np.empty(0, np.uint8), path, file_offset=1 << 40) == 1   # never short


@pytest.mark.parametrize("write", [True, False])
def test_validate_with_a_file_descriptor_is_refused_before_anything_is_submitted(nvme_dir, write):
    # Regression: the op used to be submitted, then ValueError raised with it still in flight.
    h = nvmeio.aio_handle()
    path = nvme_dir / "fd.bin"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    try:
        op = h.pwrite if write else h.pread
        buf = random_bytes(4096, seed=3) if write else np.full(4096, 7, np.uint8)
        with pytest.raises(ValueError, match="validate=True needs a path, not a file descriptor"):
            op(buf, fd, True, True)
        assert h._native.pending() == 0 and h.wait() == 0
        assert file_bytes(path) == bytes(4096)      # nothing was written
        if not write:
            assert (buf == 7).all()                 # nothing was read
        assert h.pwrite(random_bytes(4096, seed=3), fd) == 1  # without validate the fd works
        assert file_bytes(path) == random_bytes(4096, seed=3).tobytes()
    finally:
        os.close(fd)
