"""swapper: tensors in and out of NVMe through a pool of pinned buffers.

Layer contract (DESIGN.md): built on ``nvmeio.aio_handle`` only; knows nothing
of modules, process groups or ZeRO. A rank number and a job id arrive as plain
arguments and only name the swap directory ``<nvme_path>/<job_id>/rank<r>/``.

Parameters (``offload_param: nvme``)::

    params = PartitionedParamSwapper(nvme_path, aio, buffer_count=5, buffer_size=None,
                                     max_in_cpu=1e9, dtype=torch.bfloat16, job_id=run, rank=r)
    for name, numel in partitions:          # every partition first, with a stable id
        params.register(name, numel)
    params.swap_out_tensors(names, tensors) # initial data; tensors reusable at once
    (w,) = params.swap_in([name], async_op=True); params.synchronize()  # prefetch, then use w
    params.release([name])                  # unchanged: just drop the buffer
    params.swap_out([name])                 # changed in place: write it back

Optimizer state (``offload_optimizer: nvme``)::

    opt = PipelinedOptimizerSwapper(nvme_path, aio, pipeline_read=True, pipeline_write=True,
                                    swap_gradients=True, job_id=run, rank=r)
    for k, numel in enumerate(sub_group_sizes):
        opt.register_sub_group(k, numel)
    for k in ...: opt.initialize(k, fp32_master_k)
    opt.swap_out_gradients(k, grad_slice, offset)         # during backward
    opt.step(lambda k, t: fused_adamw(t.master, t.grad, t.exp_avg, t.exp_avg_sq))

``cleanup()`` (or ``with``) deletes the files; a clean interpreter exit does too.

The package exports the swappers, the buffer pool, the pool kinds and the errors; the rest
(states, layouts, checksums, the swap directory) is imported from its module.
"""
from .async_swapper import AsyncTensorSwapper
from .buffer_pool import PinnedBufferPool
from .errors import (
    BufferTooSmallError,
    InsufficientHostMemoryError,
    InsufficientSwapSpaceError,
    PoolExhaustedError,
    StaleSwapDirectoryError,
    SwapCorruptionError,
    SwapDirectoryInUseError,
    SwapError,
    SwapFileTruncatedError,
    SwapStateError,
)
from .optimizer_swapper import PartitionedOptimizerSwapper
from .param_swapper import PartitionedParamSwapper
from .pipelined_optimizer_swapper import PipelinedOptimizerSwapper
from .pool_kind import PackedSpans, WholeBuffers

__all__ = [
    "AsyncTensorSwapper",
    "PartitionedParamSwapper",
    "PartitionedOptimizerSwapper",
    "PipelinedOptimizerSwapper",
    "PinnedBufferPool",
    "PackedSpans",
    "WholeBuffers",
    "BufferTooSmallError",
    "InsufficientHostMemoryError",
    "InsufficientSwapSpaceError",
    "PoolExhaustedError",
    "StaleSwapDirectoryError",
    "SwapCorruptionError",
    "SwapDirectoryInUseError",
    "SwapError",
    "SwapFileTruncatedError",
    "SwapStateError",
]
