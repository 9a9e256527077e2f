"""Ctrl-C during wait(): KeyboardInterrupt at once, the I/O still completes
and a later wait() collects it; worker threads never take signals."""

import os
import signal
import threading

import pytest
import torch

import nvmeio


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt during the test, however pytest was launched
    (nohup and background jobs start Python with SIGINT ignored)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_sigint_interrupts_a_long_wait_and_io_completes(nvme_dir, sigint_raises):
    h = nvmeio.aio_handle(block_size=1 << 20, queue_depth=2, intra_op_parallelism=1)
    src = h.new_cpu_locked_tensor(768 << 20, torch.empty(0, dtype=torch.uint8))
    src.fill_(7)
    h.async_pwrite(src, nvme_dir / "long.bin")
    timer = threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    timer.join()
    assert h.wait() == 1                       # the write finished and is counted once
    assert os.path.getsize(nvme_dir / "long.bin") == 768 << 20
    with open(nvme_dir / "long.bin", "rb") as f:
        assert set(f.read(1 << 20)) == {7}


def test_worker_threads_block_signals():
    before = {int(t) for t in os.listdir("/proc/self/task")}
    h = nvmeio.aio_handle(intra_op_parallelism=3)
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    blocked = {}
    for tid in tids:
        with open(f"/proc/self/task/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        blocked[tid] = int(fields["SigBlk"].strip(), 16)
    sigint_bit = 1 << (signal.SIGINT - 1)
    workers = [tid for tid in tids if tid not in before]
    assert len(workers) >= 3
    assert all(blocked[tid] & sigint_bit for tid in workers)
    assert not blocked[threading.main_thread().native_id] & sigint_bit
    h.close()
