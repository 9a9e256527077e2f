"""io_uring specifics: fixed buffers for locked tensors and bounce buffers,
fixed files for descriptors used by many requests, registrations dropped
when a locked tensor is freed."""

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, random_bytes
from nvmeio import faults

pytestmark = pytest.mark.skipif("io_uring" not in nvmeio.available_backends(),
                                reason="io_uring not built (no liburing-dev) or refused by this kernel")
BLOCK = 65536


def uring(**kw):
    return nvmeio.aio_handle(backend="io_uring", block_size=BLOCK, queue_depth=8, **kw)


def test_locked_tensor_uses_fixed_buffers_and_files(nvme_dir):
    h = uring()
    t = h.new_cpu_locked_tensor(32 * BLOCK, torch.empty(0, dtype=torch.uint8))
    t.numpy()[:] = random_bytes(t.numel())
    h.sync_pwrite(t, nvme_dir / "f.bin")
    (s,) = h.stats()
    assert s["fixed_buffers"] == s["requests"] == 32
    assert s["fixed_files"] == 32           # 32 requests on one descriptor: registered
    assert file_bytes(nvme_dir / "f.bin") == t.numpy().tobytes()


def test_freed_locked_tensor_is_no_longer_fixed(nvme_dir):
    h = uring()
    t = h.new_cpu_locked_tensor(4 * BLOCK, torch.empty(0, dtype=torch.uint8))
    h.free_cpu_locked_tensor(t)
    h.sync_pwrite(t, nvme_dir / "g.bin")    # memory still valid, no longer registered
    (s,) = h.stats()
    assert s["fixed_buffers"] == 0 and s["requests"] == 4


def test_collected_locked_tensor_is_unregistered(nvme_dir):
    h = uring()
    t = h.new_cpu_locked_tensor(4 * BLOCK, torch.empty(0, dtype=torch.uint8))
    del t                                   # memory unmapped: registration must go too
    fresh = h.new_cpu_locked_tensor(4 * BLOCK, torch.empty(0, dtype=torch.uint8))
    fresh.numpy()[:] = random_bytes(fresh.numel(), 3)
    h.sync_pwrite(fresh, nvme_dir / "h.bin")
    assert file_bytes(nvme_dir / "h.bin") == fresh.numpy().tobytes()


def test_unaligned_memory_goes_through_fixed_bounce_buffers(nvme_dir):
    h = uring()
    base = np.empty(8 * BLOCK + 4096, np.uint8)
    off = (-base.__array_interface__["data"][0]) % 4096 + 100
    src = base[off:off + 6 * BLOCK]
    src[:] = random_bytes(src.size)
    h.sync_pwrite(src, nvme_dir / "u.bin")
    (s,) = h.stats()
    assert s["bounced"] == s["fixed_buffers"] == s["requests"] == 6
    assert file_bytes(nvme_dir / "u.bin") == src.tobytes()


def test_small_ops_share_submissions(nvme_dir):
    # A 256 MiB op keeps the worker busy while 512 one-request ops are queued
    # behind it (15-30 ms of Python here); the worker then takes them in
    # batches, far fewer submissions than ops. The disk alone may write it
    # about as fast as a loaded machine queues them: each of its requests is
    # held 1 ms more, so the worker is busy >= 256 ms on any disk.
    h = nvmeio.aio_handle(backend="io_uring", block_size=1 << 20, queue_depth=64)
    big = h.new_cpu_locked_tensor(256 << 20, torch.empty(0, dtype=torch.uint8))
    bufs = [random_bytes(BLOCK, i) for i in range(512)]
    with faults.inject(delay_us=1000, path_contains="big.bin"):
        h.async_pwrite(big, nvme_dir / "big.bin")
        for i, b in enumerate(bufs):
            h.async_pwrite(b, nvme_dir / "one.bin", i * BLOCK)
        assert h.wait() == 513
    (s,) = h.stats()
    assert s["requests"] == 256 + 512
    assert s["submit_calls"] < 512 // 4      # measured here: 36
    assert file_bytes(nvme_dir / "one.bin") == b"".join(b.tobytes() for b in bufs)
