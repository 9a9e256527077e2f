"""Handle settings change what really happens: ops split over
intra_op_parallelism threads, queue_depth requests in flight, one request per
syscall with single_submit, batch-wise reaping without overlap_events; and
the buffered fallback when O_DIRECT is not used."""

import os

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, random_bytes

BLOCK = 65536
QUEUE_BACKENDS = [b for b in ("io_uring", "aio") if b in nvmeio.available_backends()]


def write_blocks(h, nvme_dir, nblocks):
    src = h.new_cpu_locked_tensor(nblocks * BLOCK, torch.empty(0, dtype=torch.uint8))
    src.numpy()[:] = random_bytes(nblocks * BLOCK)
    h.sync_pwrite(src, nvme_dir / "m.bin")
    assert file_bytes(nvme_dir / "m.bin") == src.numpy().tobytes()
    return h.stats()


@pytest.mark.parametrize("parallelism", [1, 2, 4, 8])
def test_one_op_is_split_over_every_thread(nvme_dir, parallelism):
    h = nvmeio.aio_handle(block_size=BLOCK, intra_op_parallelism=parallelism)
    stats = write_blocks(h, nvme_dir, 4 * parallelism)
    assert len(stats) == parallelism
    assert [s["slices"] for s in stats] == [1] * parallelism
    assert [s["requests"] for s in stats] == [4] * parallelism


def test_small_op_is_not_split_below_one_block(nvme_dir):
    h = nvmeio.aio_handle(block_size=BLOCK, intra_op_parallelism=8)
    write_blocks(h, nvme_dir, 1)
    assert sum(s["slices"] for s in h.stats()) == 1


@pytest.mark.parametrize("backend", QUEUE_BACKENDS)
@pytest.mark.parametrize("depth", [1, 4, 16])
def test_queue_depth_requests_are_in_flight(nvme_dir, depth, backend):
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=depth, overlap_events=True, backend=backend)
    (s,) = write_blocks(h, nvme_dir, 64)
    assert s["max_inflight"] == depth


@pytest.mark.parametrize("backend", QUEUE_BACKENDS)
def test_single_submit_makes_one_syscall_per_request(nvme_dir, backend):
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=16, single_submit=True, backend=backend)
    (s,) = write_blocks(h, nvme_dir, 64)
    assert s["submit_calls"] == s["requests"] == 64
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=16, single_submit=False, backend=backend)
    (s,) = write_blocks(h, nvme_dir, 64)
    assert s["submit_calls"] == 64 // 16


@pytest.mark.parametrize("backend", QUEUE_BACKENDS)
def test_without_overlap_events_each_batch_is_reaped_whole(nvme_dir, backend):
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=4, overlap_events=False, backend=backend)
    (s,) = write_blocks(h, nvme_dir, 64)
    assert s["reap_calls"] == 64 // 4


def test_unaligned_buffer_goes_through_bounce_buffers(nvme_dir):
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=4)
    base = np.empty(8 * BLOCK + 1, np.uint8)
    src = base[1:] if base.__array_interface__["data"][0] % 4096 == 0 else base[:-1]
    src[:] = random_bytes(src.size)
    h.sync_pwrite(src, nvme_dir / "b.bin")
    (s,) = h.stats()
    assert s["bounced"] == s["requests"] >= 8
    assert file_bytes(nvme_dir / "b.bin") == src.tobytes()


def test_buffered_fallback_is_reported_and_correct(nvme_dir, monkeypatch):
    monkeypatch.setenv("NVMEIO_DIRECT_IO", "0")
    h = nvmeio.aio_handle(block_size=BLOCK, intra_op_parallelism=3)
    assert not h.buffered_fallback()
    src = random_bytes(1_000_003)
    with pytest.warns(RuntimeWarning, match="falls back to buffered I/O"):
        h.sync_pwrite(src, nvme_dir / "f.bin", file_offset=11)
    assert h.buffered_fallback()
    dst = np.empty_like(src)
    h.sync_pread(dst, nvme_dir / "f.bin", file_offset=11)
    assert np.array_equal(src, dst)
    assert os.path.getsize(nvme_dir / "f.bin") == 1_000_014
    assert sum(s["bounced"] for s in h.stats()) == 0   # no alignment rules without O_DIRECT


def test_direct_io_is_used_by_default(nvme_dir):
    h = nvmeio.aio_handle()
    h.sync_pwrite(random_bytes(1 << 20), nvme_dir / "d.bin")
    assert not h.buffered_fallback()
