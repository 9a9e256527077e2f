"""Where a rank's fp32 master weights, optimizer states and gradient partition live.

``offload_optimizer.device`` picks the store: ``none`` keeps everything on the
compute device, ``cpu`` in host memory, ``nvme`` keeps master weights and
states in one swap file per sub-group through
:class:`swapper.PipelinedOptimizerSwapper` (which reads sub-group i+1 and
writes i-1 while i is stepped when ``pipeline_read``/``pipeline_write`` are
on). The fp32 gradient partition stays in memory for ``none`` (on the device)
and ``cpu`` (host memory); for ``nvme`` each sub-group's gradient goes to the
sub-group's gradient swap file during backward (runtime/grad_stash.py) and is read
with the state at the step, so the partition is never whole in memory.

Every store runs the step the same way: :meth:`OptimizerStore.step` calls
``fn(sub_group, master, states, grad)`` once per sub-group, in order, with
views the function updates in place.
"""
from __future__ import annotations

import abc
import contextlib
import logging

import time
from typing import AbstractSet, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from nvmeio import RegisteredHost

from .layouts import RankLayout, SubGroup
from .pinned_host import for_gpu_copies

StepFn = Callable[[SubGroup, torch.Tensor, Dict[str, torch.Tensor], torch.Tensor], None]


BACKWARD_READ_AHEAD = 3
"""Sub-groups read ahead in a backward that steps them (see [Note: backward reads a sub-group once])."""


def nvme_read_ahead(offload, steps_in_backward: bool) -> int:
    """Sub-groups the NVMe store reads ahead: none, one (``pipeline_read``), or
    :data:`BACKWARD_READ_AHEAD` when the engine steps sub-groups during backward."""
    return (BACKWARD_READ_AHEAD if steps_in_backward else 1) if offload.pipeline_read else 0


def nvme_buffer_count(offload, steps_in_backward: bool) -> int:
    """Sub-groups the NVMe store holds in host memory at once: the one stepped, the one being
    written (``pipeline_write``) and those read ahead."""
    return 1 + nvme_read_ahead(offload, steps_in_backward) + int(offload.pipeline_write)


def _host_or_device(numel: int, device: torch.device, pinned: Optional[RegisteredHost],
                    zero: bool = False) -> torch.Tensor:
    """fp32 on ``device``; on the host registered with CUDA through ``pinned`` when given."""
    if pinned is not None and device.type == "cpu":
        t = pinned.empty(numel, torch.float32)
    else:
        t = torch.empty(numel, dtype=torch.float32, device=device)
    return t.zero_() if zero else t


# [Note: each store saves and loads its own state]
# A checkpoint asks the engine's checkpointed state two things per sub-group, and nothing
# else: save_shard (write master and states as one shard) and load_shard / load (take them
# back from the sub-group's own shard, or from values gathered across a resharded
# checkpoint). Each store answers the way its bytes live: flat in memory the tensors are
# written; on NVMe the swap file is linked or copied file to file and a shard is adopted
# as the swap file or read straight into the pool; without an optimizer the parameters are
# the master (param_store.MasterFromParameters). checkpoint/ never reaches into a store.


