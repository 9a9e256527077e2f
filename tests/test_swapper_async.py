"""AsyncTensorSwapper: many tensors of odd sizes and dtypes to their files through a small pool."""
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from swapper import AsyncTensorSwapper, PinnedBufferPool, PoolExhaustedError
from swapper._async_swapper import WriteState
from swapper._swap_dir import SwapDirectory

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.bool, torch.complex64]


def _tensor(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) if not dtype.is_complex else torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-100, 100, (numel,), generator=g, dtype=dtype)


def _file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def _raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def swap(tmp_path):
    swap_dir = SwapDirectory(tmp_path, "job", 0, "tensors")
    pool = PinnedBufferPool(2, 4096, torch.uint8)  # two 4 KiB buffers: small on purpose
    swapper = AsyncTensorSwapper(swap_dir, pool, {"queue_depth": 8})
    yield swapper
    swapper.synchronize()
    assert pool.free_count == pool.buffer_count
    pool.close()
    swap_dir.cleanup()


def test_round_trip_of_many_odd_tensors_through_two_small_buffers(swap):
    sizes = [1, 3, 7, 100, 1023, 4096, 4097, 9999, 0, 5]
    tensors = [_tensor(n, DTYPES[i % len(DTYPES)], i) for i, n in enumerate(sizes)]
    names = [f"t{i}.swp" for i in range(len(tensors))]
    tickets = swap.swap_out(tensors, names)
    swap.synchronize()
    assert [t.state for t in tickets] == [WriteState.WRITTEN] * len(tensors)
    for t, name in zip(tensors, names):
        assert _file_bytes(swap.swap_dir.file(name)) == _raw(t)
    back = [torch.empty_like(t) for t in tensors]
    swap.swap_in(back, names)
    for a, b in zip(tensors, back):
        assert torch.equal(a, b)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 12000), min_size=1, max_size=8), dtype=st.sampled_from(DTYPES))
def test_round_trip_property(swap, sizes, dtype):
    tensors = [_tensor(n, dtype, n) for n in sizes]
    names = [f"p{i}.swp" for i in range(len(tensors))]
    swap.swap_out(tensors, names)
    swap.synchronize()
    back = [torch.empty_like(t) for t in tensors]
    swap.swap_in(back, names)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_sources_are_safe_to_reuse_as_soon_as_swap_out_returns(swap):
    src = torch.arange(3000, dtype=torch.float32)
    expected = _raw(src.clone())
    tickets = swap.swap_out([src], ["a.swp"])
    src.fill_(-1)  # before the write completes
    swap.synchronize()
    assert tickets[0].state is WriteState.WRITTEN
    assert _file_bytes(swap.swap_dir.file("a.swp")) == expected


def test_tensors_at_offsets_of_one_file(swap):
    a = torch.arange(10, dtype=torch.int32)
    b = torch.arange(100, 120, dtype=torch.int32)
    swap.swap_out([a, b], ["one.swp", "one.swp"], [0, 40])
    swap.synchronize()
    assert _file_bytes(swap.swap_dir.file("one.swp")) == _raw(a) + _raw(b)
    out = torch.empty(20, dtype=torch.int32)
    swap.swap_in([out], ["one.swp"], [40])
    assert torch.equal(out, b)


def test_small_tensors_share_a_buffer_each_piece_page_aligned(tmp_path):
    swap_dir = SwapDirectory(tmp_path, "job", 0, "tensors")
    with PinnedBufferPool(2, 3 * 4096, torch.uint8) as pool:
        swap = AsyncTensorSwapper(swap_dir, pool)
        tickets = swap.swap_out([torch.ones(10), torch.ones(20), torch.ones(30)], ["a", "b", "c"])
        assert swap.in_flight == 3
        assert pool.free_count == 1  # three writes, one buffer
        swap.synchronize()
        assert all(t.state is WriteState.WRITTEN for t in tickets) and pool.free_count == 2
    swap_dir.cleanup()


def test_pool_held_by_someone_else_is_a_clear_error(swap):
    held = swap.pool.acquire(2, holder="partition 'x'")
    with pytest.raises(PoolExhaustedError, match="partition 'x'"):
        swap.swap_out([torch.ones(4)], ["a.swp"])
    swap.pool.release(held)


def test_failed_write_marks_its_tickets_failed_and_returns_the_buffers(swap):
    t = torch.ones(100)
    swap.swap_dir.create("gone.swp")
    shutil.rmtree(swap.swap_dir.path)  # the directory vanishes behind the swapper's back
    with pytest.raises(OSError) as info:
        swap.swap_out([t], ["gone.swp"])
        swap.synchronize()
    assert "gone.swp" in str(info.value)
    assert swap.pool.free_count == 2
    os.mkdir(swap.swap_dir.path)


def test_mismatched_arguments_are_refused(swap):
    with pytest.raises(ValueError, match="2 tensors, 1 names"):
        swap.swap_out([torch.ones(1), torch.ones(1)], ["a"])
