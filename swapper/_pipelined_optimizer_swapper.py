"""PipelinedOptimizerSwapper: read sub-group i+1 and write i-1 while i is stepped.

[Note: the schedule, and why reads and writes have separate handles]
With both switches on, while the step function runs on sub-group i, the read
of i+1 (``pipeline_read``) and the write of i-1 (``pipeline_write``) are in
flight on the nvmeio worker threads, which hold no GIL. Per sub-group i:

1. wait for the read of i (submitted during i-1's step, or just now);
2. submit the read of i+1                               (pipeline_read);
3. run the step function on i;
4. wait for the write of i-1, which returns its buffer  (pipeline_write);
5. submit the write of i; without pipeline_write, wait for it here;
6. without pipeline_read, submit the read of i+1 now (step 1 waits for it).

``aio_handle.wait()`` completes every op of its handle, so reads and writes
use two handles: waiting for the read of i+1 never waits for the write of i.
Host memory: 1 + pipeline_read + pipeline_write sub-group buffers. The step
function sees exactly the bytes the plain swapper would give it, in the same
order, so results are bit-identical (tests/test_swapper_pipelined.py pins that).
"""
from __future__ import annotations

from typing import List

from ._optimizer_swapper import PartitionedOptimizerSwapper, StepFn, StepStats


class PipelinedOptimizerSwapper(PartitionedOptimizerSwapper):
    """:class:`PartitionedOptimizerSwapper` whose :meth:`step` overlaps I/O with the step function.

    ``pipeline_read`` / ``pipeline_write`` are the DeepSpeed ``offload_optimizer``
    switches of the same names; with both off the schedule is the plain one.
    """

    def __init__(self, *args, pipeline_read: bool = True, pipeline_write: bool = True, **kwargs):
        # Instance attributes shadow the class defaults before __init__ sizes the pool.
        self.pipeline_read = bool(pipeline_read)
        self.pipeline_write = bool(pipeline_write)
        super().__init__(*args, **kwargs)

    def _schedule(self, step_fn: StepFn, ids: List[int], stats: StepStats) -> None:
        """Steps 1-6 of the [Note] above."""
        if ids:
            self._read_if_needed(ids[0])
        for k, sg in enumerate(ids):
            nxt = ids[k + 1] if k + 1 < len(ids) else None
            g = self._group(sg)
            self._await_read(g, stats)
            if nxt is not None and self.pipeline_read:
                self._read_if_needed(nxt)
            self._run_step(step_fn, g, stats)
            if self.pipeline_write:
                self._wait(self._writes, stats)
            self._begin_write(g)
            if not self.pipeline_write:
                self._wait(self._writes, stats)
            if nxt is not None and not self.pipeline_read:
                self._read_if_needed(nxt)
        self._wait(self._writes, stats)
