"""Cleanup: every swapper leaves nothing behind, by cleanup() and at a clean exit."""
import os
import sys
import textwrap

import pytest
import torch

from helpers import run_process
from swapper import (
    PartitionedOptimizerSwapper,
    PartitionedParamSwapper,
    PipelinedOptimizerSwapper,
    SwapStateError,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _populated_swappers(root):
    params = PartitionedParamSwapper(root, None, buffer_size=None, max_in_cpu=100, job_id="run1", rank=2)
    for i in range(4):
        params.register(i, 100)
    params.swap_out_tensors(list(range(4)), [torch.ones(100)] * 4)
    params.swap_in([2, 3], async_op=True)  # still holding buffers, reads in flight
    optim = PipelinedOptimizerSwapper(root, None, job_id="run1", rank=2, swap_gradients=True)
    for i in range(2):
        optim.register_sub_group(i, 100)
    for i in range(2):
        optim.initialize(i, torch.zeros(100), async_op=True)
    return params, optim


def test_cleanup_leaves_nothing_behind(tmp_path):
    params, optim = _populated_swappers(tmp_path)
    assert sorted(os.listdir(tmp_path / "run1" / "rank2")) == sorted(
        [f".owner@{os.uname().nodename}@{os.getpid()}", "params", "optimizer"]
    )
    params.cleanup()
    assert os.listdir(tmp_path / "run1" / "rank2" / "optimizer")
    optim.cleanup()
    assert os.listdir(tmp_path) == []
    assert params.pool.closed and optim.pool.closed
    params.cleanup()  # idempotent
    with pytest.raises(SwapStateError, match="cleaned up"):
        params.swap_in([0])
    with pytest.raises(SwapStateError, match="cleaned up"):
        optim.swap_in(0)


def test_context_managers_clean_up(tmp_path):
    with PartitionedParamSwapper(tmp_path, None, buffer_size=None, max_in_cpu=0) as s:
        s.register(0, 10)
        s.swap_out_tensors([0], [torch.ones(10)])
    with PartitionedOptimizerSwapper(tmp_path, None) as o:
        o.register_sub_group(0, 10)
        o.initialize(0, torch.ones(10))
    assert os.listdir(tmp_path) == []


def test_a_clean_interpreter_exit_removes_the_swap_files(tmp_path):
    code = textwrap.dedent(f"""
        from test_swapper_cleanup import _populated_swappers  # tests/ is on the PYTHONPATH conftest sets
        params, optim = _populated_swappers({str(tmp_path)!r})
        print(len(__import__("os").listdir({str(tmp_path / "run1" / "rank2" / "params")!r})))
    """)  # exits without calling cleanup()
    out = run_process([sys.executable, "-c", code], cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"  # partitions 1..3 were on NVMe (0 was in CPU memory)
    assert os.listdir(tmp_path) == []


def test_a_failed_construction_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError):
        PartitionedParamSwapper(tmp_path, None, buffer_count=0)
    from swapper import InsufficientHostMemoryError

    with pytest.raises(InsufficientHostMemoryError):
        PartitionedParamSwapper(tmp_path, None, buffer_count=1, buffer_size=1 << 50, pin_memory=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fails", ["directory in use", "pool too large"])
def test_a_failed_construction_ends_the_handles_threads_at_once(tmp_path, fails):
    from nvmeio import resources
    from swapper import InsufficientHostMemoryError, SwapDirectoryInUseError

    first = PartitionedParamSwapper(tmp_path, None, buffer_size=None, job_id="job")
    before = resources.snapshot()
    if fails == "directory in use":  # two swappers of one rank under one name
        with pytest.raises(SwapDirectoryInUseError) as failed:
            PartitionedParamSwapper(tmp_path, None, buffer_size=None, job_id="job")
    else:
        with pytest.raises(InsufficientHostMemoryError) as failed:
            PartitionedParamSwapper(tmp_path, None, buffer_size=1 << 50, pin_memory=False, job_id="other")
    assert failed.value.__traceback__ is not None  # alive, with its frames: nothing was left to them
    assert resources.grown_since(before) == {}
    first.cleanup()
    assert os.listdir(tmp_path) == []