class OptimizerStore(abc.ABC):
    """Interface; ``grads`` is the flat fp32 gradient partition of the rank."""

    grads: Optional[torch.Tensor]  # None when gradients go to NVMe (stash_gradients)
    stash_gradients = False
    read_wait_seconds = 0.0  # blocked on NVMe reads (wall_clock_breakdown)
    write_wait_seconds = 0.0  # blocked on NVMe writes

    def __init__(self, rank_layout: RankLayout, state_names: Sequence[str]):
        self.rank_layout = rank_layout
        self.state_names = tuple(state_names)

    @abc.abstractmethod
    def init_master(self, unit_index: int, values: torch.Tensor) -> None:
        """Set the fp32 master of one unit's shard (units arrive in index order)."""
        ...

    @abc.abstractmethod
    def step(self, fn: StepFn, skip: Set[int] = frozenset()) -> None:
        """``fn`` once per sub-group not in ``skip`` (stepped during backward already)."""
        ...

    steps_in_backward = False  # offers begin_backward_step / step_in_backward

    @property
    def io_seconds(self) -> float:
        return self.read_wait_seconds + self.write_wait_seconds

    def prefetch(self) -> None:
        """A step is coming: start reading (when the backward of the last micro-batch starts,
        or, with ``stash_gradients``, when it ended and the gradients are on NVMe)."""

    @abc.abstractmethod
    def write_master(self, unit_index: int, values: torch.Tensor) -> None:
        """Replace one unit's master shard after training started (GatheredParameters)."""
        ...

    @abc.abstractmethod
    def read(self, sub_group: SubGroup) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Copies of one sub-group's master and states (for checkpoints)."""
        ...

    @abc.abstractmethod
    def load(self, sub_group: SubGroup, master: torch.Tensor, states: Optional[Dict[str, torch.Tensor]]) -> None:
        """Replace one sub-group's master and, unless ``states`` is None, its states."""
        ...

    @contextlib.contextmanager
    def viewed(self, sub_group: SubGroup) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """(master, states) of one sub-group to read while the block runs (for a checkpoint):
        views where the store can give them, else copies. Nothing may change them meanwhile."""
        yield self.read(sub_group)

    # -- the checkpoint protocol (see [Note: each store saves and loads its own state]) ------------
    def save_shard(self, sub_group: SubGroup, shards, path: str) -> None:
        """Write the sub-group's master and states as the checkpoint shard ``path`` through
        ``shards`` (checkpoint/shard_io.py's CheckpointIO)."""
        with self.viewed(sub_group) as (master, states):
            shards.save_shard(path, sub_group.numel, ["master", *states], tensors={"master": master, **states})

    def load_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                   carried: Optional[Tuple[str, Dict[str, int]]] = None) -> torch.Tensor:
        """Take the sub-group's state from its own checkpoint shard (``shard``, an open reader of
        ``path``; ``keys``: "master" and the states to load; ``carried``: the checksums the shard
        carries, verified already); returns the master."""
        master = shard.get_tensor("master")
        self.load(sub_group, master, {k: shard.get_tensor(k) for k in keys[1:]} if load_states else None)
        return master

    def stage_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                    algorithm) -> Optional[object]:
        """Read the sub-group's own shard once into a staging place, hashing each of ``keys``
        with ``algorithm`` on the way, without changing the sub-group (see
        swapper/_staged_state.py [Note: a staged load reads each byte once]); returns the
        staged state (its ``digests`` for the caller to check), or None where this store
        cannot stage (the caller verifies and loads the shard as two reads)."""
        return None

    def publish_shard(self, sub_group: SubGroup, staged,
                      carried: Tuple[str, Dict[str, int]]) -> Optional[torch.Tensor]:
        """Make a staged shard (verified: its digests equal ``carried``) the sub-group's state;
        returns the master from memory (valid until :meth:`discard_staged`), or None where
        the staging buffer is gone (the caller reads the master from the shard). Only called
        with what :meth:`stage_shard` returned, which is never anything here."""
        raise TypeError(f"{type(self).__name__} stages no shard (its stage_shard returns None), so there is "
                        f"nothing to publish for sub-group {sub_group.index}")

    def discard_staged(self, staged) -> None:
        """Free what a staged shard holds: all of it where it was not published (the load
        failed), the staging buffer where it was."""

    def check_free_space(self) -> None:
        """Refuse now if the swap files will not fit (before the model is handed over)."""

    def close(self) -> None:
        pass


