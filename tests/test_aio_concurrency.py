"""Many ops in flight, neighbouring unaligned writes to one file, several
handles and threads at once, and the GIL released during I/O."""

import threading
import time

import numpy as np
import pytest
import torch

import nvmeio
from helpers import BACKENDS, file_bytes, random_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_neighbouring_unaligned_writes_to_one_file(nvme_dir, backend):
    # 600 ops of 10007 bytes packed back to back: every boundary falls inside
    # a 4 KiB block shared with the neighbouring op.
    h = nvmeio.aio_handle(block_size=8192, queue_depth=16, intra_op_parallelism=4, backend=backend)
    n, size = 600, 10_007
    data = random_bytes(n * size)
    path = nvme_dir / "packed.bin"
    for i in range(n):
        h.async_pwrite(data[i * size:(i + 1) * size], path, i * size)
    assert h.wait() == n
    assert file_bytes(path) == data.tobytes()
    out = np.empty_like(data)
    for i in range(n):
        h.async_pread(out[i * size:(i + 1) * size], path, i * size)
    assert h.wait() == n
    assert np.array_equal(out, data)


def test_thousands_of_small_files_one_wait(nvme_dir):
    h = nvmeio.aio_handle(queue_depth=32, intra_op_parallelism=4)
    bufs = [random_bytes(65536, i) for i in range(2000)]
    for i, b in enumerate(bufs):
        h.async_pwrite(b, nvme_dir / f"s{i}.bin")
    assert h.wait() == len(bufs)
    outs = [np.empty(65536, np.uint8) for _ in bufs]
    for i, o in enumerate(outs):
        h.async_pread(o, nvme_dir / f"s{i}.bin")
    assert h.wait() == len(bufs)
    assert all(np.array_equal(a, b) for a, b in zip(bufs, outs))


def test_dropping_the_buffer_of_an_async_write_is_safe(nvme_dir):
    h = nvmeio.aio_handle()
    expected = random_bytes(8 << 20, 5)
    h.async_pwrite(torch.from_numpy(expected.copy()), nvme_dir / "d.bin")  # only the handle holds it
    assert h.wait() == 1
    assert file_bytes(nvme_dir / "d.bin") == expected.tobytes()


def test_several_handles_in_several_threads(nvme_dir):
    errors = []

    def work(k):
        try:
            h = nvmeio.aio_handle(queue_depth=4, intra_op_parallelism=1 + k % 3,
                                  backend=BACKENDS[k % len(BACKENDS)])
            for j in range(5):
                src = random_bytes(300_000 + 4097 * k + j, seed=k * 10 + j)
                path = nvme_dir / f"t{k}_{j}.bin"
                h.sync_pwrite(src, path, file_offset=j * 513)
                dst = np.empty_like(src)
                h.sync_pread(dst, path, file_offset=j * 513)
                assert np.array_equal(src, dst)
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_one_handle_shared_by_threads(nvme_dir):
    h = nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=3)
    srcs = {k: random_bytes(1_000_000 + k, seed=k) for k in range(4)}
    errors = []

    def work(k):
        try:
            for j in range(3):
                h.async_pwrite(srcs[k], nvme_dir / f"sh{k}_{j}.bin")
            h.wait()
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k, src in srcs.items():
        for j in range(3):
            assert file_bytes(nvme_dir / f"sh{k}_{j}.bin") == src.tobytes()


def test_gil_is_released_during_io(nvme_dir):
    # A Python thread keeps ticking while a long sync write runs. If the GIL
    # were held for the write, it could not tick inside that window.
    h = nvmeio.aio_handle(queue_depth=4, block_size=1 << 20)
    t = h.new_cpu_locked_tensor(512 << 20, torch.empty(0, dtype=torch.uint8))
    t.fill_(1)
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.01)
    begin = time.monotonic()
    h.sync_pwrite(t, nvme_dir / "gil.bin")
    end = time.monotonic()
    stop.set()
    th.join()
    inside = [x for x in ticks if begin < x < end]
    assert end - begin > 0.02, "write too fast to observe"
    assert len(inside) >= 5, f"only {len(inside)} ticks during {end - begin:.3f}s of I/O"


def test_wait_reports_the_first_error_of_any_thread_and_per_thread_handles_isolate(nvme_dir):
    # Documented (aio_handle.wait): one handle is one queue, as in DeepSpeed.
    shared = nvmeio.aio_handle(backend="psync")
    submitted = threading.Event()

    def thread_a():
        shared.async_pwrite(random_bytes(10_000), "/dev/full")   # fails with ENOSPC
        submitted.set()

    a = threading.Thread(target=thread_a)
    a.start()
    submitted.wait()
    a.join()
    good = random_bytes(10_000, 1)
    with pytest.raises(nvmeio.AioError) as e:
        shared.sync_pwrite(good, nvme_dir / "b.bin")             # thread B's op succeeds ...
    assert e.value.filename == "/dev/full"                       # ... B's wait names A's op
    assert file_bytes(nvme_dir / "b.bin") == good.tobytes()
    assert shared.wait() == 0                                    # reported once

    # A handle per thread: each wait() sees only its own ops.
    errors = {}

    def own_handle(name, path):
        h = nvmeio.aio_handle(backend="psync")
        try:
            h.sync_pwrite(random_bytes(10_000), path)
        except nvmeio.AioError as exc:
            errors[name] = exc.filename
        h.close()

    threads = [threading.Thread(target=own_handle, args=("a", "/dev/full")),
               threading.Thread(target=own_handle, args=("b", str(nvme_dir / "c.bin")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == {"a": "/dev/full"}
