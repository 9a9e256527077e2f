"""PartitionedParamSwapper(pool=PackedSpans(...)): each partition takes a span of its own size from the
pool's bytes, read_ahead starts what fits outside the spare region and never fails for want of
room, blocking swap-ins and writes find the spare region."""
import pytest
import torch

from swapper import PackedSpans, PartitionedParamSwapper, PoolExhaustedError
from swapper._param_swapper import PartitionState
from swapper._span_pool import SpanPool

PAGE = 4096
FLOATS_PER_PAGE = PAGE // 4


@pytest.fixture
def packed(tmp_path, swappers):
    """``packed(buffer_count, spare_buffers, sizes)``: a packed swapper with buffers of one page
    and partitions of ``sizes[i]`` floats, all written: returns the swapper and their values."""
    def make(buffer_count, spare_buffers, sizes):
        s = swappers(PartitionedParamSwapper(
            tmp_path, {"queue_depth": 8}, buffer_count=buffer_count, buffer_size=max(sizes), max_in_cpu=0,
            pool=PackedSpans(spare_buffers=spare_buffers), read_queues=2, checksum="crc32"))
        g = torch.Generator().manual_seed(0)
        values = {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
        for pid, t in values.items():
            s.register(pid, t.numel())
        s.swap_out_tensors(list(values), list(values.values()))
        return s, values

    return make


def test_the_pool_holds_as_many_bytes_of_small_partitions_as_of_large_ones(packed):
    # Two buffers of 4 pages: whole buffers would hold two of these partitions, spans hold eight.
    s, values = packed(2, 0, [4 * FLOATS_PER_PAGE] + [FLOATS_PER_PAGE] * 8)
    assert isinstance(s.pool, SpanPool) and s.pool.nbytes == 8 * PAGE
    small = [f"p{i}" for i in range(1, 9)]
    out = s.swap_in(small)
    assert all(torch.equal(t, values[pid]) for pid, t in zip(small, out))
    assert s.pool.free_bytes == 0 and [s.buffer_bytes(pid) for pid in ("p0", "p1")] == [4 * PAGE, PAGE]
    with pytest.raises(PoolExhaustedError, match=r"^partition 'p0' asks for 16384 bytes but only 0 of 32768 are "
                                                 r"free; held by: ") as info:
        s.swap_in(["p0"])
    assert all(f"partition '{pid}' (4096 bytes)" in str(info.value) for pid in small)
    s.release(small[:4])
    assert torch.equal(s.swap_in(["p0"])[0], values["p0"])  # the four freed pages, coalesced
    s.release(small[4:] + ["p0"])
    assert s.pool.free_bytes == s.pool.nbytes


def test_read_ahead_starts_the_leading_partitions_that_fit_outside_the_spare_region(packed):
    s, values = packed(4, 1, [FLOATS_PER_PAGE] * 6)
    ids = list(values)
    assert s.read_ahead(ids) == 3  # 4 pages, 1 of them spare
    assert [s.state(pid) for pid in ids] == [PartitionState.READING] * 3 + [PartitionState.ON_NVME] * 3
    assert s.read_ahead(ids[3:]) == 0  # no room: nothing started, nothing raised
    blocking = s.swap_in(["p3"])[0]  # a swap-in that was not read ahead: the spare page
    assert s.in_spare("p3") and not s.in_spare("p0") and torch.equal(blocking, values["p3"])
    s.synchronize()
    assert all(torch.equal(s.swap_in([pid])[0], values[pid]) for pid in ids[:3])
    s.release(ids[:4])
    assert s.read_ahead(ids[3:]) == 3  # the partitions held already count as on their way
    s.synchronize()
    assert all(torch.equal(s.swap_in([pid])[0], values[pid]) for pid in ids[3:])
    s.release(ids[3:])


def test_read_ahead_completes_writes_in_flight_to_make_room(packed):
    s, values = packed(3, 1, [FLOATS_PER_PAGE] * 4)
    s.swap_out_tensors(["p0", "p1"], [values["p0"] + 1, values["p1"] + 1], async_op=True)
    assert s.state("p0") is PartitionState.WRITING
    assert s.read_ahead(["p2", "p3"]) == 2  # the two pages of the main region, after the writes
    assert s.state("p0") is PartitionState.ON_NVME
    s.synchronize()
    assert torch.equal(s.swap_in(["p0"])[0], values["p0"] + 1)
    s.release(["p0", "p2", "p3"])


def test_spare_buffers_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"spare_buffers must be a non-negative integer, got -1"):
        PackedSpans(spare_buffers=-1)
    with pytest.raises(ValueError, match=r"spare_buffers must be an integer from 0 to buffer_count \(2\), got 3"):
        PartitionedParamSwapper(tmp_path, buffer_count=2, buffer_size=10, pool=PackedSpans(spare_buffers=3))
