"""WriteRing: writes spread over several queues; freeing a buffer waits for the oldest batch
only, and a failure completes every write in flight before it is raised."""
import pytest
import torch

from swapper._io_queue import IoKind, WriteRing


class FakeQueue:
    """An IoQueue stand-in: ops complete when drained; ``fail`` makes the next drain raise."""

    def __init__(self):
        self.ops, self.done, self.fail = [], [], None

    def __len__(self):
        return len(self.ops)

    def submit(self, kind, buffer, path, offset, on_done):
        self.ops.append(path)

    def drain(self):
        ops, self.ops = self.ops, []
        self.done += ops
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return len(ops)


def ring(size):
    made = []

    def make():
        made.append(FakeQueue())
        return made[-1]

    first = FakeQueue()
    made.append(first)
    return WriteRing(first, make, size), made


def write(r, path):
    r.submit(IoKind.WRITE, torch.empty(0), path, 0, lambda error: None)


def test_writes_go_to_idle_queues_and_drain_some_completes_the_oldest_only():
    r, queues = ring(3)
    for name in "abc":
        write(r, name)
    assert [q.ops for q in queues] == [["a"], ["b"], ["c"]] and len(r) == 3
    write(r, "d")  # all busy: joins the youngest batch
    assert queues[2].ops == ["c", "d"]
    assert r.drain_some() == 1 and queues[0].done == ["a"] and len(r) == 3
    write(r, "e")  # the idle queue takes it and is now the youngest
    assert queues[0].ops == ["e"]
    assert r.drain_some() == 1 and queues[1].done == ["b"]
    assert r.drain_some() == 2 and queues[2].done == ["c", "d"]
    assert r.drain() == 1 and len(r) == 0


def test_a_failure_in_drain_some_completes_every_write_first():
    r, queues = ring(2)
    write(r, "a")
    write(r, "b")
    queues[0].fail = OSError(30, "Read-only file system")
    with pytest.raises(OSError, match="Read-only"):
        r.drain_some()
    assert len(r) == 0 and queues[1].done == ["b"]  # nothing left to fail a later, unrelated call


def test_one_queue_behaves_as_before():
    r, queues = ring(1)
    write(r, "a")
    write(r, "b")
    assert len(queues) == 1 and r.drain_some() == 2
