"""swapper: tensors in and out of NVMe through a pool of pinned buffers.

Layer contract (DESIGN.md): built on ``nvmeio.aio_handle`` only; knows nothing
of modules, process groups or ZeRO. A rank number and a job id arrive as plain
arguments and only name the swap directory ``<nvme_path>/<job_id>/rank<r>/``.
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
from .optimizer_swapper import (
    ADAM_STATES,
    PartitionedOptimizerSwapper,
    StepStats,
    SubGroupLayout,
    SubGroupState,
    SubGroupTensors,
)
from .param_swapper import PartitionState, PartitionedParamSwapper, swap_file_name
from .pipelined_optimizer_swapper import PipelinedOptimizerSwapper
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