class FlatOptimizerStore(OptimizerStore):
    """Master, states and gradients as flat fp32 tensors on ``device`` (``none``) or the host
    (``cpu``), over the trainable prefix of the rank space; with ``holds_params`` the master
    spans every unit, the fp32 parameter shards' home (param_store.py ``FlatParamStore(flat=)``),
    but the prefix alone where the frozen units are all ``packed`` (stored int8 outside it)."""

    def __init__(self, rank_layout: RankLayout, state_names: Sequence[str], device: torch.device,
                 pin_memory: bool = False, holds_params: bool = False, packed: AbstractSet[int] = frozenset()):
        super().__init__(rank_layout, state_names)
        n = rank_layout.trainable_numel
        self.holds_params = holds_params
        self._pinned = for_gpu_copies(pin_memory)
        spans_all = holds_params and not rank_layout.frozen <= packed
        self.master = _host_or_device(rank_layout.numel if spans_all else n, device, self._pinned)
        self.states = {name: _host_or_device(n, device, self._pinned, zero=True) for name in self.state_names}
        self.grads = _host_or_device(n, device, self._pinned)

    @property
    def pinned(self) -> bool:
        """Whether the tensors are host memory registered with CUDA (pinned_host.py)."""
        return self._pinned is not None and self.master.device.type == "cpu"

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.close()

    def init_master(self, unit_index: int, values: torch.Tensor) -> None:
        start, stop = self.rank_layout.unit_range(unit_index)
        self.master[start:stop].copy_(values)

    def write_master(self, unit_index: int, values: torch.Tensor) -> None:
        self.init_master(unit_index, values)

    def _views(self, sg: SubGroup):
        s = slice(sg.start, sg.stop)
        return self.master[s], {k: v[s] for k, v in self.states.items()}, self.grads[s]

    def step(self, fn: StepFn, skip: Set[int] = frozenset()) -> None:
        for sg in self.rank_layout.trainable_sub_groups:
            if sg.index not in skip:
                fn(sg, *self._views(sg))

    def read(self, sub_group: SubGroup):
        master, states, _ = self._views(sub_group)
        return master.detach().cpu().clone(), {k: v.detach().cpu().clone() for k, v in states.items()}

    @contextlib.contextmanager
    def viewed(self, sub_group: SubGroup) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        master, states, _ = self._views(sub_group)
        yield master.detach(), {k: v.detach() for k, v in states.items()}

    def load(self, sub_group: SubGroup, master: torch.Tensor, states: Optional[Dict[str, torch.Tensor]]) -> None:
        m, s, _ = self._views(sub_group)
        m.copy_(master)
        for k, v in s.items():
            if states is not None:
                v.copy_(states[k])


