"""nvmeio.resources: what a test counts as leaked. A thread that was joined is never counted, however
long the kernel takes to unlist it; one left running always is."""
import threading
import time

from nvmeio import resources


def test_a_joined_thread_is_not_grown_and_a_running_one_is():
    before = resources.snapshot()
    done = threading.Event()
    running = threading.Thread(target=done.wait, daemon=True)
    running.start()
    try:
        t0 = time.monotonic()
        assert resources.grown_since(before, settle_s=0.3) == {"threads": 1}
        assert time.monotonic() - t0 >= 0.3  # it looked again until the deadline
    finally:
        done.set()
        running.join()
    assert resources.grown_since(before) == {}


def test_other_growth_is_reported_at_once(tmp_path):
    before = resources.snapshot()
    with open(tmp_path / "f", "wb"):
        t0 = time.monotonic()
        assert resources.grown_since(before, settle_s=5.0) == {"fds": 1}
        assert time.monotonic() - t0 < 2.0
