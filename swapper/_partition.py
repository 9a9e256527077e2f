"""A parameter partition: its id and swap file name, its states, where its bytes are.

The :class:`~swapper.PartitionedParamSwapper` keeps one :class:`Partition` per
registered id and is the only one to change it; a partition answers questions
about itself (its bytes, the view of its data in its buffer, what a swap-in of
it reads and from where).

[Note: a partition homed in another owner's file]
With fp32 training a unit's parameter shard is, byte for byte, a slice of the
optimizer's fp32 master, which the optimizer swapper writes anyway; a copy in
a parameter swap file of its own costs a write of every parameter per step,
and the buffers those writes hold. ``store_at`` makes a byte range of another
file the partition's :class:`Home`: nothing is written, the digest of the bytes
the owner is writing there is recorded, and swap-ins read from there. Direct
I/O needs the file offset and the memory address to agree within a page, so
the data sits in its buffer at the home's offset within a page (its ``skew``)
and the read covers whole pages (buffers need :data:`HOME_SLACK_BYTES` more);
the checksum covers the partition's bytes alone. The owner keeps the two
promises the swapper cannot check: the bytes are at the home before a swap-in
reads them (else it hands them over with ``fill``), and no read of a home is
in flight when the owner rewrites it (``settle``).
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union
from urllib.parse import quote

import torch

from nvmeio.striping import file_size

from ._buffer_pool import PoolBuffer
from ._errors import SwapFileTruncatedError
from ._io_queue import IoQueue
from .host_memory import PAGE_BYTES, align_up

ParamId = Union[int, str]
HOME_SLACK_BYTES = 2 * PAGE_BYTES  # a homed partition's buffer: its skew and its last page's rest


class Home(NamedTuple):
    """(path, byte offset) of a partition's bytes in another owner's file (see the note)."""

    path: str
    offset: int

    @property
    def skew(self) -> int:
        """The home's offset within a page: where the data starts in its buffer."""
        return self.offset % PAGE_BYTES


class PartitionState(enum.Enum):
    """Where a registered partition's data is, and what host memory it holds."""

    UNWRITTEN = "unwritten"
    """Registered, no data anywhere yet; holds nothing."""
    AVAILABLE = "available"
    """Data valid in its pool buffer; holds one pool buffer (``buffer_size`` elements)."""
    READING = "reading"
    """Read from NVMe in flight; holds one pool buffer, undefined until ``synchronize()``."""
    WRITING = "writing"
    """Write to NVMe in flight; holds one pool buffer, which must not change until ``synchronize()``."""
    ON_NVME = "on_nvme"
    """Data only in its swap file; holds no host memory."""
    IN_CPU = "in_cpu"
    """Kept in host memory within ``max_in_cpu``: ``numel × itemsize`` bytes of ordinary
    (pageable) memory for its whole life; never on NVMe."""


def swap_file_name(param_id: ParamId) -> str:
    """The file name of a partition: the id, percent-escaped; long ids end in a digest."""
    text = quote(str(param_id), safe="")
    if len(text) > 180:
        text = text[:160] + "-" + hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"param_{text}.swp"


@dataclass(eq=False)
class Partition:
    """The swapper's record of one registered partition."""

    param_id: ParamId
    numel: int
    dtype: torch.dtype
    file_name: str
    state: PartitionState
    buffer: Optional[PoolBuffer] = None
    cpu_tensor: Optional[torch.Tensor] = None
    has_data: bool = False  # for IN_CPU partitions: written at least once
    on_nvme: bool = False  # the swap file holds the current data
    keep_after_write: bool = False  # swap_in asked for it while its write was in flight
    queue: Optional[IoQueue] = None  # the read queue of its read in flight (READING)
    home: Optional[Home] = None  # stored in another owner's file (store_at), not in file_name

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def skew(self) -> int:
        """Where the data starts in its buffer: its home's offset within a page, else 0."""
        return 0 if self.home is None else self.home.skew

    def span_bytes(self, skew: Optional[int] = None) -> int:
        """The bytes a buffer of it needs: its data from ``skew`` (default: its own), in whole pages."""
        return align_up((self.skew if skew is None else skew) + self.nbytes)

    def tensor(self) -> torch.Tensor:
        if self.cpu_tensor is not None:
            return self.cpu_tensor
        assert self.buffer is not None
        return self.buffer.view(self.numel, self.dtype, self.skew)

    def read_span(self) -> Tuple[int, int]:
        """(file offset, bytes) of the whole pages a swap-in reads, from the buffer's start."""
        if self.home is None:
            return 0, self.nbytes
        return self.home.offset - self.skew, self.span_bytes()

    def check_home_size(self) -> None:
        """Refuse a swap-in from a home whose file no longer holds the pages it reads."""
        offset, nbytes = self.read_span()
        size = file_size(self.home.path)
        if size < offset + nbytes:
            raise SwapFileTruncatedError(
                f"file {self.home.path} holding partition {self.param_id!r} is {size} bytes, expected at least "
                f"{offset + nbytes}: it was truncated behind the swapper's back", self.home.path)
