"""PipelinedOptimizerSwapper: same bits as the plain swapper; reads ahead and writes behind."""
import os

import pytest
import torch

import nvmeio
from nvmeio import _handle_choice as handle_choice
from swapper import PartitionedOptimizerSwapper, PipelinedOptimizerSwapper

SIZES = [1000, 4097, 33, 2048, 777]
FLAGS = [(True, True), (True, False), (False, True), (False, False)]


def _adam_fn(grads, step):
    def fn(sg, t):
        beta1, beta2, lr, eps, wd = 0.9, 0.999, 1e-3, 1e-8, 0.01
        g = grads[(sg, step)]
        t.master.mul_(1 - lr * wd)
        t.exp_avg.lerp_(g, 1 - beta1)
        t.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (t.exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
        t.master.addcdiv_(t.exp_avg, denom, value=-lr / (1 - beta1 ** step))

    return fn


def _train(swapper, steps=3):
    for i, n in enumerate(SIZES):
        swapper.register_sub_group(i, n)
    for i, n in enumerate(SIZES):
        swapper.initialize(i, torch.randn(n, generator=torch.Generator().manual_seed(i)))
    grads = {(i, s): torch.randn(n, generator=torch.Generator().manual_seed(1000 * s + i))
             for i, n in enumerate(SIZES) for s in range(1, steps + 1)}
    for s in range(1, steps + 1):
        swapper.step(_adam_fn(grads, s))
    out = []
    for i in range(len(SIZES)):
        t = swapper.swap_in(i)
        out.append([t.master.clone(), t.exp_avg.clone(), t.exp_avg_sq.clone()])
        swapper.release(i)
    return out


@pytest.mark.parametrize("pipeline_read, pipeline_write", FLAGS)
def test_pipelined_gives_exactly_the_plain_results(tmp_path, pipeline_read, pipeline_write):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with PartitionedOptimizerSwapper(tmp_path / "a", None) as plain:
        expected = _train(plain)
    with PipelinedOptimizerSwapper(
        tmp_path / "b", None, pipeline_read=pipeline_read, pipeline_write=pipeline_write, checksum="crc32"
    ) as piped:
        got = _train(piped)
        assert piped.pool.buffer_count == 1 + pipeline_read + pipeline_write
    for e, g in zip(expected, got):
        for a, b in zip(e, g):
            assert torch.equal(a, b)
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


class _Recorder:
    """Wraps nvmeio.aio_handle to log submissions and completions in order."""

    events = []

    def __init__(self, **kwargs):
        self._h = _REAL_HANDLE(**kwargs)
        self._pending = []

    def async_pread(self, buf, path, file_offset=0):
        self.events.append(("read", os.path.basename(path)))
        return self._h.async_pread(buf, path, file_offset)

    def async_pwrite(self, buf, path, file_offset=0):
        self._pending.append(os.path.basename(path))
        self.events.append(("write", os.path.basename(path)))
        return self._h.async_pwrite(buf, path, file_offset)

    def wait(self):
        for name in self._pending:
            self.events.append(("written", name))
        self._pending = []
        return self._h.wait()

    def __getattr__(self, name):
        return getattr(self._h, name)


_REAL_HANDLE = nvmeio.aio_handle


def _schedule(tmp_path, monkeypatch, **flags):
    monkeypatch.setattr(handle_choice, "aio_handle", _Recorder)
    _Recorder.events = []
    with PipelinedOptimizerSwapper(tmp_path, None, **flags) as s:
        for i in range(4):
            s.register_sub_group(i, 64)
        for i in range(4):
            s.initialize(i, torch.zeros(64))
        _Recorder.events.clear()
        held = []
        s.step(lambda sg, t: (_Recorder.events.append(("step", f"subgroup{sg}.swp")),
                              held.append(s.pool.buffer_count - s.pool.free_count)))
        return [(kind, int(name[len("subgroup"):-4])) for kind, name in _Recorder.events], max(held)


def test_schedule_reads_ahead_and_writes_behind(tmp_path, monkeypatch):
    events, held = _schedule(tmp_path, monkeypatch, pipeline_read=True, pipeline_write=True)
    assert events == [
        ("read", 0), ("read", 1), ("step", 0), ("write", 0),
        ("read", 2), ("step", 1), ("written", 0), ("write", 1),
        ("read", 3), ("step", 2), ("written", 1), ("write", 2),
        ("step", 3), ("written", 2), ("write", 3), ("written", 3),
    ]
    assert held == 3  # i-1 writing, i stepping, i+1 reading


def test_schedule_without_pipelining_is_the_plain_one(tmp_path, monkeypatch):
    events, held = _schedule(tmp_path, monkeypatch, pipeline_read=False, pipeline_write=False)
    expected = []
    for i in range(4):
        expected += [("read", i), ("step", i), ("write", i), ("written", i)]
    assert events == expected and held == 1


def test_read_only_pipelining_writes_each_sub_group_before_the_next_step(tmp_path, monkeypatch):
    events, held = _schedule(tmp_path, monkeypatch, pipeline_read=True, pipeline_write=False)
    assert events[:6] == [("read", 0), ("read", 1), ("step", 0), ("write", 0), ("written", 0), ("read", 2)]
    assert held == 2


def test_write_only_pipelining_overlaps_the_write_with_the_next_step(tmp_path, monkeypatch):
    events, held = _schedule(tmp_path, monkeypatch, pipeline_read=False, pipeline_write=True)
    assert events[:7] == [("read", 0), ("step", 0), ("write", 0), ("read", 1), ("step", 1), ("written", 0), ("write", 1)]
    assert held == 2


def test_explicit_buffer_count_below_the_pipeline_depth_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needs buffer_count >= 3, got 2"):
        PipelinedOptimizerSwapper(tmp_path, None, buffer_count=2)
    PipelinedOptimizerSwapper(tmp_path, None, buffer_count=2, pipeline_write=False).cleanup()
    assert os.listdir(tmp_path) == []


def test_a_swap_in_waits_for_its_own_read_only(tmp_path, monkeypatch):
    """Each read has a queue of its own (swapper/_optimizer_swapper.py [Note: reads on queues of their
    own]): a swap-in completes its sub-group's read and leaves those read ahead in flight, and
    a larger buffer_count lets read_if_room read further ahead; the bytes are the initial ones."""
    from swapper._io_queue import IoQueue
    from swapper._sub_group import SubGroupState

    # read_if_room settles a read that has already landed, and small reads may land at once: here
    # none counts as landed, so a sub-group's state changes only when something waits for its read.
    monkeypatch.setattr(IoQueue, "landed", lambda self: False)

    values = {i: torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(SIZES)}
    with PipelinedOptimizerSwapper(tmp_path, None, buffer_count=5) as s:
        for i, n in enumerate(SIZES):
            s.register_sub_group(i, n)
        for i in range(5):
            s.initialize(i, values[i])
        s.synchronize()
        s.swap_in(0, async_op=True)
        assert [s.read_if_room(i) for i in (1, 2, 3, 4)] == [True, True, True, True]
        assert all(s.state(i) is SubGroupState.READING for i in range(5))
        assert torch.equal(s.swap_in(2).master, values[2])
        assert s.state(2) is SubGroupState.AVAILABLE
        assert all(s.state(i) is SubGroupState.READING for i in (0, 1, 3, 4))  # not waited for
        assert s.pool.free_count == 0 and s.read_if_room(1)  # still in flight: no second read
        for i in (0, 1, 3, 4):
            assert torch.equal(s.swap_in(i).master, values[i])
        for i in range(5):
            s.release(i)
        assert s.pool.free_count == 5
