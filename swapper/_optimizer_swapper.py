"""PartitionedOptimizerSwapper: optimizer state of each sub-group in, step, out.

[Note: one state file and one buffer per sub-group]
A sub-group's fp32 master partition and its optimizer states (``exp_avg``,
``exp_avg_sq`` for Adam) are laid out back to back in one swap file,
``subgroup<k>.swp``, each region starting on a 4096-byte boundary; the same
layout in one pool buffer means a swap-in is one read and a swap-out one write,
so the I/O engine gets the largest requests it can split over its threads, and
a sub-group needs exactly one buffer. The optional gradient (written during
backward, read with the state, never written back: the step consumes it) lives
in a file of its own, ``subgroup<k>.grad``, and after the states in the buffer:
the state file is then written only by swap-outs, as a whole, which is what
lets a checkpoint take it by a hard link (_sub_group.py [Note: the header page]; the file
operations of checkpoints are a collaborator's, _sub_group_files.py). ``buffer_count`` therefore
counts sub-groups in host memory at once, not tensors as in DeepSpeed: 1 for
this swapper, up to 3 for the pipelined one; ``None`` (the default) takes what
the schedule needs and a smaller number is refused when the swapper is made.
Buffers are sized from the registered sub-groups at first use; a larger
``buffer_count`` leaves room to read further ahead (:meth:`read_if_room`).

[Note: reads on queues of their own]
``aio_handle.wait()`` completes every op of its handle, so with one read
handle, waiting for sub-group i also waited for i+1 and i+2 read ahead of it.
Each read goes to a queue of a :class:`ReadRing` (one per buffer, so one read
each), and a swap-in waits for its own. 3.1B GPT of bench/scale.py stepping
sub-groups in backward: 49-52 s a step reading one sub-group ahead, 50-51 s
two, 45 s three, all on one handle; three on queues of their own: 41 s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from nvmeio import AioSettings
from nvmeio.striping import fspath

from ._async_swapper import AsyncTensorSwapper, SwapOutTicket
from ._buffer_pool import PoolBuffer, as_count
from .checksum import ChecksumAlgorithm, ChecksumTable
from ._errors import BufferTooSmallError, SwapStateError
from ._io_queue import IoKind
from ._sub_group import (
    ADAM_STATES,
    HEADER_BYTES,
    SubGroupEntry,
    SubGroupLayout,
    SubGroupState,
    SubGroupTensors,
)
from ._staged_state import StagedState
from ._sub_group_files import Carried, Sources, SubGroupFiles
from ._swap_dir import FreeSpaceFn
from ._swapper_base import SwapperBase

StepFn = Callable[[int, SubGroupTensors], None]


@dataclass
class StepStats:
    """Where the time of one :meth:`step` went (seconds)."""

    sub_groups: int = 0
    step_seconds: float = 0.0  # inside the caller's step function
    io_wait_seconds: float = 0.0  # blocked on reads and writes
    wall_seconds: float = 0.0


class PartitionedOptimizerSwapper(SwapperBase):
    """Per sub-group: master partition, optimizer states (and gradient) in, step, out.

    Files live in ``<nvme_path>/<job_id>/rank<rank>/<name>/``. ``state_names``
    defaults to Adam's; ``swap_gradients`` adds a gradient (its own file) written with
    :meth:`swap_out_gradients` (during backward) and read with the state.
    Not thread-safe: one thread drives a swapper.
    """

    pipeline_read = False
    pipeline_write = False
    # Called with a sub-group id before its state file is rewritten or replaced, so that another
    # reader of its bytes (parameter partitions homed in the master, _param_swapper.py) completes
    # its reads first.
    on_rewrite: Optional[Callable[[int], None]] = None
    _State = SubGroupState
    _entry_noun = "optimizer sub-groups"

    def __init__(
        self,
        nvme_path,
        aio_config: Union[AioSettings, dict, None] = None,
        buffer_count: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        *,
        state_names: Sequence[str] = ADAM_STATES,
        swap_gradients: bool = False,
        job_id: str = "default",
        rank: int = 0,
        name: str = "optimizer",
        checksum: Union[str, ChecksumAlgorithm, ChecksumTable, None] = None,
        pin_memory: bool = True,
        free_space_fn: Optional[FreeSpaceFn] = None,
        remove_stale: bool = False,
    ):
        config = AioSettings.coerce(aio_config)
        needed = self.buffers_needed()
        if buffer_count is None:
            buffer_count = needed
        buffer_count = as_count(buffer_count, "buffer_count")
        if buffer_count < needed:
            raise ValueError(
                f"{type(self).__name__} keeps {needed} sub-groups in host memory at once "
                f"(pipeline_read={self.pipeline_read}, pipeline_write={self.pipeline_write}) and needs "
                f"buffer_count >= {needed}, got {buffer_count}; pass buffer_count=None to size it automatically"
            )
        if len(set(state_names)) != len(state_names) or "master" in state_names or "grad" in state_names:
            raise ValueError(f"state_names must be distinct and not 'master' or 'grad', got {state_names!r}")
        self.buffer_count = buffer_count
        self.state_names = tuple(state_names)
        self.swap_gradients = swap_gradients
        self._groups: Dict[int, SubGroupEntry] = {}
        self._grad_swapper: Optional[AsyncTensorSwapper] = None
        super().__init__(
            nvme_path, config, dtype, job_id=job_id, rank=rank, name=name, checksum=checksum,
            pin_memory=pin_memory, free_space_fn=free_space_fn, remove_stale=remove_stale,
        )
        # One queue per buffer: waiting for one sub-group's read never waits for those read
        # ahead of it (see [Note: reads on queues of their own]).
        self._spread_reads(buffer_count)
        self._files = SubGroupFiles(
            self, self._checksums, (self._reads.handle, self._writes.handle),
            take_buffer=lambda nbytes, holder: self._take_buffers([nbytes], holder)[0],
            release_buffer=lambda buffer: self._pool.release([buffer]))

    def buffers_needed(self) -> int:
        """Sub-groups this schedule holds in host memory at once."""
        return 1 + int(self.pipeline_read) + int(self.pipeline_write)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.swap_dir.path!r}, sub_groups={len(self._groups)}, pool={self._pool!r})"

    # -- registration ------------------------------------------------------------------------
    def register_sub_group(self, sub_group_id: int, numel: int) -> SubGroupLayout:
        """Register sub-group ``sub_group_id`` of ``numel`` elements; returns its layout."""
        self._check_open()
        if isinstance(sub_group_id, bool) or not isinstance(sub_group_id, int) or sub_group_id < 0:
            raise ValueError(f"sub_group_id must be a non-negative int, got {sub_group_id!r}")
        if sub_group_id in self._groups:
            raise ValueError(f"sub-group {sub_group_id} is registered already")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be a positive int, got {numel!r}")
        layout = SubGroupLayout(numel, self.dtype, self.state_names, self.swap_gradients)
        if self._pool is not None and layout.file_bytes > self._pool.buffer_nbytes:
            raise BufferTooSmallError(
                f"sub-group {sub_group_id} needs {layout.file_bytes} bytes per buffer, but the pool was "
                f"sized at first use for {self._pool.buffer_nbytes}; register every sub-group first"
            )
        self._groups[sub_group_id] = SubGroupEntry(sub_group_id, layout, f"subgroup{sub_group_id}.swp",
                                                   f"subgroup{sub_group_id}.grad")
        return layout

    @property
    def sub_group_ids(self) -> List[int]:
        return list(self._groups)

    def state(self, sub_group_id: int) -> SubGroupState:
        return self._group(sub_group_id).state

    @property
    def nvme_bytes(self) -> int:
        """Bytes the registered sub-groups take on disk."""
        return sum(g.layout.file_bytes for g in self._groups.values())

    # -- data movement ------------------------------------------------------------------------
    def initialize(
        self,
        sub_group_id: int,
        master: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
        async_op: bool = False,
    ) -> None:
        """Write the first state of a sub-group: ``master`` and ``states`` (zeros if absent)."""
        g = self._group(sub_group_id)
        states = dict(states or {})
        unknown = set(states) - set(self.state_names)
        if unknown:
            raise ValueError(f"unknown optimizer states {sorted(unknown)}; this swapper has {self.state_names}")
        if master.numel() != g.layout.numel:
            raise ValueError(f"sub-group {sub_group_id} has {g.layout.numel} elements, master {master.numel()}")
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        if g.buffer is None:
            g.buffer = self._acquire(g)
        tensors = self._tensors(g, with_grad=False)
        tensors.master.copy_(master.reshape(-1))
        for key, t in tensors.states.items():
            if key in states:
                t.copy_(states[key].reshape(-1))
            else:
                t.zero_()
        g.state = SubGroupState.AVAILABLE
        self._begin_write(g)
        if not async_op:
            self._wait(self._writes, None)

    def swap_out_gradients(self, sub_group_id: int, grad: torch.Tensor, offset: int = 0) -> List[SwapOutTicket]:
        """Write ``grad`` as elements ``[offset, offset + grad.numel())`` of the sub-group's gradient.

        Asynchronous; ``grad`` may be reused at once. The next swap-in of the
        sub-group reads the gradient with its state (it must cover every element
        by then); the swap-out after the step marks it consumed.
        """
        if not self.swap_gradients:
            raise SwapStateError("this swapper was made with swap_gradients=False")
        g = self._group(sub_group_id)
        if offset < 0 or offset + grad.numel() > g.layout.numel:
            raise ValueError(
                f"gradient elements [{offset}, {offset + grad.numel()}) fall outside sub-group "
                f"{sub_group_id} of {g.layout.numel} elements"
            )
        self._check_space()
        self.swap_dir.create(g.grad_file_name)
        tickets = self._gradients().swap_out(
            [grad.to(self.dtype) if grad.dtype != self.dtype else grad],
            [g.grad_file_name],
            [offset * g.layout.itemsize],
        )
        g.grad.add(offset, offset + grad.numel(), tickets)
        return tickets

    def swap_in_gradients(self, sub_group_id: int, out: torch.Tensor) -> None:
        """Read back the whole gradient written with :meth:`swap_out_gradients` into ``out``
        (blocking; gradient accumulation adds the next micro-batch to it)."""
        g = self._group(sub_group_id)
        covered = g.grad.covered()
        if covered != g.layout.numel or out.numel() != g.layout.numel:
            raise SwapStateError(
                f"sub-group {sub_group_id}: {covered} of {g.layout.numel} gradient elements are on NVMe, "
                f"{out.numel()} asked for"
            )
        if g.grad.in_flight():
            self._writes.drain()
        g.grad.check_written(sub_group_id)
        self._gradients().swap_in([out.reshape(-1)], [g.grad_file_name], [0])

    def wait_gradients(self) -> None:
        """Wait for every gradient write in flight; raises when one failed (see below)."""
        if any(g.grad.in_flight() for g in self._groups.values()):
            self._writes.drain()
        for g in self._groups.values():
            g.grad.check_written(g.sub_group_id)

    def drop_gradients(self, sub_group_id: int) -> None:
        """Forget the gradient written since the last swap-out (a skipped step): the next
        swap-in reads master and states only."""
        g = self._group(sub_group_id)
        if g.grad.in_flight():
            self._writes.drain()
        self._await_read(g)
        if g.state is SubGroupState.AVAILABLE and g.read_grad:
            self._evict(g)  # the state is unchanged on NVMe; only the gradient is dropped
        g.grad.consume()

    def swap_in(self, sub_group_id: int, async_op: bool = False) -> SubGroupTensors:
        """Bring a sub-group into a pool buffer; the tensors are valid after :meth:`synchronize`
        when ``async_op``. Includes the gradient when one was written since the last swap-out."""
        g = self._group(sub_group_id)
        if g.state is SubGroupState.UNWRITTEN:
            raise SwapStateError(f"sub-group {sub_group_id} was never initialized")
        if g.state is SubGroupState.ON_NVME:
            self._begin_read(g)
        elif g.state is SubGroupState.WRITING:
            self._wait(self._writes, None)
            if g.state is SubGroupState.ON_NVME:
                self._begin_read(g)
        if not async_op:
            self._await_read(g)
        return self._tensors(g, with_grad=g.read_grad)

    def settle_landed_writes(self) -> None:
        """Complete the writes in flight if all have finished (never waits): their buffers
        come back for :meth:`read_if_room`; a failed one raises here, as at any wait."""
        if self._writes.landed():
            self._wait(self._writes, None)

    def read_if_room(self, sub_group_id: int) -> bool:
        """Start reading a sub-group on NVMe when a pool buffer is free now (never waits for
        one); True when its state is in host memory or on its way there."""
        g = self._group(sub_group_id)
        if g.state is SubGroupState.ON_NVME and self._ensure_pool().fits([g.layout.file_bytes]):
            self._begin_read(g)
        if g.state is SubGroupState.READING and g.read_queue.landed():
            self._await_read(g)  # done already: settle it (and verify) without blocking
        return g.state in (SubGroupState.READING, SubGroupState.AVAILABLE, SubGroupState.WRITING)

    def swap_out(self, sub_group_id: int, async_op: bool = False) -> None:
        """Write master and states back; the buffer returns to the pool when the write is done."""
        g = self._group(sub_group_id)
        self._await_read(g)
        if g.state is not SubGroupState.AVAILABLE:
            raise SwapStateError(f"sub-group {sub_group_id} is {g.state.value}, not in host memory")
        self._begin_write(g)
        if not async_op:
            self._wait(self._writes, None)

    def release(self, sub_group_id: int) -> None:
        """Give a swapped-in sub-group's buffer back without writing (changes are dropped)."""
        g = self._group(sub_group_id)
        self._await_read(g)
        if g.state is SubGroupState.AVAILABLE:
            self._evict(g)

    def master_location(self, sub_group_id: int) -> Tuple[str, int]:
        """(path, byte offset) of the sub-group's fp32 master in its swap file (current when
        the sub-group is on NVMe or being read; see :meth:`resident`)."""
        g = self._group(sub_group_id)
        return self.swap_dir.file(g.file_name), g.layout.offset(0)

    def resident(self, sub_group_id: int) -> Optional[SubGroupTensors]:
        """The sub-group's tensors while its buffer holds its current state (in host memory, or
        being written), else None (its file is current, or it was never written). Valid until
        the next call that moves data."""
        g = self._group(sub_group_id)
        if g.state in (SubGroupState.AVAILABLE, SubGroupState.WRITING):
            return self._tensors(g, with_grad=False)
        return None

    # -- checkpoint files: the states move here, the files in SubGroupFiles --------------------
    def stored_file(self, sub_group_id: int) -> Tuple[str, Dict[str, int]]:
        """The swap file holding a sub-group's state, and the byte offset of each of its
        tensors there (``"master"`` and the state names; ``numel * itemsize`` bytes each),
        so that a checkpoint can copy them file to file.

        The file is made current first: a read or write in flight completes, and a
        sub-group held in host memory is written out (its buffer returns to the pool).
        """
        g = self._group(sub_group_id)
        if g.state is SubGroupState.UNWRITTEN:
            raise SwapStateError(f"sub-group {sub_group_id} was never initialized")
        self._await_read(g)
        if g.state is SubGroupState.AVAILABLE:
            self._begin_write(g)
        if g.state is SubGroupState.WRITING:
            self._wait(self._writes, None)
        return self.swap_dir.file(g.file_name), g.layout.offsets()

    def layout(self, sub_group_id: int) -> SubGroupLayout:
        """The byte layout of a registered sub-group (as :meth:`register_sub_group` returned it)."""
        return self._group(sub_group_id).layout

    def share_file(self, sub_group_id: int, link: Callable[[str, bool], bool]) -> bool:
        """Makes the sub-group's swap file current (:meth:`stored_file`) and lets
        ``link(path, shared)`` give it another name (``shared``: it has one already). When that
        returns True the file is shared: the next swap-out writes a new file, so the other name
        keeps this state. Returns what ``link`` returned."""
        g = self._group(sub_group_id)
        path, _ = self.stored_file(sub_group_id)
        if not link(path, g.linked):
            return False
        g.linked = True
        return True

    def replace_file(self, sub_group_id: int, replace: Callable[[str], bool], shared: bool) -> bool:
        """Lets ``replace(path)`` put another file in place of the sub-group's swap file (True
        when it did): the sub-group's I/O in flight completes and :attr:`on_rewrite` is called
        first. After a replacement the new file is its state (``shared``: also another file's,
        see :meth:`share_file`); a state held in host memory and a gradient written since the
        last swap-out are dropped. Returns what ``replace`` returned."""
        g = self._group(sub_group_id)
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        if self.on_rewrite is not None:
            self.on_rewrite(sub_group_id)
        if not replace(self.swap_dir.file(g.file_name)):
            return False
        if g.state is SubGroupState.AVAILABLE:
            self._evict(g)
        g.state, g.linked = SubGroupState.ON_NVME, shared
        g.grad.consume()
        return True

    @property
    def can_import(self) -> bool:
        """Whether :meth:`import_state` may be used (always: the state is written through
        the pool like any swap-out, checksums included)."""
        return True

    def import_state(self, sub_group_id: int, sources: Sources, write: bool = True) -> SubGroupTensors:
        """Replaces a sub-group's state with bytes of other files (a checkpoint's tensor
        data), never through torch tensors: ``sources`` maps ``"master"`` and every state
        name to ``(path, byte offset)`` of its ``numel * itemsize`` bytes. They are read
        straight into the sub-group's pool buffer (O_DIRECT, one op each, in parallel)
        and written out as one swap-out; ``write=False`` leaves the sub-group in host
        memory instead (the returned tensors; :meth:`swap_out` it when done)."""
        g = self._group(sub_group_id)
        wanted = {"master", *self.state_names}
        if set(sources) != wanted:
            raise ValueError(f"import_state needs sources for exactly {sorted(wanted)}, got {sorted(sources)}")
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        if g.buffer is None:
            g.buffer = self._acquire(g)
        lay, offsets = g.layout, g.layout.offsets()
        g.state, g.read_grad, g.read_queue = SubGroupState.READING, False, self._reads
        for name, (src_path, src_offset) in sources.items():
            view = g.buffer.bytes()[offsets[name]:offsets[name] + lay.tensor_bytes]
            self._reads.submit(IoKind.READ, view, fspath(src_path), src_offset, lambda error: None)
        try:
            self._wait(self._reads, None)
        except BaseException:
            self._evict(g)  # the swap file still holds the previous state
            raise
        g.state = SubGroupState.AVAILABLE
        g.grad.consume()
        tensors = self._tensors(g, with_grad=False)
        if write:
            self._begin_write(g)
            self._wait(self._writes, None)
        return tensors

    # -- the file operations of checkpoints: SubGroupFiles', through the methods above ---------
    def stored_checksums(self, sub_group_id: int) -> Optional[Dict[str, int]]:
        """The digests recorded with the sub-group's state file (:meth:`SubGroupFiles.stored_checksums`)."""
        return self._files.stored_checksums(sub_group_id)

    def link_state(self, sub_group_id: int, dest, header: bytes,
                   copy: Optional[Callable[[str, str], None]] = None) -> bool:
        """The state file becomes also ``dest``, a hard link (:meth:`SubGroupFiles.link_state`)."""
        return self._files.link_state(sub_group_id, dest, header, copy)

    def adopt_file(self, sub_group_id: int, path: str, offsets: Mapping[str, int],
                   checksums: Optional[Carried] = None) -> bool:
        """A checkpoint's shard becomes the state file, a hard link (:meth:`SubGroupFiles.adopt_file`)."""
        return self._files.adopt_file(sub_group_id, path, offsets, checksums)

    def can_stage(self, sub_group_id: int, sources: Sources) -> bool:
        """Whether :meth:`stage_state` takes ``sources`` (:meth:`SubGroupFiles.can_stage`)."""
        return self._files.can_stage(sub_group_id, sources)

    def stage_state(self, sub_group_id: int, sources: Sources, algorithm: Optional[ChecksumAlgorithm],
                    link: bool) -> StagedState:
        """A shard read once, hashed, into a staging file (:meth:`SubGroupFiles.stage_state`)."""
        return self._files.stage_state(sub_group_id, sources, algorithm, link)

    def publish_staged(self, staged: StagedState, checksums: Optional[Carried] = None) -> Optional[torch.Tensor]:
        """The staging file becomes the state file (:meth:`SubGroupFiles.publish_staged`)."""
        return self._files.publish_staged(staged, checksums)

    def release_staged(self, staged: StagedState) -> None:
        """The staged state's buffer goes back to the pool (:meth:`SubGroupFiles.release_staged`)."""
        self._files.release_staged(staged)

    def discard_staged(self, staged: StagedState) -> None:
        """The staged state is forgotten (:meth:`SubGroupFiles.discard_staged`)."""
        self._files.discard_staged(staged)

    def step(self, step_fn: StepFn, sub_group_ids: Optional[Sequence[int]] = None) -> StepStats:
        """For each sub-group in order: swap in, ``step_fn(sub_group_id, tensors)``, swap out.

        ``step_fn`` updates the tensors in place. If the step function or a read
        raises, I/O in flight is completed and buffers are returned without
        writing: each sub-group's file then holds its state from before or from
        after this step, never a mix (a failed write, which raises an
        ``OSError`` naming its file, leaves that file undefined).
        """
        ids = self._step_ids(sub_group_ids)
        stats = StepStats(sub_groups=len(ids))
        start = time.perf_counter()
        try:
            self._schedule(step_fn, ids, stats)
        except BaseException:
            self._abort()
            raise
        stats.wall_seconds = time.perf_counter() - start
        return stats

    def _schedule(self, step_fn: StepFn, ids: List[int], stats: StepStats) -> None:
        """The I/O around each step: here read, step, write, one sub-group at a time."""
        for sg in ids:
            self._read_if_needed(sg)
            g = self._group(sg)
            self._await_read(g, stats)
            self._run_step(step_fn, g, stats)
            self._begin_write(g)
            self._wait(self._writes, stats)

    # -- internals shared with the pipelined swapper -----------------------------------------
    def _swapped_entries(self) -> List[SubGroupEntry]:
        return list(self._groups.values())

    def _forget_entries(self) -> None:
        self._groups.clear()

    def _group(self, sub_group_id: int) -> SubGroupEntry:
        self._check_open()
        try:
            return self._groups[sub_group_id]
        except KeyError:
            raise KeyError(f"sub-group {sub_group_id!r} is not registered") from None

    def _step_ids(self, sub_group_ids: Optional[Sequence[int]]) -> List[int]:
        ids = list(self._groups) if sub_group_ids is None else list(sub_group_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"sub-group ids repeat in {ids}")
        for sg in ids:
            g = self._group(sg)
            if g.state is SubGroupState.UNWRITTEN:
                raise SwapStateError(f"sub-group {sg} was never initialized")
            if g.state in (SubGroupState.READING, SubGroupState.WRITING):
                self.synchronize()
        return ids

    def _gradients(self) -> AsyncTensorSwapper:
        if self._grad_swapper is None:
            self._grad_swapper = AsyncTensorSwapper(
                self.swap_dir,
                self._ensure_pool(),
                checksum=self._checksums,
                writes=self._writes,
                reads=self._reads,
                holder="gradients",
            )
        return self._grad_swapper

    def _acquire(self, g: SubGroupEntry) -> PoolBuffer:
        return self._take_buffers([g.layout.file_bytes], f"sub-group {g.sub_group_id}")[0]

    def _drop_buffer(self, g: SubGroupEntry) -> None:
        super()._drop_buffer(g)
        g.read_grad = False  # only ever True while g holds a buffer

    def _read_if_needed(self, sub_group_id: int) -> None:
        g = self._group(sub_group_id)
        if g.state is SubGroupState.ON_NVME:
            self._begin_read(g)

    def _tensors(self, g: SubGroupEntry, with_grad: bool) -> SubGroupTensors:
        lay, buf = g.layout, g.buffer
        if buf is None:
            raise SwapStateError(f"sub-group {g.sub_group_id} is {g.state.value}, not in host memory")
        states = {n: buf.view(lay.numel, lay.dtype, lay.offset(1 + i)) for i, n in enumerate(lay.state_names)}
        grad = buf.view(lay.numel, lay.dtype, lay.grad_offset) if with_grad else None
        return SubGroupTensors(g.sub_group_id, buf.view(lay.numel, lay.dtype, lay.offset(0)), states, grad)

    def _begin_read(self, g: SubGroupEntry) -> None:
        """Take a buffer for ``g`` and submit its read (state, and gradient if one was written)."""
        lay = g.layout
        with_grad = bool(g.grad)
        if with_grad:
            covered = g.grad.covered()
            if covered != lay.numel:
                raise SwapStateError(
                    f"the gradient of sub-group {g.sub_group_id} covers {covered} of {lay.numel} elements"
                )
            if g.grad.in_flight():
                self._writes.drain()
            g.grad.check_written(g.sub_group_id)
        holder = f"sub-group {g.sub_group_id}"
        self._check_file_size(g.file_name, holder, lay.written_bytes, at_least=True)
        if with_grad:
            self._check_file_size(g.grad_file_name, f"the gradient of {holder}", lay.tensor_bytes, at_least=True)
        path, grad_path = self.swap_dir.file(g.file_name), self.swap_dir.file(g.grad_file_name)
        g.buffer = self._acquire(g)
        queue = g.read_queue = self._read_ring.next_queue()
        g.state, g.read_grad = SubGroupState.READING, with_grad
        view = g.buffer.bytes()[HEADER_BYTES:lay.written_bytes]  # the header page is not swap data
        grad_view = g.buffer.bytes()[lay.grad_offset:lay.grad_offset + lay.tensor_bytes]

        def on_done(error: Optional[BaseException]) -> None:
            # Both reads of a sub-group complete in one batch (io_queue [Note]): settled together.
            if not self._settle_read(g, error, path, view, holder, HEADER_BYTES):
                return
            if with_grad and not self._settle_read(g, error, grad_path, grad_view, holder, 0):
                return
            g.state = SubGroupState.AVAILABLE

        if not with_grad:
            queue.submit(IoKind.READ, view, path, HEADER_BYTES, on_done)
            return
        queue.submit(IoKind.READ, view, path, HEADER_BYTES, lambda error: None)
        try:
            queue.submit(IoKind.READ, grad_view, grad_path, 0, on_done)
        except BaseException:
            try:  # the state read must land before its buffer (released by on_done) is reused
                queue.drain()
            except BaseException:  # noqa: BLE001 - the submit's error is the one to raise
                pass
            raise

    def _begin_write(self, g: SubGroupEntry) -> None:
        """Submit the write of master and states; the buffer is released when it completes."""
        if self.on_rewrite is not None:
            self.on_rewrite(g.sub_group_id)
        if g.linked:  # the file is a checkpoint's too: leave it to it, write a new one
            self.swap_dir.remove(g.file_name)
            g.linked = False
        self._check_space()
        path = self.swap_dir.create(g.file_name)
        lay = g.layout
        raw = g.buffer.bytes()
        for i in range(1 + len(lay.state_names)):  # filler after each region: zeros, not a stale buffer's bytes
            raw[lay.offset(i) + lay.tensor_bytes:lay.offset(i + 1)].zero_()
        digests = None  # computed while the write is in flight (checksum.py [Note: digests off ...])
        if self._checksums is not None:
            tensors = self._tensors(g, with_grad=False)
            digests = self._checksums.record_later(path, [(lay.offset(0), tensors.master)] + [
                (lay.offset(1 + i), t) for i, t in enumerate(tensors.states.values())])
        g.state = SubGroupState.WRITING
        # A step read the gradient with the state: this write consumes exactly the gradient
        # pieces written before it. A gradient written while this write is in flight (the next
        # backward) belongs to the next step and is kept.
        consumed = g.grad.mark() if g.read_grad else None

        def on_done(error: Optional[BaseException]) -> None:
            if digests is not None:
                digests.wait()  # before the buffer can change
            if error is not None:  # the state is still in the buffer: keep it for a retry
                g.state = SubGroupState.AVAILABLE
                return
            self._drop_buffer(g)
            g.state = SubGroupState.ON_NVME
            g.grad.consume(consumed)

        self._writes.submit(IoKind.WRITE, g.buffer.bytes()[HEADER_BYTES:lay.written_bytes], path, HEADER_BYTES,
                            on_done)

    def _run_step(self, step_fn: StepFn, g: SubGroupEntry, stats: StepStats) -> None:
        t0 = time.perf_counter()
        step_fn(g.sub_group_id, self._tensors(g, with_grad=g.read_grad))
        stats.step_seconds += time.perf_counter() - t0

    def _await_read(self, g: SubGroupEntry, stats: Optional[StepStats] = None) -> None:
        """Complete ``g``'s read if it is in flight (its queue's other reads, if any, too)."""
        if g.state is SubGroupState.READING:
            self._wait(g.read_queue, stats)

    @staticmethod
    def _wait(queue, stats: Optional[StepStats]) -> None:
        t0 = time.perf_counter()
        queue.drain()
        if stats is not None:
            stats.io_wait_seconds += time.perf_counter() - t0

    def _abort(self) -> None:
        """After a failure inside a step: finish I/O, return buffers without writing."""
        for queue in (self._read_ring, self._writes):
            try:
                queue.drain()
            except BaseException:  # noqa: BLE001 - the original error is the one to raise
                pass
        for g in self._groups.values():
            if g.state in (SubGroupState.AVAILABLE, SubGroupState.READING):
                self._evict(g)
