"""The prefetch and keep policy of the hooks (hooks.py): which units to read ahead, which to
keep gathered after use, and the bound on live parameters.

[Note: prefetch by recorded trace]
The order units are fetched in during one iteration (forward and backward) is
recorded; in the next iteration each fetch that matches the recorded order
starts the NVMe reads of the next units (up to ``stage3_prefetch_bucket_size``
elements and the bytes the store has room for). When the order differs, prefetching stops
for the rest of that iteration and the new order is recorded: no warnings, no
stale trace.

[Note: read-ahead in batches]
The store says how many bytes may be read ahead (``prefetch_capacity``) and
what each unit costs (``prefetch_cost``): the pool's bytes, not its buffers,
bound the read-ahead (swapper/_span_pool.py). Each fetch frees about one
unit's bytes. Read ahead one unit at a time, the reads would spread over
every read queue, and a fetch, which waits for its whole queue
(swapper/_param_swapper.py, [Note: a ring of read queues, so a fetch waits
for its own read only]), would wait for reads far ahead of it. So while room
is what limits it, the read-ahead waits until a batch's worth
(``prefetch_batch_bytes``) is free, and the store gives each batch a queue
of its own.

[Note: inference reads ahead across forwards, into the buffers it computes on]
With no optimizer (a ZeRO-Inference engine) nothing changes the shards
between forwards, and ``generate`` runs the same forward once per token. So the
trace is read ahead cyclically: near the end of a forward the first units of
the next one are prefetched (kept, not dropped, when it begins), and a
non-persistent unit fetched from NVMe lends the pool buffer it was read into
to its parameters (no copy) until it is released, when the store can spare
the buffer (see ``NvmeParamStore.lend``). A training engine's step rewrites
shards after backward, so it wraps only over its frozen units (see the next note) and lends only
to Linears (hooks.py).

[Note: frozen units are read ahead across iterations]
A step changes only units with a parameter that requires grad. A training
engine's frozen units (a LoRA base) are the same in the next forward, so its
backward reads them ahead as inference reads the next forward's first units:
past the trace's end the walk takes the frozen units of the next forward and
skips the rest. Without it the disk was idle through backward and the step
(on an H200, a 0.17 s backward of the 311M LoRA stand-in's 0.40 s iteration),
and the next forward waited for its first reads. The walk reaches the next
forward only once everything of this iteration before it is gathered or on its
way, and a read ahead never takes the pool's spare region, so backward's own
fetches and the step's writes are not held up. Backward releases the base from
its last layer to its first, so the next forward's units come free in the
reverse of the order it needs them: where the room for reads ahead holds all
of the next forward's frozen units (an int8 base) they are read as they come
free; where it does not (an fp32 base larger than the pool), reads of its last
layers would hold the room its first layers need, and the walk stops at the
first unit still gathered for this backward, so those reads start as the
first layers come free, at the end of backward, in the order the forward
needs them. A write into a frozen unit between
iterations (a checkpoint load, ``GatheredParameters`` modifying it) replaces the
bytes read ahead: the NVMe store overwrites the pool buffer the read landed in,
the host-resident one drops its copy.

[Note: kept units give way to read-ahead]
A training unit lent its pool buffer (hooks.py, [Note: lending in training])
and kept for a near reuse holds that buffer's bytes. Kept units fill the pool
during forward (every unit is reused in backward), and the read-ahead, with no
room left, stopped: forward read one block at a time, the disk idle half of
it. So a read-ahead for forward short of room copies kept lent units out of
the pool (``ParamUnit.unlend``), oldest first, whose next use comes after the
unit it reads ahead (that one is needed sooner); the copies stay kept, so
backward reads them from memory. Backward's read-ahead does not: an fp32 unit
homed in the optimizer's master is copied from its sub-group once the optimizer
has read it (its read-ahead runs in front of backward), so reading it early
from NVMe would read those bytes twice.

[Note: the read-ahead resumes where it stopped]
Each fetch used to look for units to read ahead from the next trace position on, past every
unit gathered, kept or already on its way: with a model kept gathered from forward to
backward (a LoRA base) every fetch walked the rest of the trace, quadratic in the units, 0.3 s
of an iteration's Python for 339 units here. So the prefetcher keeps ``scan_from``, the first
trace position its last look did not settle (one it stopped at for want of budget, room or
live bound), and the next look begins there. A position behind it to look at again (a settled
unit that became unavailable before its next use: released to make room, its read-ahead
dropped, or in backward a frozen unit whose next use is the next forward's; a read that did
not start) goes on a heap, ``revisit``, which each look takes first, in trace order
(:meth:`Prefetcher.became_unavailable`, which the units call): nothing the old walk would have
read ahead is missed, and moving ``scan_from`` back instead made a LoRA backward, which
releases the base from its last layer to its first, walk the next forward once per release.

[Note: the first reads go first]
A fetch records its unit and reads ahead before it gathers: a unit nothing read ahead (the
iteration's first, or one the room did not reach) had its read queued behind the reads ahead
of it, and waited for them (the 311M LoRA's embedding, 8 MiB of int8, 58 ms on a GPU). So a
fetch starts its own unit's read first (hooks.py ``fetch``), and an iteration starts the reads
of its first units before it gathers the persistent units a step released (hooks.py
``_pre_forward``), whose copies ran with the disk idle.

[Note: live parameters and reuse distance]
``stage3_max_live_parameters`` bounds the elements of non-persistent units that
are gathered or being prefetched at once: prefetching stops at the bound, and
a unit is kept gathered after use (instead of released) only within it. Only
the units the running modules need right now can push past it. A unit is kept
when the trace says it is fetched again within ``stage3_max_reuse_distance``
elements of other fetches (a block used at the end of forward and again at the
start of backward), which saves reading it from NVMe twice. The coordinator's ``live_numel`` and
``peak_live_numel`` make the bound observable.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Dict, List, Optional, Set

from ..stores.param_store import ParamStore
from .param_state import ParamState
from .timers import logger
from .unit import ParamUnit


class LiveBound:
    """Elements of non-persistent units gathered or being prefetched (``numel``, its ``peak``),
    bounded by ``stage3_max_live_parameters`` (``limit``); ``kept``: units gathered after use
    for a near reuse, oldest first (see [Note: live parameters and reuse distance])."""

    def __init__(self, limit: int):
        self.limit = limit
        self.numel = 0
        self.peak = 0
        self.kept: Dict[ParamUnit, None] = {}

    def count(self, numel: int) -> None:
        self.numel += numel
        self.peak = max(self.peak, self.numel)

    def make_room(self, numel: int) -> None:
        """Release units kept for reuse, oldest first, until ``numel`` more fit the bound."""
        while self.kept and self.numel + numel > self.limit:
            kept = next(iter(self.kept))
            del self.kept[kept]
            if kept.state is ParamState.AVAILABLE and kept.releasable:
                kept.release()
                self.numel -= kept.layout.numel


class Prefetcher:
    """Records the order units are fetched in and, while an iteration follows the recorded
    order, starts the reads of the next units (see the notes above)."""

    def __init__(self, units: List[ParamUnit], store: ParamStore, live: LiveBound, prefetch_numel: int,
                 max_reuse_distance: int, inference: bool):
        self.units = units
        self.store = store
        self.live = live
        self.prefetch_numel = prefetch_numel
        self.max_reuse_distance = max_reuse_distance
        self.inference = inference
        # Units the next forward finds as this one left them: every unit of an inference engine, a
        # training engine's frozen ones (see [Note: frozen units are read ahead across iterations]).
        self.unchanging: Set[int] = {u.index for u in units if inference or not u.grad_count}
        self.trace: Optional[List[int]] = None
        self.recording: List[int] = []
        self.trace_ok = False
        self.next_use: List[int] = []  # per trace position: where the same unit is fetched next
        self.trace_numel: List[int] = []  # prefix sums of the fetched units' elements
        self.last_fetch: Dict[int, int] = {}  # unit -> its latest position in this iteration
        self.ahead: Set[int] = set()  # units prefetched for the next forward (of self.unchanging)
        self.backward_at: Optional[int] = None  # the trace position of backward's first fetch
        self._backward_recorded: Optional[int] = None
        self.positions: Dict[int, List[int]] = {}  # unit -> its trace positions, in order
        self.any_order = inference  # see _index_trace
        self.scan_from = 0  # see [Note: the read-ahead resumes where it stopped]
        self.revisit: List[int] = []  # a heap of positions behind scan_from to look at again
        for unit in units:
            unit.on_unavailable = self.became_unavailable

    def reused_soon(self, u: ParamUnit) -> bool:
        """Whether the trace fetches ``u`` again within the reuse distance, with room to keep it."""
        if not self.trace_ok or self.live.numel > self.live.limit:
            return False
        now = len(self.recording) - 1
        last = self.last_fetch.get(u.index, -1)
        nxt = self.next_use[last] if 0 <= last < len(self.next_use) else -1
        if nxt <= now:
            return False
        return self.trace_numel[nxt] - self.trace_numel[now + 1] <= self.max_reuse_distance

    def backward_begins(self) -> None:
        """The next fetch is the iteration's first of backward."""
        if self._backward_recorded is None:
            self._backward_recorded = len(self.recording)

    def _copy_out_kept_lent(self, needed_at: int) -> bool:
        """Copy out the oldest unit kept for reuse that holds a pool buffer (lent, hooks.py) and is
        next used after trace position ``needed_at``: a read ahead for that position needs the room
        sooner (see [Note: kept units give way to read-ahead]). False when there is none, and
        in backward, whose fp32 fetches the optimizer's reads serve."""
        if self.backward_at is None or needed_at >= self.backward_at:
            return False
        for kept in self.live.kept:
            if kept.lent:
                last = self.last_fetch.get(kept.index, -1)
                nxt = self.next_use[last] if 0 <= last < len(self.next_use) else -1
                if nxt == -1 or nxt > needed_at:
                    kept.unlend()
                    return True
        return False

    def begin_iteration(self) -> None:
        if self.recording:
            if self.trace is not None and self.trace != self.recording:
                logger.debug("zero: the order of parameter fetches changed; recording the new order")
            self.trace = self.recording
            self.backward_at = self._backward_recorded
            self._index_trace()
        self.recording = []
        self._backward_recorded = None
        self.last_fetch = {}
        self.trace_ok = self.trace is not None
        self.scan_from = 0
        self.revisit = []
        ahead = {i for i in self.ahead if self.trace_ok and self.units[i].state is ParamState.INFLIGHT}
        self.ahead = set()
        self.store.drop_prefetched(keep=ahead)
        for u in self.units:
            if u.index not in ahead:  # prefetched, never used
                u.drop_prefetch()
        self.live.numel = sum(u.layout.numel for u in self.units if not u.persistent and (
            u.state is ParamState.AVAILABLE or u.index in ahead))

    def _index_trace(self) -> None:
        trace = self.trace
        self.next_use = [-1] * len(trace)
        last: Dict[int, int] = {}
        for pos in range(len(trace) - 1, -1, -1):
            self.next_use[pos] = last.get(trace[pos], -1)
            last[trace[pos]] = pos
        self.trace_numel = [0]
        for index in trace:
            self.trace_numel.append(self.trace_numel[-1] + self.units[index].layout.numel)
        self.positions = {}
        for pos, index in enumerate(trace):
            self.positions.setdefault(index, []).append(pos)
        # Whether backward may read the next forward's frozen units in the order they come free
        # (see [Note: frozen units are read ahead across iterations]).
        forward = {i for i in trace[:self.backward_at or 0] if i in self.unchanging and not self.units[i].persistent}
        self.any_order = self.inference or sum(
            self.store.prefetch_cost(self.units[i].layout) for i in forward) <= self.store.prefetch_room()

    def became_unavailable(self, u: ParamUnit) -> None:
        """``u`` was released or its read-ahead dropped: a look ahead that settled its next use
        must look there again."""
        if not self.trace_ok:
            return
        now = len(self.recording) - 1
        uses = self.positions.get(u.index, ())
        at = bisect.bisect_right(uses, now)
        if at < len(uses):
            nxt = uses[at]
        elif u.index in self.unchanging and uses:
            nxt = uses[0] + len(self.trace)  # the next forward's (virtual positions past the trace's end)
        else:
            return
        if nxt < self.scan_from:
            heapq.heappush(self.revisit, nxt)

    def _end(self, pos: int) -> int:
        """Where a look from trace position ``pos`` stops: the trace's end or, where units stay
        unchanged across forwards, virtual positions past it (the next forward's: inference up to
        a whole trace ahead, a training engine through its next forward only)."""
        length = len(self.trace)
        if not self.unchanging:
            return length
        if self.inference:
            return pos + length
        return length + self.backward_at if self.backward_at is not None else length

    def record(self, u: ParamUnit) -> None:
        pos = len(self.recording)
        self.recording.append(u.index)
        self.last_fetch[u.index] = pos
        if not self.trace_ok:
            return
        if pos >= len(self.trace) or self.trace[pos] != u.index:
            self.trace_ok = False
            return
        self._look_ahead(pos + 1, u)

    def backward_ended(self) -> None:
        """Backward released what it held: read on into the next forward (its frozen units, see
        [Note: frozen units are read ahead across iterations]); no fetch would start it before the
        step."""
        if self.trace_ok and self.unchanging and not self.inference and self.recording:
            self._look_ahead(len(self.recording), None)

    def read_ahead_at_start(self) -> None:
        """Before anything is fetched in an iteration: start the reads of its first units (see
        [Note: the first reads go first])."""
        if self.trace_ok and not self.recording:
            self._look_ahead(0, None)

    def _look_ahead(self, first: int, u: Optional[ParamUnit]) -> None:
        """Start the reads of the units from trace position ``first`` on (``u``: being fetched now)."""
        pos = first - 1
        if not self.store.reads_ahead:
            return
        room = self.store.prefetch_capacity()  # bytes
        budget = self.prefetch_numel
        wanted: List[ParamUnit] = []
        at_positions: List[int] = []  # each wanted unit's (virtual) trace position
        wraps: Set[int] = set()  # of those, units of the next forward
        length = len(self.trace)
        end = self._end(pos)
        short = False  # stopped for want of room (not by the budget, the live bound or the trace's end)
        wanted_bytes = live = 0
        v = max(pos + 1, self.scan_from)
        again = self.revisit
        while again and again[0] <= pos:  # passed
            heapq.heappop(again)
        while budget > 0:
            behind = bool(again) and again[0] < v  # a position behind the walk to look at again first
            if not behind and v >= end:
                break
            at = again[0] if behind else v
            index = self.trace[at % length]
            nxt = self.units[index]
            if (at >= length and not self.any_order and index in self.unchanging
                    and nxt.state is ParamState.AVAILABLE and not nxt.persistent):
                break  # still gathered for this backward: the next forward reads in order
            if not (nxt.state is not ParamState.NOT_AVAILABLE or nxt is u or nxt in wanted
                    or (at >= length and index not in self.unchanging)):
                if self.live.numel + live + nxt.layout.numel > self.live.limit:
                    break
                cost = self.store.prefetch_cost(nxt.layout)
                while cost > room and self._copy_out_kept_lent(at):
                    room = self.store.prefetch_capacity() - wanted_bytes
                if cost > room:
                    short = True
                    break
                wanted.append(nxt)
                at_positions.append(at)
                if at >= length:
                    wraps.add(index)
                room -= cost
                wanted_bytes += cost
                budget -= nxt.layout.shard_numel
                live += 0 if nxt.persistent else nxt.layout.numel
            if behind:
                heapq.heappop(again)
            else:
                v += 1
        self.scan_from = v
        if not wanted or (short and wanted_bytes < self.store.prefetch_batch_bytes()):
            started = 0  # wait for a batch's worth of room (see the note)
        else:
            started = self.store.prefetch([w.layout for w in wanted])
        for at in at_positions[started:]:  # not on their way: looked at again first next time
            heapq.heappush(again, at)
        for nxt in wanted[:started]:
            if nxt.index in wraps:
                self.ahead.add(nxt.index)
            nxt.mark_prefetched()
            if not nxt.persistent:
                self.live.count(nxt.layout.numel)
