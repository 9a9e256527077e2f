"""A forked child (DataLoader workers, test ranks) inherits handles without
their threads: collecting one there must not hang, and using one raises."""

import gc
import multiprocessing as mp

import numpy as np

import nvmeio
from helpers import random_bytes


def _child(path, queue):
    try:
        h = _child.handle
        try:
            h.sync_pwrite(np.zeros(10, np.uint8), path)
            queue.put("no error")
        except RuntimeError as e:
            queue.put(str(e))
        del h, _child.handle
        gc.collect()                         # destroys the inherited handle
        queue.put("collected")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(repr(e))


def test_inherited_handle_is_dead_in_a_forked_child(nvme_dir):
    h = nvmeio.aio_handle(intra_op_parallelism=3)
    h.sync_pwrite(random_bytes(100_000), nvme_dir / "p.bin")
    _child.handle = h
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(str(nvme_dir / "c.bin"), queue))
    p.start()
    p.join(timeout=60)
    alive = p.is_alive()
    if alive:
        p.kill()
    del _child.handle
    assert not alive, "the child hung on an inherited handle"
    assert "created in another process" in queue.get(timeout=5)
    assert queue.get(timeout=5) == "collected"
    assert not (nvme_dir / "c.bin").exists()
    assert h.sync_pwrite(random_bytes(10), nvme_dir / "p2.bin") == 1   # parent's handle unharmed
