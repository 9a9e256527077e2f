"""Host-to-device copies of parameter shards on a stream of their own.

[Note: a unit's copy waits for nothing but itself]
A shard fetched from a swap pool must stay put until its bytes are on the device; only then may
the pool reuse the buffer. Waiting for that by synchronizing the compute stream also waits for
every kernel queued before the copy: once per unit, the CPU stops queueing work and the GPU
runs dry between units. Here the copy runs on a copy stream of the device; the compute stream
waits for the copy's event (on the device, not the CPU) before anything reads the result, the
result is marked as used by the compute stream for the caching allocator, and the caller waits
for that event alone before it hands the host buffer back. From memory registered with CUDA
(the swap pools are, swapper.StagingPool.register_with_cuda) the copy is a DMA of its own, so
it also overlaps kernels still running.

[Note: a copy stream per direction]
Copies to the host (gradients crossing, activations spilled) first make their stream wait for
the compute stream, up to the work that produced what they copy. On the stream of the reads
ahead onto the device, that wait would hold every read queued after it until the GPU reached
that point, and the two directions, which a GPU runs on copy engines of their own at once,
would take turns. So each direction has its stream; what one direction's copy needs of the
other's is ordered by events (activation_spill.py: a spilled tensor's copy back waits for the
event of its copy out).
"""
from __future__ import annotations

import threading
from typing import Dict, Tuple

import torch

_streams: Dict[Tuple[int, bool], "torch.cuda.Stream"] = {}
_lock = threading.Lock()


def copy_stream(device: torch.device, to_host: bool = False) -> "torch.cuda.Stream":
    """The device's copy stream for copies onto it, or with ``to_host`` for copies off it (one per
    device, direction and process: see [Note: a copy stream per direction])."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), to_host)
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=key[0])
        return stream


def start_copy(shard: torch.Tensor, device: torch.device, after=None) -> Tuple[torch.Tensor, "torch.cuda.Event"]:
    """``shard`` (host memory) copied to CUDA ``device`` on the copy stream, after the event
    ``after`` if one is given: the copy and the event that says when it is done. Nothing waits
    for it yet."""
    stream = copy_stream(device)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        out = torch.empty(shard.shape, dtype=shard.dtype, device=device)
        out.copy_(shard, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def ready_for_current_stream(out: torch.Tensor, done: "torch.cuda.Event") -> torch.Tensor:
    """``out`` (from :func:`start_copy`) for the current stream's work queued from now on."""
    current = torch.cuda.current_stream(out.device)
    current.wait_event(done)
    out.record_stream(current)  # its memory is not reused before the compute stream is done with it
    return out


def to_device(shard: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, "torch.cuda.Event"]:
    """``shard`` (host memory) copied to CUDA ``device``: the copy, ready for the current stream's
    work queued from now on, and the event that says when ``shard`` may be reused (see the [Note])."""
    out, done = start_copy(shard, device)
    return ready_for_current_stream(out, done), done


class AheadCopy:
    """A host-resident shard's copy to the device, started before its unit is gathered (a
    read-ahead: stores/param_store.py FlatParamStore): the compute stream waits for it only when
    :meth:`take` hands it over, not when it starts."""

    def __init__(self, shard: torch.Tensor, device: torch.device, after=None):
        self._out, self._done = start_copy(shard, device, after)

    def take(self) -> torch.Tensor:
        return ready_for_current_stream(self._out, self._done)


def copy_then_reuse(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """:func:`to_device`, returning once ``shard`` may be reused: the CPU waits for this copy alone
    (the compute stream's queued kernels go on running)."""
    out, done = to_device(shard, device)
    done.synchronize()
    return out
