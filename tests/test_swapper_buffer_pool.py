"""PinnedBufferPool: aligned locked buffers, handed out and returned, never grown."""
import os
import threading
import time

import pytest
import torch

import nvmeio
from swapper import (
    BufferTooSmallError,
    InsufficientHostMemoryError,
    PinnedBufferPool,
    PoolExhaustedError,
    SwapStateError,
)
from swapper.host_memory import HostMemory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize("pin_memory", [True, False])
def test_buffers_are_page_aligned_disjoint_and_sized(dtype, pin_memory):
    with PinnedBufferPool(3, 1001, dtype, pin_memory=pin_memory) as pool:
        bufs = pool.acquire(3)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        spans = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.nbytes) for b in bufs)
        for b in bufs:
            assert b.tensor.dtype == dtype and b.tensor.numel() == 1001
            assert b.tensor.data_ptr() % 4096 == 0
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
        assert pool.nbytes == 3 * ((1001 * itemsize + 4095) // 4096 * 4096)
        pool.release(bufs)


def test_pinned_buffers_are_locked_by_the_handle():
    handle = nvmeio.aio_handle()
    with PinnedBufferPool(2, 4096, torch.float32, handle=handle) as pool:
        (buf,) = pool.acquire(1)
        assert handle.is_pinned(buf.tensor)
        pool.release([buf])


def test_a_pool_pinned_through_a_handle_of_its_own_ends_that_handle_at_close():
    from nvmeio import resources

    with PinnedBufferPool(1, 4096, torch.uint8, pin_memory=True):
        pass  # warm: the I/O backend is chosen at the first handle of the process
    before = resources.snapshot()
    with PinnedBufferPool(2, 4096, torch.uint8, pin_memory=True) as pool:
        assert resources.snapshot().threads > before.threads
    assert pool.closed and resources.grown_since(before) == {}


def test_asking_for_more_buffers_than_exist_errors_at_once_even_when_waiting():
    with PinnedBufferPool(2, 16, pin_memory=False) as pool:
        start = time.monotonic()
        with pytest.raises(PoolExhaustedError, match=r"asks for 3 buffers at once, but the pool has only 2"):
            pool.acquire(3, timeout=None)
        assert time.monotonic() - start < 1.0


def test_exhausted_pool_errors_naming_the_holders():
    with PinnedBufferPool(2, 16, pin_memory=False) as pool:
        held = pool.acquire(1, holder="partition 'w1'")
        held += pool.acquire(1, holder="sub-group 7")
        with pytest.raises(PoolExhaustedError) as info:
            pool.acquire(1, holder="me")
        message = str(info.value)
        assert "only 0 of 2 are free" in message
        assert "partition 'w1'" in message and "sub-group 7" in message
        assert pool.free_count == 0
        pool.release(held)
        assert pool.free_count == 2


def test_acquire_waits_for_a_release_from_another_thread():
    with PinnedBufferPool(1, 16, pin_memory=False) as pool:
        held = pool.acquire(1)
        threading.Timer(0.1, pool.release, args=(held,)).start()
        (again,) = pool.acquire(1, timeout=5.0)
        assert again.index == held[0].index
        pool.release([again])


def test_acquire_with_timeout_gives_up_with_a_clear_error():
    with PinnedBufferPool(1, 16, pin_memory=False) as pool:
        held = pool.acquire(1)
        with pytest.raises(PoolExhaustedError, match=r"after waiting 0.05 s"):
            pool.acquire(1, timeout=0.05)
        pool.release(held)


def test_acquire_is_all_or_nothing():
    with PinnedBufferPool(3, 16, pin_memory=False) as pool:
        held = pool.acquire(2)
        with pytest.raises(PoolExhaustedError):
            pool.acquire(2)
        assert pool.free_count == 1
        pool.release(held)


def test_releasing_twice_is_an_error():
    with PinnedBufferPool(2, 16, pin_memory=False) as pool:
        held = pool.acquire(1)
        pool.release(held)
        with pytest.raises(SwapStateError, match="released twice"):
            pool.release(held)


def test_close_refuses_while_buffers_are_out():
    pool = PinnedBufferPool(2, 16, pin_memory=False)
    held = pool.acquire(1, holder="param 3")
    with pytest.raises(SwapStateError, match="param 3"):
        pool.close()
    pool.release(held)
    pool.close()
    assert pool.closed
    with pytest.raises(SwapStateError, match="closed"):
        pool.acquire(1)


def test_pool_larger_than_available_memory_is_refused(monkeypatch):
    small = HostMemory(available_bytes=10 * 4096, memlock_limit_bytes=None, locked_bytes=0)
    monkeypatch.setattr(HostMemory, "probe", classmethod(lambda cls: small))
    with pytest.raises(InsufficientHostMemoryError) as info:
        PinnedBufferPool(5, 4096, torch.float32)
    message = str(info.value)
    assert str(5 * 4096 * 4) in message and str(10 * 4096) in message
    assert "buffer_count" in message


def test_pool_over_the_memlock_limit_is_refused_unless_unpinned(monkeypatch):
    limited = HostMemory(available_bytes=1 << 40, memlock_limit_bytes=64 * 1024, locked_bytes=4096)
    monkeypatch.setattr(HostMemory, "probe", classmethod(lambda cls: limited))
    with pytest.raises(InsufficientHostMemoryError) as info:
        PinnedBufferPool(2, 16384, torch.float32)
    message = str(info.value)
    assert str(2 * 16384 * 4) in message and str(64 * 1024) in message and "ulimit -l" in message
    PinnedBufferPool(2, 16384, torch.float32, pin_memory=False).close()


def test_host_memory_probe_reads_this_machine():
    """Available memory lies within the machine's RAM, the memlock limit is this process's, and
    memory locked meanwhile shows in locked_bytes."""
    import resource

    before = HostMemory.probe()
    assert 0 < before.available_bytes <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert before.memlock_limit_bytes in (None, soft)  # None: unlimited, or CAP_IPC_LOCK
    h = nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    try:
        if not h.is_pinned(t):
            pytest.skip("cannot lock 1 MiB here (memlock limit, or NVMEIO_MLOCK=0)")
        assert HostMemory.probe().locked_bytes - before.locked_bytes >= 1 << 20
    finally:
        h.free_cpu_locked_tensor(t)
        h.close()


def test_sizes_accept_integral_floats_and_reject_the_rest():
    with PinnedBufferPool(2.0, 1e3, pin_memory=False) as pool:
        assert (pool.buffer_count, pool.buffer_size) == (2, 1000)
    for count, size in [(0, 16), (2, 0), (2, 1.5), (True, 16), ("2", 16)]:
        with pytest.raises(ValueError):
            PinnedBufferPool(count, size, pin_memory=False)


def test_buffer_views_in_other_dtypes_and_their_bounds():
    with PinnedBufferPool(1, 1024, torch.float32, pin_memory=False) as pool:
        (buf,) = pool.acquire(1)
        halves = buf.view(2048, torch.bfloat16)
        assert halves.data_ptr() == buf.tensor.data_ptr()
        assert buf.view(10, torch.float64, byte_offset=4016).numel() == 10
        with pytest.raises(BufferTooSmallError, match="do not fit"):
            buf.view(2049, torch.bfloat16)
        with pytest.raises(BufferTooSmallError):
            buf.view(1, torch.float64, byte_offset=4)  # misaligned for float64
        pool.release([buf])
