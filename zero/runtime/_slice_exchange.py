"""Reduce-scatter and all-gather of host tensors by exchanging slices point to point (gloo).

[Note: gloo's flat collectives, and the exchange that replaces them]
Under gloo (host tensors) torch's ``reduce_scatter_single`` took 2.7x as long as an
``all_reduce`` of the same 28 MB buffer, and ``all_gather_single`` 1.6x (two ranks on
this machine's 2 CPUs, where every byte a collective moves costs CPU time that
training needs: bench/RESULTS.md, the ZeRO ladder's changelog). Both need much less:
each rank owns one equal slice of the flat buffer, so it sends every other rank that
rank's slice (``isend``) and receives the others' contributions to its own
(``irecv``): (N-1)/N of the buffer each way, what a ring collective moves, with no
all-reduce's second half. The reduction sums its slice's contributions on the owner in
rank order, so every run gives the same bits (with two ranks ``a + b``, DDP's
all-reduce's sum). The ranks issue their exchanges in the same order (the engine's
collectives always are: grad_reducer.py [Note: every rank reduces the same units in
the same order]), so a counter shared by nothing but that order pairs each send with
its receive (the tag).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

_TAGS = 1 << 30  # gloo's tags are 32-bit: the counter wraps well below


class Exchange:
    """The work of one exchange: ``wait()`` waits for its receives, finishes (the sum), then
    waits for its sends (their buffers are the caller's until then)."""

    def __init__(self, sends: List, recvs: List, finish: Optional[Callable[[], None]] = None):
        self._sends, self._recvs, self._finish = sends, recvs, finish

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._sends + self._recvs)

    def wait(self) -> bool:
        for work in self._recvs:
            work.wait()
        if self._finish is not None:
            self._finish()
        for work in self._sends:
            work.wait()
        self._sends = self._recvs = []
        self._finish = None
        return True


class SliceExchange:
    """The exchanges of one rank of a group: ``peers[j]`` is group rank j's global rank."""

    def __init__(self, rank: int, peers: Sequence[int], group=None):
        self.rank = rank
        self.peers = list(peers)
        self.group = group
        self._count = 0

    def _tag(self) -> int:
        self._count = (self._count + 1) % _TAGS
        return self._count

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """``shard`` gets the sum, over the ranks, of their ``full``'s slice ``rank``."""
        n, world = shard.numel(), len(self.peers)
        if n == 0:
            return Exchange([], []) if async_op else None
        parts = [full[j * n:(j + 1) * n] for j in range(world)]
        tag = self._tag()
        # The first other rank's contribution lands in ``shard`` itself, the rest (more than two
        # ranks) in a buffer; ``shard`` then adds the other of the first two in rank order (a
        # sum of two is the same bits either way round) and the rest in order.
        first = 1 if self.rank == 0 else 0
        received = torch.empty((world - 2) * n, dtype=full.dtype, device=full.device) if world > 2 else None
        contributions, sends, recvs = [], [], []
        for j in range(world):
            if j == self.rank:
                contributions.append(parts[j])
                continue
            sends.append(dist.isend(parts[j], self.peers[j], group=self.group, tag=tag))
            slot = len(recvs) - 1
            contributions.append(shard if j == first else received[slot * n:(slot + 1) * n])
            recvs.append(dist.irecv(contributions[-1], self.peers[j], group=self.group, tag=tag))

        def finish() -> None:
            shard.add_(contributions[1 - first])
            for c in contributions[2:]:
                shard.add_(c)

        work = Exchange(sends, recvs, finish)
        if async_op:
            return work
        work.wait()
        return None

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """``full`` gets every rank's ``shard`` in rank order."""
        n, world = shard.numel(), len(self.peers)
        if n == 0:
            return Exchange([], []) if async_op else None
        mine = full[self.rank * n:(self.rank + 1) * n]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        tag = self._tag()
        sends, recvs = [], []
        for j in range(world):
            if j != self.rank:
                sends.append(dist.isend(mine, self.peers[j], group=self.group, tag=tag))
                recvs.append(dist.irecv(full[j * n:(j + 1) * n], self.peers[j], group=self.group, tag=tag))
        work = Exchange(sends, recvs)
        if async_op:
            return work
        work.wait()
        return None
