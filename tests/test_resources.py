"""nvmeio.resources: what a test counts as leaked. A thread joined a moment ago may still be listed
for a moment (the kernel wakes the joiner first): it is looked at again until it is gone; one left
running is counted; any other growth is reported at once. The process's own snapshots stand in
for here by a scripted sequence: other threads of the test process come and go on their own."""
import time

import pytest

from nvmeio import resources


def scripted(monkeypatch, threads, fds=None):
    """resources.snapshot gives these thread counts (and fd counts) in turn, then the last forever."""
    fds = fds or [10] * len(threads)
    seen = []

    def snapshot():
        i = min(len(seen), len(threads) - 1)
        seen.append(i)
        return resources.Resources(fds=fds[i], threads=threads[i], vmlck_kib=0, aio_contexts=0)

    monkeypatch.setattr(resources, "snapshot", snapshot)
    return seen


BEFORE = resources.Resources(fds=10, threads=5, vmlck_kib=0, aio_contexts=0)


def test_a_thread_still_listed_after_its_join_is_waited_out(monkeypatch):
    seen = scripted(monkeypatch, threads=[6, 6, 6, 5])
    assert resources.grown_since(BEFORE, settle_s=5.0) == {}
    assert len(seen) == 4  # looked again until it was gone


def test_a_thread_left_running_is_counted_once_the_wait_is_over(monkeypatch):
    scripted(monkeypatch, threads=[6])
    t0 = time.monotonic()
    assert resources.grown_since(BEFORE, settle_s=0.2) == {"threads": 1}
    assert time.monotonic() - t0 >= 0.2


@pytest.mark.parametrize("threads", [5, 6])
def test_other_growth_is_reported_at_once(monkeypatch, threads):
    seen = scripted(monkeypatch, threads=[threads], fds=[11])
    t0 = time.monotonic()
    grown = resources.grown_since(BEFORE, settle_s=5.0)
    assert grown == ({"fds": 1} if threads == 5 else {"fds": 1, "threads": 1})
    assert len(seen) == 1 and time.monotonic() - t0 < 2.0

