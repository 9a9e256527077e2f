"""Not enough space under nvme_path fails before any byte is written, naming both numbers."""
import os

import pytest
import torch

from swapper import (
    AsyncTensorSwapper,
    InsufficientSwapSpaceError,
    PartitionedParamSwapper,
    PinnedBufferPool,
    PipelinedOptimizerSwapper,
)
from swapper import PartitionState
from swapper._swap_dir import SwapDirectory


def _files(root):
    return [os.path.join(r, f) for r, _, names in os.walk(root) for f in names]


def test_param_swapper_checks_all_registered_partitions_before_the_first_write(tmp_path):
    sizes = [100, 250, 4000]
    need = sum(sizes) * 2
    with PartitionedParamSwapper(
        tmp_path, None, buffer_size=None, max_in_cpu=0, dtype=torch.float16, free_space_fn=lambda p: need - 1
    ) as s:
        for i, n in enumerate(sizes):
            s.register(i, n)
        with pytest.raises(InsufficientSwapSpaceError) as info:
            s.swap_out_tensors([0], [torch.ones(100, dtype=torch.float16)])
        message = str(info.value)
        assert f"3 parameter partitions need {need} more bytes" in message
        assert f"only {need - 1} bytes" in message and str(tmp_path) in message
        assert _files(tmp_path) == []  # nothing written, not even an empty file


def test_param_swapper_rechecks_when_registrations_grow(tmp_path):
    free = {"bytes": 400}
    with PartitionedParamSwapper(
        tmp_path, None, buffer_size=1000, max_in_cpu=0, free_space_fn=lambda p: free["bytes"]
    ) as s:
        s.register(0, 100)
        s.swap_out_tensors([0], [torch.ones(100)])
        free["bytes"] = 0  # the disk filled up meanwhile; rewriting partition 0 needs nothing new
        s.swap_out_tensors([0], [torch.ones(100)])
        s.register(1, 100)
        with pytest.raises(InsufficientSwapSpaceError, match="need 400 more bytes"):
            s.swap_out_tensors([1], [torch.ones(100)])
        assert [os.path.basename(f) for f in _files(tmp_path)] == ["param_0.swp"]


def test_max_in_cpu_partitions_need_no_space(tmp_path):
    """With no free space at all, a partition kept in host memory swaps out and back (no error,
    no file, nothing counted on NVMe)."""
    with PartitionedParamSwapper(tmp_path, None, buffer_size=None, max_in_cpu=100, free_space_fn=lambda p: 0) as s:
        assert s.register(0, 100) is PartitionState.IN_CPU
        data = torch.arange(100, dtype=torch.float32)
        s.swap_out_tensors([0], [data])
        s.swap_out([0])
        assert s.nvme_bytes == 0 and s.cpu_numel == 100 and s.state(0) is PartitionState.IN_CPU
        assert torch.equal(s.swap_in([0])[0], data)
        assert _files(tmp_path) == []


def test_optimizer_swapper_checks_before_initializing(tmp_path):
    with PipelinedOptimizerSwapper(tmp_path, None, swap_gradients=True, free_space_fn=lambda p: 10 ** 4) as s:
        layouts = [s.register_sub_group(i, 1000) for i in range(3)]
        need = sum(l.file_bytes for l in layouts)
        assert need == 3 * (4096 + 3 * 4096 + 4000)  # a header page, 3 regions, the gradient
        with pytest.raises(InsufficientSwapSpaceError, match=f"3 optimizer sub-groups need {need} more bytes"):
            s.initialize(0, torch.zeros(1000))
        with pytest.raises(InsufficientSwapSpaceError):
            s.swap_out_gradients(0, torch.zeros(1000))
        assert _files(tmp_path) == []


def test_async_swapper_checks_each_batch(tmp_path):
    swap_dir = SwapDirectory(tmp_path, "job", 0, "tensors", free_space_fn=lambda p: 1000)
    with PinnedBufferPool(2, 4096, torch.uint8) as pool:
        swap = AsyncTensorSwapper(swap_dir, pool)
        with pytest.raises(InsufficientSwapSpaceError, match="2 tensors need 1200 more bytes"):
            swap.swap_out([torch.ones(100), torch.ones(200)], ["a", "b"])
        assert _files(tmp_path) == [] and pool.free_count == 2
        swap.swap_out([torch.ones(250)], ["a"])
        swap.synchronize()
    swap_dir.cleanup()
