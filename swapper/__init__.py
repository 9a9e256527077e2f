"""swapper: tensors in and out of NVMe through a pool of pinned buffers.

Layer contract (docs/architecture.md): built on ``nvmeio.aio_handle`` only; knows nothing
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

The public API is this package's ``__all__`` (the swappers, their pools and pool kinds, the
states and layouts they return, the swap directory, the errors) and two public modules with an
``__all__`` of their own: ``checksum`` (checksums of swapped bytes, also a checkpoint's) and
``host_memory`` (what host memory and the memlock limit can hold, page arithmetic). A module
whose name starts with an underscore is internal.
"""
from ._activation_swapper import ActivationSwapper
from ._async_swapper import AsyncTensorSwapper
from ._buffer_pool import PinnedBufferPool, PoolBuffer, StagingPool
from ._errors import (
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
from ._optimizer_swapper import PartitionedOptimizerSwapper, StepStats
from ._param_swapper import PartitionedParamSwapper
from ._partition import HOME_SLACK_BYTES, PartitionState
from ._pipelined_optimizer_swapper import PipelinedOptimizerSwapper
from ._pool_kind import PackedSpans, PoolKind, WholeBuffers
from ._span_pool import SpanPool
from ._staged_state import StagedState
from ._sub_group import SubGroupLayout, SubGroupState, SubGroupTensors
from ._swap_dir import SwapDirectory

__all__ = [
    "ActivationSwapper",
    "AsyncTensorSwapper",
    "PartitionedParamSwapper",
    "PartitionedOptimizerSwapper",
    "PipelinedOptimizerSwapper",
    "StepStats",
    "PartitionState",
    "HOME_SLACK_BYTES",
    "SubGroupState",
    "SubGroupLayout",
    "SubGroupTensors",
    "StagedState",
    "StagingPool",
    "PinnedBufferPool",
    "SpanPool",
    "PoolBuffer",
    "PoolKind",
    "PackedSpans",
    "WholeBuffers",
    "SwapDirectory",
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