class NvmeOptimizerStore(OptimizerStore):
    """Master and states of each sub-group in its swap file under ``offload_optimizer.nvme_path``.

    The swapper's pool holds :func:`nvme_buffer_count` sub-groups (its own
    count; ``offload_optimizer.buffer_count``, which DeepSpeed counts in
    tensors, is checked by the config and otherwise not needed).

    [Note: the disk works while the model computes]
    The step drives the swapper's primitives itself rather than
    ``swapper.step()``, to hide I/O behind compute: :meth:`prefetch`, called
    when the backward of the last micro-batch starts, reads the first sub-group
    while backward runs; during the step, with ``pipeline_read`` the next
    sub-group is read while one is stepped; every sub-group's write is
    submitted without waiting, and the last one completes during the next
    forward (a later swap-in of that sub-group, or a buffer it needs, waits for
    it). With one sub-group, the default ``sub_group_size``, a step then costs
    the Adam update alone when forward and backward are longer than the I/O.

    [Note: backward reads a sub-group once]
    With fp32 parameters homed in the master (param_store.py), a backward that
    steps sub-groups would read each master twice: a unit's shard for its
    backward, then the whole master with the states for the step, moments
    later. Instead a shard fetched or read ahead in such a backward, whose
    sub-group is one of the next ones to step, starts that sub-group's read
    (when the swapper has a buffer free; it never waits for one) and is copied
    from it once it lands: 12 bytes a parameter read in backward, not 16. It
    needs ``pipeline_read`` and ``pipeline_write``. Such a backward reads
    :data:`BACKWARD_READ_AHEAD` sub-groups ahead (five buffers: those, the one
    stepped, the one written), each on a read queue of its own so that a step
    waits for its own read only (swapper/_optimizer_swapper.py [Note: reads on
    queues of their own]): a sub-group's state is most of the backward's I/O,
    and with one read ahead the disk idled between a read landing and the next
    step submitting one (3.1B GPT of bench/scale.py: the disk idle 8 s of a
    30 s backward, where it was 16 of 38; the step 51 -> 41 s, backward reading each
    sub-group once where it read 4 GB more). A shard whose sub-group is further
    off, or finds no buffer, is read alone, as before (1.63B GPT: 27 s a step
    with two reads, 23 s with the read-once path, 27 s when read-ahead waits
    for every sub-group's read).
    """

    stash_gradients = True
    steps_in_backward = True

    def __init__(self, rank_layout: RankLayout, state_names: Sequence[str], offload, aio, job_id: str,
                 rank: int, steps_in_backward: bool = False):
        from swapper import PipelinedOptimizerSwapper

        from .param_store import swap_checksum

        super().__init__(rank_layout, state_names)
        self.swapper = PipelinedOptimizerSwapper(
            offload.nvme_path, aio, nvme_buffer_count(offload, steps_in_backward), torch.float32,
            state_names=self.state_names, job_id=job_id, rank=rank, name="optimizer",
            pin_memory=offload.pin_memory, remove_stale=True, swap_gradients=True,
            checksum=swap_checksum(offload.checksum), pipeline_read=offload.pipeline_read,
            pipeline_write=offload.pipeline_write)
        self._read_ahead = nvme_read_ahead(offload, steps_in_backward)
        self._groups = [sg for sg in rank_layout.trainable_sub_groups if sg.numel > 0]
        try:
            for sg in self._groups:
                self.swapper.register_sub_group(sg.index, sg.numel)
        except BaseException:
            self.swapper.cleanup()  # never returned, so never closed by the caller
            raise
        self.grads = None  # each sub-group's gradient goes to its swap file (runtime/grad_stash.py)
        self._staging = None
        self._staged_sg = None
        self._prefetched = False
        self._order: list = []  # the order the last backward completed sub-groups in
        self._order_seen: list = []
        self._expected: list = []
        self._stepping = False  # in a backward that steps sub-groups, until all have stepped

    def init_master(self, unit_index: int, values: torch.Tensor) -> None:
        sg = self.rank_layout.sub_group_of(unit_index)
        if sg.numel == 0:
            return
        if self._staged_sg is not sg:
            self._staging = torch.empty(sg.numel, dtype=torch.float32)
            self._staged_sg = sg
        start, stop = self.rank_layout.unit_range(unit_index)
        self._staging[start - sg.start:stop - sg.start].copy_(values)
        if unit_index == sg.units[-1]:
            self.swapper.initialize(sg.index, self._staging)
            self._staging = self._staged_sg = None

    def master_home(self, unit_index: int) -> Tuple[str, int]:
        """(path, byte offset) of one unit's fp32 master shard on NVMe (param_store.py [Note])."""
        sg = self.rank_layout.sub_group_of(unit_index)
        path, offset = self.swapper.master_location(sg.index)
        return path, offset + (self.rank_layout.unit_range(unit_index)[0] - sg.start) * 4

    def resident_master(self, unit_index: int) -> Optional[torch.Tensor]:
        """One unit's fp32 master shard while its sub-group is in host memory (being built,
        stepped or written), else None: its file is current."""
        sg = self.rank_layout.sub_group_of(unit_index)
        start, stop = self.rank_layout.unit_range(unit_index)
        if self._staged_sg is sg:
            return self._staging[start - sg.start:stop - sg.start]
        tensors = self.swapper.resident(sg.index)
        return None if tensors is None else tensors.master[start - sg.start:stop - sg.start]

    def reading_master(self, unit_index: int) -> bool:
        """During a backward that steps sub-groups: whether the unit's sub-group, one of the
        next two to step, is being read for its step (the read starts here when the swapper
        has a free buffer), so that its parameter shard comes from that read (see [Note:
        backward reads a sub-group once])."""
        if not self._stepping or self.swapper.buffer_count < 3:
            return False  # with fewer, a sub-group completing out of the expected order would find none
        sg = self.rank_layout.sub_group_of(unit_index)
        if sg.index not in [g.index for g in self._upcoming()]:
            return False
        return self.swapper.read_if_room(sg.index)

    def await_master(self, unit_index: int) -> torch.Tensor:
        """One unit's fp32 master shard, once the read :meth:`reading_master` saw lands."""
        sg = self.rank_layout.sub_group_of(unit_index)
        start, stop = self.rank_layout.unit_range(unit_index)
        t0 = time.perf_counter()
        tensors = self.swapper.swap_in(sg.index)
        self.read_wait_seconds += time.perf_counter() - t0
        return tensors.master[start - sg.start:stop - sg.start]

    def _upcoming(self) -> List[SubGroup]:
        """The next sub-groups expected to step in this backward: as many as are read ahead,
        and at least two (the read-once path's reach)."""
        seen = {g.index for g in self._order_seen}
        ahead = (g for g in self._expected if g.index not in seen)
        return [g for g, _ in zip(ahead, range(max(2, self._read_ahead)))]

    def prefetch(self) -> None:
        if self._groups:
            self._prefetch(self._groups[0])

    def wait_gradients(self) -> None:
        """The gradients backward wrote are on NVMe (raises when a write failed)."""
        self.swapper.wait_gradients()

    def step(self, fn: StepFn, skip: Set[int] = frozenset()) -> None:
        groups = [sg for sg in self._groups if sg.index not in skip]
        self._prefetched = False  # consumed below, or lost with an error
        self._stepping = False
        self._write_held(groups[1:])
        for k, sg in enumerate(groups):
            self._step_one(sg, fn, groups[k + 1] if k + 1 < len(groups) else None, grad=None)

    def _step_one(self, sg: SubGroup, fn: StepFn, following: Optional[SubGroup],
                  grad: Optional[torch.Tensor]) -> None:
        """Read ``sg`` (waiting only for what is not read yet), start reading ``following``,
        step, and submit the write without waiting."""
        t0 = time.perf_counter()
        self.swapper.settle_landed_writes()  # buffers of finished writes back, for reads ahead
        tensors = self.swapper.swap_in(sg.index)
        if following is not None and self.swapper.pipeline_read:
            self.swapper.swap_in(following.index, async_op=True)
        self.read_wait_seconds += time.perf_counter() - t0
        fn(sg, tensors.master, tensors.states, tensors.grad if grad is None else grad)
        t0 = time.perf_counter()
        self.swapper.swap_out(sg.index, async_op=True)
        self.write_wait_seconds += time.perf_counter() - t0

    # -- the step during backward (see [Note: sub-groups stepped during backward] in engine/optimizer.py)
    def begin_backward_step(self) -> None:
        """Backward is starting and will step each sub-group as its gradient completes: read
        the one expected first."""
        self._order_seen = []
        self._stepping = True
        self._expected = [sg for sg in self._order if sg.numel] or list(reversed(self._groups))
        # With one pool buffer, reading ahead would hold the buffer that reading back an
        # accumulated gradient sum needs while the sub-group fills.
        if self._expected and self.swapper.buffer_count > 1:
            self._prefetch(self._expected[0])

    def step_in_backward(self, sg: SubGroup, fn: StepFn, grad: torch.Tensor) -> None:
        """Step ``sg`` now with its completed gradient ``grad`` (never written to NVMe), after
        starting the read of the sub-group expected to complete next."""
        self._order_seen.append(sg)
        upcoming = self._upcoming()
        self._step_one(sg, fn, next(iter(upcoming), None), grad)
        if self._read_ahead > 1:  # and those after it, where buffers are free (never waiting)
            self.swapper.settle_landed_writes()
            for g in upcoming[1:self._read_ahead]:
                self.swapper.read_if_room(g.index)
        if len(self._order_seen) == len(self._groups):
            self._order = self._order_seen  # the next backward completes them in this order
            self._stepping = False

    def abandon_backward_step(self) -> None:
        """A backward that stepped sub-groups failed: give back every buffer it held unwritten
        (a failed write's new values included: only a checkpoint load makes the state whole)."""
        from swapper import SubGroupState

        self._stepping = False
        try:
            self.swapper.synchronize()  # writes in flight finish (a failed one keeps its buffer)
        except OSError:
            pass
        for sg in self._groups:
            if self.swapper.state(sg.index) in (SubGroupState.AVAILABLE, SubGroupState.READING):
                try:
                    self.swapper.release(sg.index)
                except OSError:  # a failed prefetch: its buffer is back already
                    pass
        self._prefetched = False

    def _prefetch(self, sg: SubGroup) -> None:
        t0 = time.perf_counter()
        try:
            self.swapper.swap_in(sg.index, async_op=True)
        except OSError as error:
            # A write of the last step failed; its values are still in their buffer and the
            # step writes them again (and raises if that fails too). A prefetch is only a hint.
            logging.getLogger("zero").warning("optimizer prefetch: %s; the step will retry", error)
            return
        finally:
            self.write_wait_seconds += time.perf_counter() - t0  # a write still in flight
        self._prefetched = True

    def _write_held(self, groups) -> None:
        """Write out sub-groups a failed step left in host memory (their buffers are needed)."""
        from swapper import SubGroupState

        for sg in groups:
            if self.swapper.state(sg.index) is SubGroupState.AVAILABLE:
                self.swapper.swap_out(sg.index, async_op=True)

    def write_master(self, unit_index: int, values: torch.Tensor) -> None:
        sg = self.rank_layout.sub_group_of(unit_index)
        start, stop = self.rank_layout.unit_range(unit_index)
        tensors = self.swapper.swap_in(sg.index)
        tensors.master[start - sg.start:stop - sg.start].copy_(values)
        self.swapper.swap_out(sg.index)

    def read(self, sub_group: SubGroup):
        if sub_group.numel == 0:
            return torch.empty(0), {k: torch.empty(0) for k in self.state_names}
        t0 = time.perf_counter()
        tensors = self.swapper.swap_in(sub_group.index)
        try:
            return tensors.master.clone(), {k: v.clone() for k, v in tensors.states.items()}
        finally:
            self.swapper.release(sub_group.index)
            self.read_wait_seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def viewed(self, sub_group: SubGroup) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        if not sub_group.numel:
            yield self.read(sub_group)
            return
        t0 = time.perf_counter()
        tensors = self.swapper.swap_in(sub_group.index)  # verified against its checksums, if on
        self.read_wait_seconds += time.perf_counter() - t0
        try:
            yield tensors.master, dict(tensors.states)
        finally:
            self.swapper.release(sub_group.index)

    def load(self, sub_group: SubGroup, master: torch.Tensor, states: Optional[Dict[str, torch.Tensor]]) -> None:
        if not sub_group.numel:
            return
        if states is not None:
            self.swapper.initialize(sub_group.index, master, states)
            return
        tensors = self.swapper.swap_in(sub_group.index)
        tensors.master.copy_(master)
        self.swapper.swap_out(sub_group.index)

    def save_shard(self, sub_group: SubGroup, shards, path: str) -> None:
        """The swap file becomes the shard by a hard link, or is copied file to file; with
        checksums on, the digests recorded when it was written travel with it."""
        stored = self._stored_file(sub_group)
        if stored is None:
            super().save_shard(sub_group, shards, path)
            return
        shards.save_shard(path, sub_group.numel, ["master", *self.state_names], stored=stored,
                          link=lambda dest, header, copy: self._link_state(sub_group, dest, header, copy),
                          checksums=self._stored_checksums(sub_group))

    def load_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                   carried: Optional[Tuple[str, Dict[str, int]]] = None) -> torch.Tensor:
        """The shard becomes the swap file by a hard link (it is never written again), else its
        bytes are read straight into the pool buffer, else loaded as tensors."""
        if not load_states:
            return super().load_shard(sub_group, shard, path, keys, load_states)
        offsets = {k: shard.data_start + shard.info(k).begin for k in keys}
        source = shard.source  # the path, or the parts of a striped shard
        if self._adopt_file(sub_group, source, offsets, carried):  # the swapper keeps the digests
            return shard.get_tensor("master")
        master = self._import_state(sub_group, {k: (source, offset) for k, offset in offsets.items()})
        if master is not None:
            return master
        return super().load_shard(sub_group, shard, path, keys, load_states)

    link_on_load = True  # a staged shard is hard-linked where it can be (False: always copied)

    def stage_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                    algorithm) -> Optional[object]:
        if not load_states or not sub_group.numel:
            return None
        sources = {k: (shard.source, shard.data_start + shard.info(k).begin) for k in keys}
        own = self.swapper.checksum
        if (own is not None and own is not algorithm) or not self.swapper.can_stage(sub_group.index, sources):
            return None
        t0 = time.perf_counter()
        try:
            return self.swapper.stage_state(sub_group.index, sources, algorithm, link=self.link_on_load)
        finally:
            self.read_wait_seconds += time.perf_counter() - t0

    def publish_shard(self, sub_group: SubGroup, staged,
                      carried: Tuple[str, Dict[str, int]]) -> Optional[torch.Tensor]:
        return self.swapper.publish_staged(staged, carried if self.swapper.checksum is not None else None)

    def discard_staged(self, staged) -> None:
        self.swapper.discard_staged(staged)

    def _stored_file(self, sub_group: SubGroup) -> Optional[Tuple[str, Dict[str, int]]]:
        # With checksums on, the checkpoint carries the digests recorded when the file was
        # written (stored_checksums): its load verifies the bytes (checkpoint/shard_io.py [Note]).
        if not sub_group.numel:
            return None
        t0 = time.perf_counter()
        try:
            return self.swapper.stored_file(sub_group.index)
        finally:
            self.read_wait_seconds += time.perf_counter() - t0

    def _stored_checksums(self, sub_group: SubGroup) -> Optional[Tuple[str, Dict[str, int]]]:
        digests = self.swapper.stored_checksums(sub_group.index) if sub_group.numel else None
        return None if digests is None else (self.swapper.checksum.value, digests)

    def _import_state(self, sub_group: SubGroup, sources: Dict[str, Tuple[str, int]]) -> Optional[torch.Tensor]:
        if not sub_group.numel or not self.swapper.can_import:
            return None
        tensors = self.swapper.import_state(sub_group.index, sources, write=False)
        master = tensors.master.clone()  # a memory copy: cheaper than reading the file again
        self.swapper.swap_out(sub_group.index, async_op=True)
        return master

    def _link_state(self, sub_group: SubGroup, dest, header: bytes, copy) -> bool:
        if not sub_group.numel:
            return False
        t0 = time.perf_counter()
        try:
            return self.swapper.link_state(sub_group.index, dest, header, copy)
        finally:
            self.write_wait_seconds += time.perf_counter() - t0

    def _adopt_file(self, sub_group: SubGroup, path: str, offsets: Dict[str, int],
                    checksums: Optional[Tuple[str, Dict[str, int]]] = None) -> bool:
        return bool(sub_group.numel) and self.swapper.adopt_file(sub_group.index, path, offsets, checksums)

    @property
    def swap_dir(self) -> str:
        return self.swapper.swap_dir.path

    def check_free_space(self) -> None:
        self.swapper.check_free_space()

    def close(self) -> None:
        self.swapper.cleanup()
