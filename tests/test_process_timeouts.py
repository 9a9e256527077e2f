"""A test whose processes hang fails within its timeout, showing what they printed and
where they were stuck, instead of hanging (see [Note: timeouts of multi-process tests]
in helpers.py)."""

import sys
import time

import pytest
import torch

from helpers import _STACK_DUMP_S, run_process, run_ranks

TIMEOUT = 10.0  # the ranks print at their start (forked here, no CUDA); only the barrier waits
SLACK = 30.0  # process start, fork, gloo set-up, the stack dumps


def scenario_rank1_hangs(rank, world_size, scratch):
    """Rank 1 never reaches the barrier rank 0 waits at."""
    print(f"rank {rank} started", flush=True)
    if rank == 1:
        time.sleep(3600)
    torch.distributed.barrier()
    return "passed the barrier"


def test_a_hung_rank_fails_within_the_timeout_with_the_ranks_output(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_ranks(2, [("hang", scenario_rank1_hangs, {})], tmp_path, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT + _STACK_DUMP_S + SLACK
    message = str(e.value)
    assert message.startswith(f"the 2 ranks did not finish within {TIMEOUT:g} s and were killed\n"
                              "--- rank 0 printed:\nrank 0 started\n")
    rank1 = message.split("--- rank 1 printed:\n")[1]
    assert rank1.startswith("rank 1 started\n")
    assert "in scenario_rank1_hangs" in rank1           # where it hung: its stack, by faulthandler


def test_a_hung_child_process_fails_within_the_timeout_with_its_output():
    code = "import time\nprint('child started', flush=True)\ntime.sleep(3600)\n"
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_process([sys.executable, "-c", code], timeout=5)
    assert time.monotonic() - start < 5 + _STACK_DUMP_S + SLACK
    message = str(e.value)
    assert message.startswith(f"{[sys.executable, '-c', code]!r} did not finish within 5 s and "
                              "was killed; it printed:\nchild started\n")
    assert 'File "<string>", line 3 in <module>' in message    # where it hung
