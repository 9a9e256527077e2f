"""Injected faults (nvmeio.faults) reach every failure path of the native
worker, for each backend: the error surfaces from the op that hit it, wait()
never hangs, nothing leaks, and the handle stays usable."""

import errno
import gc
import os
import sys

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes, random_bytes, run_process, unaligned_view
from nvmeio import faults, resources

BLOCK = 64 << 10


def make_handle(backend, **kw):
    kw.setdefault("queue_depth", 4)
    return nvmeio.aio_handle(block_size=BLOCK, intra_op_parallelism=1, backend=backend, **kw)


def source(h, kind, n, seed=0):
    """n bytes of data in page-aligned locked memory (engine requests on user memory)
    or at an odd address (engine requests through bounce buffers)."""
    data = random_bytes(n, seed)
    if kind == "locked":
        t = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
        buf = t.numpy()
    else:
        buf = unaligned_view(n)
    buf[:] = data
    return buf


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves fds, threads, locked memory or AIO contexts behind."""
    gc.collect()
    before = resources.snapshot()
    yield
    assert resources.grown_since(before) == {}


def roundtrip_works(h, path, n=300_000):
    src = random_bytes(n, 99)
    assert h.sync_pwrite(src, path) == 1
    dst = np.zeros_like(src)
    assert h.sync_pread(dst, path) == 1
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("memory", ["locked", "unaligned"])
def test_failed_request_fails_only_its_op(backend, memory, nvme_dir, no_leaks):
    h = make_handle(backend)
    a, b = source(h, memory, 1 << 20, 1), source(h, memory, 1 << 20, 2)
    with faults.inject(fail_nth=2, errno="ENOSPC", path_contains="b.bin") as fired:
        h.async_pwrite(a, nvme_dir / "a.bin")
        h.async_pwrite(b, nvme_dir / "b.bin")
        with pytest.raises(nvmeio.AioError) as e:
            h.wait()
    assert fired()["failed"] == 1
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(nvme_dir / "b.bin")
    assert (e.value.offset, e.value.length) == (BLOCK, BLOCK)     # the 2nd request of b.bin
    assert "write failed: No space left on device" in str(e.value)
    assert file_bytes(nvme_dir / "a.bin") == a.tobytes()          # the other op is whole
    assert not (nvme_dir / "b.bin").exists()                      # the failed new file is gone
    assert h.wait() == 0
    roundtrip_works(h, nvme_dir / "again.bin")
    del a, b
    h.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_failed_byte_exact_request_names_its_range(backend, op, nvme_dir, no_leaks):
    # An op starting at an unaligned offset has a head the worker writes itself.
    h = make_handle(backend)
    path = nvme_dir / "f.bin"
    path.write_bytes(bytes(random_bytes(400_000)))
    buf = np.zeros(200_000, np.uint8)
    call = h.sync_pread if op == "read" else h.sync_pwrite
    with faults.inject(fail_nth=1, errno="EIO", op=op):
        with pytest.raises(nvmeio.AioError) as e:
            call(buf, path, file_offset=1000)
    assert e.value.errno == errno.EIO and e.value.offset == 1000 and e.value.length == 4096 - 1000
    assert f"{op} failed: Input/output error" in str(e.value)
    roundtrip_works(h, path)
    h.close()


@pytest.mark.parametrize("memory", ["locked", "unaligned"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_short_transfers_are_finished_byte_exact(backend, memory, op, nvme_dir, no_leaks):
    h = make_handle(backend)
    n = 8 * BLOCK + 777
    data = source(h, memory, n, 5)
    path = nvme_dir / "s.bin"
    if op == "read":
        path.write_bytes(data.tobytes())
        target = source(h, memory, n, 6)
    with faults.inject(short_nth=3, short_bytes=4096 + 100, op=op) as fired:
        if op == "write":
            assert h.sync_pwrite(data, path) == 1
        else:
            assert h.sync_pread(target, path) == 1
    assert fired()["shortened"] == 1
    assert file_bytes(path) == data.tobytes()
    if op == "read":
        assert target.tobytes() == data.tobytes()
    del data
    h.close()


def test_delayed_completions_still_complete(backend, nvme_dir, no_leaks):
    h = make_handle(backend)
    src = random_bytes(6 * BLOCK)
    with faults.inject(delay_us=2000) as fired:
        for i in range(3):
            h.async_pwrite(src, nvme_dir / f"d{i}.bin")
        assert h.wait() == 3
    assert fired()["delayed"] >= 18
    for i in range(3):
        assert file_bytes(nvme_dir / f"d{i}.bin") == src.tobytes()
    h.close()


@pytest.mark.parametrize("single_submit", [False, True])
def test_eagain_is_backed_off_and_retried(backend, single_submit, nvme_dir, no_leaks):
    h = make_handle(backend, single_submit=single_submit)
    src = random_bytes(8 * BLOCK)
    with faults.inject(submit_refusals=5) as fired:
        assert h.sync_pwrite(src, nvme_dir / "e.bin") == 1
    assert fired()["submit_refusals"] == 5
    assert file_bytes(nvme_dir / "e.bin") == src.tobytes()
    if backend != "io_uring":   # io_uring backs off inside its engine (io_uring_enter)
        assert sum(s["backoffs"] for s in h.stats()) >= 5
    h.close()


def test_eagain_forever_fails_the_op_instead_of_hanging(backend, nvme_dir, no_leaks):
    h = make_handle(backend)
    src = random_bytes(4 * BLOCK)
    with faults.inject(submit_refusals=-1):
        h.async_pwrite(src, nvme_dir / "never.bin")
        with pytest.raises(nvmeio.AioError) as e:
            h.wait()
    assert e.value.filename == str(nvme_dir / "never.bin")
    assert "Resource temporarily unavailable" in str(e.value)
    assert not (nvme_dir / "never.bin").exists()
    roundtrip_works(h, nvme_dir / "after.bin")
    h.close()


@pytest.mark.parametrize("memory", ["locked", "unaligned"])
def test_engine_failure_fails_everything_in_flight_and_recovers(backend, memory, nvme_dir,
                                                                 no_leaks):
    h = make_handle(backend, queue_depth=8)
    bufs = [source(h, memory, 16 * BLOCK, i) for i in range(4)]
    with faults.inject(engine_failure_nth=1, engine_failure_errno="EBADF") as fired:
        for i, b in enumerate(bufs):
            h.async_pwrite(b, nvme_dir / f"w{i}.bin")
        with pytest.raises(nvmeio.AioError) as e:
            h.wait()
    assert fired()["engine_failures"] == 1
    assert e.value.errno == errno.EIO
    assert "I/O engine failure: completion wait failed (injected): Bad file descriptor" in str(e.value)
    # The ops the broken engine held (the first one at least) failed and their new
    # files are gone; ops queued after it ran on the new engine; none hangs.
    assert h.wait() == 0
    assert not (nvme_dir / "w0.bin").exists()
    for i, b in enumerate(bufs[1:], 1):
        assert not (nvme_dir / f"w{i}.bin").exists() or file_bytes(nvme_dir / f"w{i}.bin") == b.tobytes()
    # A fresh engine (with the locked memory registered again) serves the next ops.
    for i, b in enumerate(bufs):
        h.async_pwrite(b, nvme_dir / f"w{i}.bin")
    assert h.wait() == 4
    for i, b in enumerate(bufs):
        assert file_bytes(nvme_dir / f"w{i}.bin") == b.tobytes()
    del bufs
    h.close()


def test_every_request_failing_leaks_nothing(backend, nvme_dir, no_leaks):
    h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=8, intra_op_parallelism=2, backend=backend)
    src = random_bytes(3 * BLOCK + 5)
    with faults.inject(fail_nth=1, fail_count=0, errno="EIO") as fired:
        for round_ in range(20):
            for i in range(10):
                h.async_pwrite(src, nvme_dir / f"x{i}.bin", file_offset=round_)
            with pytest.raises(nvmeio.AioError, match="Input/output error"):
                h.wait()
    assert fired()["failed"] >= 200
    assert os.listdir(nvme_dir) == []
    roundtrip_works(h, nvme_dir / "ok.bin")
    h.close()


def test_faults_reach_only_the_matching_direction_and_path(nvme_dir):
    h = nvmeio.aio_handle(block_size=BLOCK)
    src = random_bytes(2 * BLOCK)
    h.sync_pwrite(src, nvme_dir / "keep.bin")
    with faults.inject(fail_nth=1, fail_count=0, op="write", path_contains="opt") as fired:
        h.sync_pwrite(src, nvme_dir / "param.bin")                # other path: untouched
        dst = np.zeros_like(src)
        h.sync_pread(dst, nvme_dir / "keep.bin")                  # a read: untouched
        with pytest.raises(nvmeio.AioError):
            h.sync_pwrite(src, nvme_dir / "opt.bin")
    assert np.array_equal(dst, src) and fired()["failed"] == 2
    h.close()


def test_plan_errors_name_the_field():
    with pytest.raises(ValueError, match="errno 'ENOTANERRNO' is not an errno name"):
        faults.FaultPlan(fail_nth=1, errno="ENOTANERRNO")
    with pytest.raises(ValueError, match="op must be 'read', 'write' or None"):
        faults.FaultPlan(op="append")
    with pytest.raises(ValueError, match="fail_nth must be >= 0"):
        faults.FaultPlan(fail_nth=-1)
    with pytest.raises(ValueError, match="NVMEIO_FAULTS: 'fail_nht=3' is not key=value"):
        faults.plan_from_text("fail_nht=3")
    with faults.inject(fail_nth=1):
        with pytest.raises(RuntimeError, match="already being injected"):
            with faults.inject(fail_nth=2):
                pass


def test_environment_variable_arms_a_plan_and_says_so(tmp_path):
    code = ("import numpy, nvmeio\n"
            "h = nvmeio.aio_handle(backend='psync')\n"
            f"h.sync_pwrite(numpy.ones(10000, numpy.uint8), {str(tmp_path / 'x.bin')!r})\n")
    env = dict(os.environ, NVMEIO_FAULTS="fail_nth=1, errno=ENOSPC, op=write, path_contains=x.bin")
    r = run_process([sys.executable, "-c", code], env=env, timeout=60)
    assert r.returncode == 1
    assert "nvmeio: fault injection is ON (NVMEIO_FAULTS=" in r.stderr
    assert "No space left on device" in r.stderr
    env["NVMEIO_FAULTS"] = "fail_nth=x"  # a plan that does not parse fails the first handle, not the import
    r = run_process([sys.executable, "-c", "import nvmeio; nvmeio.aio_handle()"], env=env, timeout=60)
    assert r.returncode == 1 and "NVMEIO_FAULTS: fail_nth must be an int, got 'x'" in r.stderr


def test_a_submission_error_fails_the_request(backend, nvme_dir, no_leaks):
    # io_submit answering EBADF/EINVAL for the first iocb (aio), a request the
    # queue cannot take (psync), io_uring_enter failing (io_uring: the engine breaks).
    h = make_handle(backend)
    src = random_bytes(4 * BLOCK)
    with faults.inject(submit_refusals=1, submit_errno="EBADF") as fired:
        h.async_pwrite(src, nvme_dir / "bad.bin")
        with pytest.raises(nvmeio.AioError) as e:
            h.wait()
    assert fired()["submit_refusals"] == 1
    assert e.value.filename == str(nvme_dir / "bad.bin") and "Bad file descriptor" in str(e.value)
    assert not (nvme_dir / "bad.bin").exists()
    roundtrip_works(h, nvme_dir / "after.bin")
    h.close()


def test_a_handle_whose_engine_cannot_start_says_why(backend, no_leaks):
    with faults.inject(engine_create_failures=1, engine_failure_errno="EAGAIN"):
        with pytest.raises(RuntimeError, match=f"{backend} engine could not be made \\(injected\\): "
                                               "Resource temporarily unavailable"):
            make_handle(backend)


def test_a_worker_without_an_engine_fails_later_ops_at_once(backend, nvme_dir, no_leaks):
    # The engine breaks and its replacement cannot start: every later op fails
    # at once (no hang), naming both causes; a new handle works again.
    h = make_handle(backend)
    src = random_bytes(4 * BLOCK)
    with faults.inject(engine_failure_nth=1, engine_create_failures=1):
        with pytest.raises(nvmeio.AioError, match="I/O engine failure"):
            h.sync_pwrite(src, nvme_dir / "a.bin")
        for _ in range(3):
            with pytest.raises(nvmeio.AioError, match="a new engine could not be made: .*injected"):
                h.sync_pwrite(src, nvme_dir / "b.bin")
    assert os.listdir(nvme_dir) == []
    h.close()
    h2 = make_handle(backend)
    roundtrip_works(h2, nvme_dir / "c.bin")
    h2.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_byte_exact_request_that_makes_no_progress_is_an_error(backend, op, nvme_dir, no_leaks):
    # pread/pwrite returning 0: the file ended under a read, or a write moved nothing.
    h = make_handle(backend)
    path = nvme_dir / "f.bin"
    path.write_bytes(bytes(random_bytes(100_000)))
    buf = np.zeros(10_000, np.uint8)
    call = h.sync_pread if op == "read" else h.sync_pwrite
    with faults.inject(short_nth=1, short_bytes=0, op=op):
        with pytest.raises(nvmeio.AioError) as e:
            call(buf, path, file_offset=100)
    if op == "read":
        assert isinstance(e.value, nvmeio.ShortReadError)
        assert "short read: the file ended at offset 100" in str(e.value)
    else:
        assert "write (no progress) failed: Input/output error" in str(e.value)
    roundtrip_works(h, path)
    h.close()


def test_eintr_on_a_byte_exact_request_is_retried(backend, nvme_dir, no_leaks):
    h = make_handle(backend)
    src = random_bytes(10_000)
    with faults.inject(fail_nth=1, errno="EINTR") as fired:
        assert h.sync_pwrite(src, nvme_dir / "i.bin", file_offset=100) == 1
    assert fired()["failed"] == 1
    assert file_bytes(nvme_dir / "i.bin")[100:] == src.tobytes()
    h.close()
