"""Host memory of the stores that a GPU copies from: exactly its size, registered with CUDA.

[Note: not torch's pinned allocator]
``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
each request up to a power of two and keeps the block cached for reuse: the fp32 master, Adam
states and gradient partition of the host-offloaded optimizer could take up to twice the host
memory the memory check budgets (stores/rank_memory.py), and each allocation maps fresh pages
through the driver. Instead each tensor is its own bytes, page-aligned on transparent huge pages
and registered with CUDA once (nvmeio.RegisteredHost, which also keeps every registration from
outliving its memory); the store's ``close()`` unregisters them.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from nvmeio import RegisteredHost
from swapper.host_memory import align_up


def _warn(why: str) -> None:
    warnings.warn(f"nvmeio: host memory could not be registered with CUDA ({why}); training goes on: "
                  "the buffers that copies stage through come from torch's pinned allocator where it "
                  "allows, and the rest, pageable, has slower copies to and from the GPU", RuntimeWarning,
                  stacklevel=4)


def for_gpu_copies(pin_memory: bool, backend=None) -> Optional[RegisteredHost]:
    """The registered host memory of a store that ``pin_memory`` asks for, where a GPU is."""
    if not (pin_memory and torch.cuda.is_available()):
        return None
    return RegisteredHost(backend, on_refused=_warn)


# The host memory a GPU's copies stage through, bounded by design: the runtime's gradient crossing
# (runtime/device_to_host.py) and write-back ring (runtime/write_back.py) are made of these sizes,
# and rank_memory.py counts them.
SLAB_BYTES = 64 << 20  # the most one crossing copy stages
MAX_IN_FLIGHT = 2  # crossing copies in flight at once, and so the most slabs held
BATCH_BYTES = 4 << 20  # units under this cross together
# Most bytes an element's payloads take: two fp32 values (fold_on_device sends the gradients as they
# are only while they take no more than an fp32 sum and the host's partial sum would)
MAX_PAYLOAD_BYTES = 8
RING_BYTES = 64 << 20  # the write-back ring
HUGE_PAGE_BYTES = 2 << 20
PAYLOAD_ALIGNMENT_ROOM = 256 << 10  # 64 bytes for each of 4096 payloads


def slab_bytes(nbytes: int, most: int = SLAB_BYTES) -> int:
    """The host slab made for a crossing copy of ``nbytes``: whole huge pages (2 MiB, as
    nvmeio's huge_page_tensor maps it), at most ``most``."""
    return min(most, align_up(nbytes, HUGE_PAGE_BYTES))


def crossing_slab_bytes(largest_shard: int) -> int:
    """Each crossing slab, planned for a rank whose largest shard that receives gradients has
    ``largest_shard`` elements: its payloads, :data:`BATCH_BYTES` at least, and room for their
    alignment (a copy that needs more makes a larger slab, at most SLAB_BYTES)."""
    return slab_bytes(max(BATCH_BYTES, MAX_PAYLOAD_BYTES * largest_shard + PAYLOAD_ALIGNMENT_ROOM))


def makes_write_back_ring(offload_param, offload_optimizer, on_gpu: bool) -> bool:
    """Whether a step's values go from host memory into parameter shards on the GPU through the
    ring (runtime/write_back.py): parameters on the GPU, the optimizer in host memory or on NVMe,
    its ``pin_memory`` set (given an optimizer)."""
    return (on_gpu and offload_param.device == "none" and offload_optimizer.device != "none"
            and bool(offload_optimizer.pin_memory))
