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
"""
from .aio_config import AioConfig, make_handle
from .async_swapper import AsyncTensorSwapper, SwapOutTicket, WriteState
from .buffer_pool import PinnedBufferPool, PoolBuffer
from .checksum import ChecksumAlgorithm, ChecksumTable
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
from .host_memory import HostMemory
from .io_queue import IoKind, IoQueue
from .optimizer_swapper import PartitionedOptimizerSwapper, StepStats
from .param_swapper import PartitionState, PartitionedParamSwapper, swap_file_name
from .pipelined_optimizer_swapper import PipelinedOptimizerSwapper
from .sub_group import ADAM_STATES, SubGroupLayout, SubGroupState, SubGroupTensors
from .swap_dir import SwapDirectory, disk_free_bytes

__all__ = [
    "ADAM_STATES",
    "PartitionedOptimizerSwapper",
    "PipelinedOptimizerSwapper",
    "StepStats",
    "SubGroupLayout",
    "SubGroupState",
    "SubGroupTensors",
    "AioConfig",
    "AsyncTensorSwapper",
    "BufferTooSmallError",
    "ChecksumAlgorithm",
    "ChecksumTable",
    "HostMemory",
    "InsufficientHostMemoryError",
    "InsufficientSwapSpaceError",
    "IoKind",
    "IoQueue",
    "PartitionState",
    "PartitionedParamSwapper",
    "PinnedBufferPool",
    "PoolBuffer",
    "PoolExhaustedError",
    "StaleSwapDirectoryError",
    "SwapCorruptionError",
    "SwapDirectory",
    "SwapDirectoryInUseError",
    "SwapError",
    "SwapFileTruncatedError",
    "SwapOutTicket",
    "SwapStateError",
    "WriteState",
    "disk_free_bytes",
    "make_handle",
    "swap_file_name",
]
