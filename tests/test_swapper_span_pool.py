"""SpanPool: one allocation handed out as page-aligned spans sized to each request, a spare region
for requests that cannot wait, all-or-none acquisition, exhaustion errors that say why."""
import threading

import pytest
import torch

import nvmeio
from swapper import PoolExhaustedError, SwapStateError
from swapper._span_pool import HOLDERS_NAMED, SpanPool

PAGE = 4096


@pytest.mark.parametrize("pin_memory", [True, False])
def test_spans_are_page_aligned_disjoint_and_sized_to_their_requests(pin_memory):
    sizes = [1, 4096, 4097, 3 * PAGE - 5, 10]
    with SpanPool(16 * PAGE, pin_memory=pin_memory) as pool:
        spans = pool.acquire(sizes)
        for span, size in zip(spans, sizes):
            assert span.tensor.data_ptr() % PAGE == 0 and span.tensor.dtype == torch.uint8
            assert span.nbytes == -(-size // PAGE) * PAGE
        ranges = sorted((s.tensor.data_ptr(), s.tensor.data_ptr() + s.nbytes) for s in spans)
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
        assert pool.held_bytes == sum(s.nbytes for s in spans) == 8 * PAGE
        pool.release(spans)
        assert pool.free_bytes == pool.nbytes == 16 * PAGE


def test_pinned_spans_are_locked_by_the_handle():
    handle = nvmeio.aio_handle()
    with SpanPool(4 * PAGE, handle=handle) as pool:
        (span,) = pool.acquire([PAGE])
        assert handle.is_pinned(span.tensor)
        pool.release([span])


def test_the_memory_of_one_large_span_holds_as_many_bytes_of_small_ones():
    with SpanPool(8 * PAGE, pin_memory=False) as pool:
        small = pool.acquire([PAGE] * 8)  # what a pool of whole buffers would hold as one
        for i, span in enumerate(small):
            span.tensor.fill_(i)
        assert [int(s.tensor[0]) for s in small] == list(range(8))
        pool.release(small)
        (large,) = pool.acquire([8 * PAGE])  # the frees coalesced into one run
        pool.release([large])


def test_a_cyclic_trace_of_mixed_sizes_runs_round_the_pool_without_fragmenting():
    pages = [1, 6, 1, 1, 4, 4, 4, 16]  # a layer's linears, then an embedding
    with SpanPool(48 * PAGE, pin_memory=False) as pool:
        held = []
        for step in range(400):  # first in, first out, never more than 32 pages held
            size = pages[step % len(pages)] * PAGE
            while sum(s.nbytes for s in held) + size > 32 * PAGE:
                pool.release([held.pop(0)])
            held += pool.acquire([size])
        assert len(pool._main.runs) <= 2  # the free bytes: ahead of the ring's head, and behind it
        pool.release(held)


def test_the_spare_region_is_only_for_requests_that_may_use_it():
    with SpanPool(8 * PAGE, spare_bytes=2 * PAGE, pin_memory=False) as pool:
        assert pool.main_bytes == 6 * PAGE
        ahead = pool.acquire([PAGE] * 6, spare=False)
        assert not any(s.spare for s in ahead)
        assert pool.fits([PAGE], spare=False) == 0 and pool.fits([PAGE, PAGE, PAGE], spare=True) == 2
        with pytest.raises(PoolExhaustedError, match=r"^caller asks for 4096 bytes but only 0 of 24576 are free"):
            pool.acquire([PAGE], spare=False)
        (blocking,) = pool.acquire([2 * PAGE])  # spare=True: the main region is full, so the spare one
        assert blocking.spare and blocking.offset == 6 * PAGE
        pool.release(ahead[:1])
        (again,) = pool.acquire([PAGE])  # the main region first, once it has room
        assert not again.spare
        pool.release(ahead[1:] + [blocking, again])


def test_fits_counts_the_leading_requests_that_would_be_placed_and_takes_nothing():
    with SpanPool(4 * PAGE, pin_memory=False) as pool:
        assert pool.fits([PAGE, 2 * PAGE, 2 * PAGE, PAGE]) == 2
        assert pool.free_bytes == 4 * PAGE
        spans = pool.acquire([PAGE, 2 * PAGE])
        assert pool.fits([PAGE, PAGE]) == 1
        pool.release(spans)


def test_acquire_is_all_or_none():
    with SpanPool(4 * PAGE, pin_memory=False) as pool:
        (first,) = pool.acquire([PAGE], holder="a")
        with pytest.raises(PoolExhaustedError):
            pool.acquire([PAGE, PAGE, 2 * PAGE], holder="b")
        assert pool.free_bytes == 3 * PAGE
        rest = pool.acquire([PAGE, 2 * PAGE])  # the failed request left the pool as it was
        pool.release([first] + rest)


def test_asking_for_more_than_the_pool_holds_errors_at_once_even_when_waiting():
    with SpanPool(8 * PAGE, spare_bytes=3 * PAGE, pin_memory=False) as pool:
        with pytest.raises(PoolExhaustedError, match=r"^x asks for 40960 bytes at once, but the pool has only "
                                                     r"32768; raise buffer_count$"):
            pool.acquire([5 * PAGE, 5 * PAGE], holder="x", timeout=None)
        with pytest.raises(PoolExhaustedError, match=r"^caller asks for 24576 bytes at once, but the pool has only "
                                                     r"20480 outside its spare region; raise buffer_count$"):
            pool.acquire([6 * PAGE], spare=False, timeout=None)
        with pytest.raises(PoolExhaustedError, match=r"^caller asks for a span of 24576 bytes, but the pool's "
                                                     r"largest region is 20480 bytes; raise buffer_count$"):
            pool.acquire([6 * PAGE], timeout=None)  # 6 pages: fewer than 8, more than either region


def test_exhaustion_names_the_holders_and_their_bytes():
    with SpanPool(4 * PAGE, pin_memory=False) as pool:
        held = pool.acquire([3 * PAGE], holder="partition 'a'")
        with pytest.raises(PoolExhaustedError) as info:
            pool.acquire([2 * PAGE], holder="partition 'b'")
        assert str(info.value) == (
            "partition 'b' asks for 8192 bytes but only 4096 of 16384 are free; held by: partition 'a' "
            "(12288 bytes). Release buffers first or raise buffer_count")
        pool.release(held)


def test_exhaustion_by_fragmentation_says_so():
    with SpanPool(4 * PAGE, pin_memory=False) as pool:
        spans = pool.acquire([PAGE] * 4, holder="p")
        pool.release([spans[0], spans[2]])  # two free pages, not next to each other
        with pytest.raises(PoolExhaustedError, match=r"^caller asks for 8192 bytes but only 8192 of 16384 are free "
                                                     r"\(fragmented: the largest free run is 4096 bytes\); held by: "
                                                     r"p \(4096 bytes\), p \(4096 bytes\)\."):
            pool.acquire([2 * PAGE])
        pool.release([spans[1], spans[3]])


def test_exhaustion_names_the_first_holders_and_counts_the_rest():
    count = HOLDERS_NAMED + 3
    with SpanPool(count * PAGE, pin_memory=False) as pool:
        spans = [pool.acquire([PAGE], holder=f"h{i}")[0] for i in range(count)]
        with pytest.raises(PoolExhaustedError) as info:
            pool.acquire([PAGE])
        named = ", ".join(f"h{i} (4096 bytes)" for i in range(HOLDERS_NAMED))
        assert f"held by: {named}, and 3 more. Release" in str(info.value)
        pool.release(spans)


def test_a_waiting_acquire_gets_its_span_when_another_thread_releases():
    with SpanPool(2 * PAGE, pin_memory=False) as pool:
        held = pool.acquire([2 * PAGE], holder="a")
        got = []
        waiter = threading.Thread(target=lambda: got.extend(pool.acquire([PAGE], holder="b", timeout=None)))
        waiter.start()
        pool.release(held)
        waiter.join()
        assert len(got) == 1 and got[0].holder == "b"
        pool.release(got)


def test_releasing_twice_or_closing_with_spans_out_is_refused():
    pool = SpanPool(2 * PAGE, pin_memory=False)
    (span,) = pool.acquire([PAGE], holder="a")
    with pytest.raises(SwapStateError, match=r"cannot close the pool while spans are held by: a \(4096 bytes\)"):
        pool.close()
    pool.release([span])
    with pytest.raises(SwapStateError, match=r"span at byte 0 released twice or not from this pool"):
        pool.release([span])
    pool.close()
    with pytest.raises(SwapStateError, match="the buffer pool is closed"):
        pool.acquire([PAGE])


@pytest.mark.parametrize("nbytes, spare, message", [
    (0, 0, r"nbytes must be a positive integer, got 0"),
    (PAGE, 2 * PAGE, r"spare_bytes must be an integer from 0 to nbytes \(4096\), got 8192"),
])
def test_bad_sizes_are_refused(nbytes, spare, message):
    with pytest.raises(ValueError, match=message):
        SpanPool(nbytes, spare, pin_memory=False)
