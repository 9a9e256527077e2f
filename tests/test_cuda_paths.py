"""CUDA tensors through aio_handle (nvmeio._cuda_staging).

Always run: the errors where CUDA is missing, the chunk plan, and the whole
staging pipeline with a CPU stand-in for the device (tensors that claim to be
on cuda:0, copies run late on a worker thread, as on a CUDA stream), so the
ordering and overlap logic runs here for real. On a machine with a GPU the
last section runs the same round trips on real CUDA tensors.
"""

import ctypes
import errno
import itertools
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvmeio
from helpers import fifo_unblocked_after, file_bytes, random_bytes, special_file
from nvmeio import _cuda_staging as cuda_staging
from nvmeio._buffers import DeviceBuffer
from nvmeio._cuda_staging import FILE_ALIGN, StagingConfig, StagingEngine, plan_chunks
from nvmeio._device_ops import DeviceOpQueue


def needs_gpu(test):
    """Runs only with a CUDA GPU; marked ``cuda``, as every such test is (bench/gpu_check.py runs them)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


# -- the CPU stand-in for a GPU -----------------------------------------------------------------

class ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (a CPU torch cannot make CUDA tensors)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def on_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(ClaimsCuda, t)


class FakeCopier:
    """A CUDA stream stand-in: copies run in order on one worker thread, each
    ``delay`` seconds after it is queued, so a host chunk reused too early
    would be seen in the bytes."""

    def __init__(self, backend):
        self.backend = backend
        self.stream = ThreadPoolExecutor(1)

    def fence(self):
        self.backend.fences += 1
        return "fence"

    def start(self, fence):
        assert fence == "fence"

    def _copy(self, kind, src, dst):
        b = self.backend
        with b.lock:
            b.copies += 1
            index = b.copies
        fail = b.fail_at == index

        def run():
            start = time.monotonic()
            try:
                time.sleep(b.delay)
                if fail:
                    raise RuntimeError("injected copy failure")
                dst.copy_(src)
                b.log.append((kind, start, time.monotonic()))
            finally:
                with b.lock:
                    b.finished += 1

        return self.stream.submit(run)

    def to_host(self, src, dst):
        return self._copy("d2h", src, dst)

    def to_device(self, src, dst):
        return self._copy("h2d", src, dst)

    def wait(self, token):
        token.result()


class FakeBackend:
    def __init__(self, delay=0.0):
        self.delay = delay
        self.lock = threading.Lock()
        self.copies = 0    # queued
        self.finished = 0  # run to their end, failed or not
        self.fail_at = None
        self.fences = 0
        self.log = []
        self.pinned = []
        self.unpinned = []

    def copier(self, device):
        assert device.type == "cuda"
        return FakeCopier(self)

    def pin_host(self, ptr, nbytes):
        self.pinned.append((ptr, nbytes))
        return None

    def unpin_host(self, ptr):
        self.unpinned.append(ptr)


class RecordingNative:
    """A native handle that logs each file op (and can take its time): ``log``
    gets (kind, submitted, waited) per op, ``events`` ("submit" | "waited",
    file offset) in the order they happen, across the engine's lanes."""

    def __init__(self, native, log, delay=0.0, events=None):
        self.native, self.log, self.delay = native, log, delay
        self.events = events if events is not None else []

    def _submitted(self, write, offset):
        self.current = ("write" if write else "read", time.monotonic(), offset)
        self.events.append(("submit", offset))

    def submit(self, write, ptr, nbytes, path, offset):
        self._submitted(write, offset)
        self.native.submit(write, ptr, nbytes, path, offset)

    def submit_fd(self, write, ptr, nbytes, fd, offset):
        self._submitted(write, offset)
        self.native.submit_fd(write, ptr, nbytes, fd, offset)

    def wait(self):
        n = self.native.wait()
        time.sleep(self.delay)
        self.log.append((self.current[0], self.current[1], time.monotonic()))
        self.events.append(("waited", self.current[2]))
        return n

    def refused_direct(self):
        return self.native.refused_direct()


class LaggingNative:
    """A native handle whose file op runs on a thread of its own, ``lag()``
    seconds after it is submitted, and is known done only at ``wait()``: a
    host chunk reused, or a copy started, before the op was waited for would
    show in the bytes. An op at a file offset in ``fail_at`` fails (EIO)."""

    def __init__(self, lag, fail_at=()):
        self.lag, self.fail_at = lag, set(fail_at)
        self.thread, self.error = None, None

    def submit(self, write, ptr, nbytes, path, offset):
        self._start(write, ptr, nbytes, offset, lambda: os.open(path, os.O_RDWR if write else os.O_RDONLY))

    def submit_fd(self, write, ptr, nbytes, fd, offset):
        self._start(write, ptr, nbytes, offset, lambda: os.dup(fd))

    def _start(self, write, ptr, nbytes, offset, open_fd):
        assert self.thread is None, "a lane got a second op before its first was waited for"
        delay = self.lag()

        def run():
            time.sleep(delay)
            try:
                if offset in self.fail_at:
                    raise OSError(errno.EIO, f"injected failure at offset {offset}")
                fd = open_fd()
                try:
                    if write:
                        assert os.pwrite(fd, ctypes.string_at(ptr, nbytes), offset) == nbytes
                    else:
                        data = os.pread(fd, nbytes, offset)
                        assert len(data) == nbytes
                        ctypes.memmove(ptr, data, nbytes)
                finally:
                    os.close(fd)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), as the native core does
                self.error = e

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def busy(self):
        return self.thread is not None

    def wait(self):
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error
        return 0 if thread is None else 1

    def refused_direct(self):
        return False


def device_buffer(t: torch.Tensor) -> DeviceBuffer:
    flat = t.reshape(-1).view(torch.uint8)
    return DeviceBuffer(flat, flat.numel(), torch.device("cuda", 0), t)


def engine(chunk_bytes=8192, num_chunks=2, delay=0.0, file_delay=0.0, log=None, events=None,
           new_native=None, lanes=2):
    backend = FakeBackend(delay)

    def psync_native():
        # psync: many engines come and go here, and kernel AIO contexts are a
        # system-wide resource; the pipeline is the same on every backend.
        native = nvmeio.aio_handle(intra_op_parallelism=2, backend="psync")._new_native()
        if log is not None or events is not None:
            native = RecordingNative(native, log if log is not None else [], file_delay, events)
        return native

    return StagingEngine(new_native or psync_native, StagingConfig(chunk_bytes, num_chunks, lanes),
                         backend), backend


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' to nvmeio, with FakeBackend as its device side and
    small staging chunks, so that every op crosses several chunks."""
    backend = FakeBackend(delay=0.001)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_staging, "CudaBackend", lambda: backend)
    monkeypatch.setenv("NVMEIO_STAGING_CHUNK_BYTES", "8192")
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "2")
    return backend


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def fake_cuda_bytes(n, seed=0):
    return on_fake_cuda(torch.from_numpy(random_bytes(n, seed)))


# -- no CUDA: clear errors before any I/O ----------------------------------------------------------

ALL_OPS = [
    ("async_pwrite", lambda h, t, p: h.async_pwrite(t, p)),
    ("async_pread", lambda h, t, p: h.async_pread(t, p)),
    ("sync_pwrite", lambda h, t, p: h.sync_pwrite(t, p)),
    ("sync_pread", lambda h, t, p: h.sync_pread(t, p)),
    ("pwrite", lambda h, t, p: h.pwrite(t, p, False, True)),
    ("pread", lambda h, t, p: h.pread(t, p, False, False)),
    ("write", lambda h, t, p: h.write(t, p)),
    ("read", lambda h, t, p: h.read(t, p)),
]


@pytest.mark.parametrize("name,op", ALL_OPS, ids=[n for n, _ in ALL_OPS])
def test_cuda_tensor_with_a_cpu_only_torch_names_what_is_missing(monkeypatch, nvme_dir, name, op):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h = nvmeio.aio_handle()
    path = nvme_dir / "x.bin"
    if name in ("async_pread", "sync_pread", "pread", "read"):
        path.write_bytes(b"\1" * 64)
    with pytest.raises(ValueError) as e:
        op(h, on_fake_cuda(torch.zeros(16, dtype=torch.float32)), path)
    msg = str(e.value)
    assert "tensor is on cuda:0, but CUDA is not available" in msg
    assert "built without CUDA" in msg and "pip install torch --index-url" in msg
    assert h.wait() == 0
    if name in ("async_pread", "sync_pread", "pread", "read"):
        assert path.read_bytes() == b"\1" * 64  # the file read is untouched
    else:
        assert not path.exists()  # a refused write creates nothing


def test_cuda_tensor_with_cuda_torch_but_no_gpu_names_the_driver(monkeypatch, nvme_dir):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h = nvmeio.aio_handle()
    with pytest.raises(ValueError, match="no NVIDIA GPU or driver is visible") as e:
        h.async_pwrite(on_fake_cuda(torch.zeros(4)), nvme_dir / "x.bin")
    assert "CUDA 12.8" in str(e.value) and "nvidia-smi" in str(e.value)
    assert not (nvme_dir / "x.bin").exists()


def test_cpu_tensors_never_ask_about_cuda(monkeypatch, nvme_dir):
    def boom():
        raise AssertionError("a CPU op must not query CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    h = nvmeio.aio_handle()
    t = torch.arange(1000, dtype=torch.int32)
    assert h.sync_pwrite(t, nvme_dir / "c.bin") == 1
    assert file_bytes(nvme_dir / "c.bin") == t.numpy().tobytes()


# -- the chunk plan (pure arithmetic) --------------------------------------------------------------

def test_plan_of_an_aligned_op_is_whole_chunks_and_a_tail():
    chunks = plan_chunks(3 * 8192 + 100, 4096, 8192)
    assert [(c.buffer_offset, c.file_offset, c.nbytes, c.host_offset) for c in chunks] == [
        (0, 4096, 8192, 0), (8192, 12288, 8192, 0), (16384, 20480, 8192, 0),
        (24576, 28672, 100, 0)]


def test_plan_of_an_unaligned_offset_shortens_the_first_chunk_to_the_next_boundary():
    chunks = plan_chunks(20000, 5000, 8192)
    # 5000 % 4096 = 904: the first chunk sits at host offset 904 and ends at
    # file offset 12288, so every later chunk starts 4096-aligned.
    assert [(c.buffer_offset, c.file_offset, c.nbytes, c.host_offset) for c in chunks] == [
        (0, 5000, 7288, 904), (7288, 12288, 8192, 0), (15480, 20480, 4520, 0)]


def test_plan_of_an_empty_op_has_no_chunks():
    assert plan_chunks(0, 12345, 8192) == []


@pytest.mark.parametrize("chunk", [0, 4095, 4097, -4096])
def test_plan_refuses_chunk_sizes_that_are_not_multiples_of_4096(chunk):
    with pytest.raises(ValueError, match="multiple of 4096"):
        plan_chunks(10, 0, chunk)


@given(n=st.integers(0, 1 << 22), offset=st.integers(0, 1 << 24),
       chunk=st.integers(1, 64).map(lambda k: k * FILE_ALIGN))
def test_plan_covers_the_op_exactly_with_aligned_chunks(n, offset, chunk):
    chunks = plan_chunks(n, offset, chunk)
    assert sum(c.nbytes for c in chunks) == n
    expected = 0 if n == 0 else -(-(n + offset % FILE_ALIGN) // chunk)
    assert len(chunks) == expected
    at = 0
    for i, c in enumerate(chunks):
        assert c.index == i and c.buffer_offset == at and c.file_offset == offset + at
        assert c.nbytes > 0 and c.host_offset + c.nbytes <= chunk
        assert c.host_offset == c.file_offset % FILE_ALIGN
        if i > 0:
            assert c.file_offset % FILE_ALIGN == 0 and c.host_offset == 0
        if i < len(chunks) - 1:
            assert (c.file_offset + c.nbytes) % FILE_ALIGN == 0
            assert c.host_offset + c.nbytes == chunk  # every chunk but the last is full
        at += c.nbytes


def test_staging_config_defaults_and_environment(monkeypatch):
    monkeypatch.delenv("NVMEIO_STAGING_CHUNK_BYTES", raising=False)
    monkeypatch.delenv("NVMEIO_STAGING_CHUNKS", raising=False)
    monkeypatch.delenv("NVMEIO_STAGING_LANES", raising=False)
    assert StagingConfig.from_env(1 << 20, 1) == StagingConfig(32 << 20, 3, 2)
    # A chunk gives every worker thread at least one full block.
    assert StagingConfig.from_env(8 << 20, 8).chunk_bytes == 64 << 20
    assert StagingConfig.from_env(10_000, 4000).chunk_bytes == 12288 * 4000
    monkeypatch.setenv("NVMEIO_STAGING_CHUNK_BYTES", "10000")
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "4")
    assert StagingConfig.from_env(8 << 20, 8) == StagingConfig(12288, 4)
    monkeypatch.setenv("NVMEIO_STAGING_LANES", "4")
    assert StagingConfig.from_env(8 << 20, 8) == StagingConfig(12288, 4, 4)
    monkeypatch.setenv("NVMEIO_STAGING_LANES", "5")
    with pytest.raises(ValueError, match=r"NVMEIO_STAGING_LANES=5 must be at most NVMEIO_STAGING_CHUNKS \(4\)"):
        StagingConfig.from_env(8 << 20, 8)
    with pytest.raises(ValueError, match="lanes must be between 1 and num_chunks"):
        StagingConfig(4096, 2, 0)
    monkeypatch.delenv("NVMEIO_STAGING_LANES")
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "1")
    with pytest.raises(ValueError, match="NVMEIO_STAGING_CHUNKS=1 must be at least 2"):
        StagingConfig.from_env(1 << 20, 1)
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "many")
    with pytest.raises(ValueError, match="not an integer"):
        StagingConfig.from_env(1 << 20, 1)


# -- the pipeline, with the CPU stand-in device ----------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.one_of(st.integers(0, 9000), st.integers(9000, 200_000)),
       offset=st.one_of(st.just(0), st.integers(0, 40_000)),
       chunk=st.sampled_from([4096, 8192, 12288, 65536]), count=st.integers(2, 4),
       dtype=st.sampled_from([torch.uint8, torch.float32, torch.bfloat16, torch.int64]),
       background=st.integers(0, 300_000), seed=st.integers(0, 2**31))
def test_round_trip_matches_the_cpu_path_byte_for_byte(nvme_dir, n, offset, chunk, count, dtype,
                                                       background, seed):
    size = torch.tensor([], dtype=dtype).element_size()
    n -= n % size
    eng, backend = engine(chunk, count, delay=0.0005)
    src = torch.from_numpy(random_bytes(n, seed)).view(dtype) if n else torch.empty(0, dtype=dtype)
    old = random_bytes(background, seed + 1).tobytes()
    staged, direct = nvme_dir / f"s_{uuid.uuid4().hex}", nvme_dir / f"d_{uuid.uuid4().hex}"
    for p in (staged, direct):
        if background:
            p.write_bytes(old)

    eng.submit(True, device_buffer(src), str(staged), offset)
    assert eng.drain() == (1, None)
    h = nvmeio.aio_handle(backend="psync")
    assert h.sync_pwrite(src, direct, file_offset=offset) == 1
    assert file_bytes(staged) == file_bytes(direct)

    dst = torch.full((n,), 7, dtype=torch.uint8).view(dtype) if n else torch.empty(0, dtype=dtype)
    eng.submit(False, device_buffer(dst), str(staged), offset)
    assert eng.drain() == (1, None)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    assert backend.copies == 2 * len(plan_chunks(n, offset, chunk))
    eng.close()


def intervals(log, kind):
    return [(start, end) for k, start, end in log if k == kind]


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def test_write_copies_the_next_chunk_while_this_one_goes_to_the_file(nvme_dir):
    log = []
    # Chunk 0's write must start within one copy's delay of its copy ending (the copier runs on):
    # 50 ms, which a loaded machine's scheduler leaves to spare where 20 ms may not be.
    eng, backend = engine(8192, 2, delay=0.05, file_delay=0.15, log=log)
    src = torch.from_numpy(random_bytes(4 * 8192))
    eng.submit(True, device_buffer(src), str(nvme_dir / "w.bin"), 0)
    assert eng.drain() == (1, None)
    copies, writes = intervals(backend.log, "d2h"), intervals(log, "write")
    assert len(copies) == len(writes) == 4
    for i in range(3):
        assert copies[i][1] <= writes[i][0]       # chunk i is on the host before it is written
        assert overlaps(copies[i + 1], writes[i])  # ... while chunk i + 1 is being copied
    assert file_bytes(nvme_dir / "w.bin") == src.numpy().tobytes()


def test_read_reads_the_next_chunk_while_this_one_is_copied_to_the_device(nvme_dir):
    src = random_bytes(4 * 8192)
    (nvme_dir / "r.bin").write_bytes(src.tobytes())
    log = []
    # Chunk 2's copy must start within one file op's delay of being queued (the last read waits out
    # that delay meanwhile): 50 ms, which a loaded machine's scheduler leaves to spare where 20 ms may not be.
    eng, backend = engine(8192, 2, delay=0.15, file_delay=0.05, log=log)
    dst = torch.zeros(4 * 8192, dtype=torch.uint8)
    eng.submit(False, device_buffer(dst), str(nvme_dir / "r.bin"), 0)
    assert eng.drain() == (1, None)
    copies, reads = intervals(backend.log, "h2d"), intervals(log, "read")
    assert len(copies) == len(reads) == 4
    for i in range(3):
        assert reads[i][1] <= copies[i][0]       # chunk i is on the host before it is copied
        assert overlaps(reads[i + 1], copies[i])  # ... while chunk i + 1 is being read
    assert dst.numpy().tobytes() == src.tobytes()


def test_slow_copies_never_see_a_host_chunk_reused_too_early(nvme_dir):
    # Copies lag far behind the file: a host chunk reused before its copy
    # ran would put the wrong bytes in the file or the tensor.
    eng, _ = engine(4096, 2, delay=0.01)
    src = torch.from_numpy(random_bytes(10 * 4096 + 123, 5))
    eng.submit(True, device_buffer(src), str(nvme_dir / "s.bin"), 777)
    assert eng.drain() == (1, None)
    dst = torch.zeros_like(src)
    eng.submit(False, device_buffer(dst), str(nvme_dir / "s.bin"), 777)
    assert eng.drain() == (1, None)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
def test_the_next_chunk_goes_to_the_file_before_this_one_is_waited_for(nvme_dir, write, lanes):
    """The disk's queue does not drain at chunk boundaries: chunk i + 1's file op
    is submitted before chunk i's is waited for, and from the first submission
    to the last wait a file op is always in flight (as many as there are lanes)."""
    n = 6 * 8192 + 100
    path = nvme_dir / "lanes.bin"
    src = random_bytes(n, 3)
    if not write:
        path.write_bytes(src.tobytes())
    events = []
    eng, _ = engine(8192, 3, delay=0.001, file_delay=0.002, events=events, lanes=lanes)
    buf = torch.from_numpy(src.copy()) if write else torch.zeros(n, dtype=torch.uint8)
    eng.submit(write, device_buffer(buf), str(path), 0)
    assert eng.drain() == (1, None)
    offsets = [c.file_offset for c in plan_chunks(n, 0, 8192)]
    assert [o for kind, o in events if kind == "submit"] == offsets
    assert [o for kind, o in events if kind == "waited"] == offsets  # in chunk order
    for this, after in zip(offsets, offsets[1:]):
        assert events.index(("submit", after)) < events.index(("waited", this))
    in_flight = list(itertools.accumulate(1 if kind == "submit" else -1 for kind, _ in events))
    assert max(in_flight) == lanes and 0 not in in_flight[:-1]
    assert file_bytes(path) == src.tobytes() and buf.numpy().tobytes() == src.tobytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 100_000), offset=st.one_of(st.just(0), st.integers(0, 20_000)),
       chunk=st.sampled_from([4096, 8192, 12288]), count=st.integers(2, 4), use_fd=st.booleans(),
       seed=st.integers(0, 2**31))
def test_bytes_are_exact_when_file_ops_lag_and_finish_out_of_order(nvme_dir, n, offset, chunk, count,
                                                                   use_fd, seed):
    rng = random.Random(seed)
    eng, backend = engine(chunk, count, delay=0.0005,
                          new_native=lambda: LaggingNative(lambda: rng.uniform(0, 0.004)))
    src = torch.from_numpy(random_bytes(n, seed))
    path = nvme_dir / f"lag_{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if use_fd else None
    try:
        eng.submit(True, device_buffer(src), fd if use_fd else str(path), offset)
        assert eng.drain() == (1, None)
        assert file_bytes(path) == bytes(offset) + src.numpy().tobytes()
        dst = torch.full((n,), 7, dtype=torch.uint8)
        eng.submit(False, device_buffer(dst), fd if use_fd else str(path), offset)
        assert eng.drain() == (1, None)
    finally:
        if use_fd:
            os.close(fd)
    assert torch.equal(dst, src)
    assert backend.copies == backend.finished == 2 * len(plan_chunks(n, offset, chunk))
    eng.close()


@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
@pytest.mark.parametrize("failing", [[0], [1], [2], [1, 2], [4]], ids=str)
def test_a_failing_chunk_in_either_lane_raises_the_first_error_and_leaves_nothing_running(
        nvme_dir, write, failing):
    # Lane 0 is fast and lane 1 slow, so chunk 2 (lane 0) fails before chunk 1 (lane 1) does.
    n = 5 * 8192
    offsets = [c.file_offset for c in plan_chunks(n, 0, 8192)]
    natives = []

    def new_native():
        lag = 0.001 if not natives else 0.02
        natives.append(LaggingNative(lambda: lag, {offsets[i] for i in failing}))
        return natives[-1]

    eng, backend = engine(8192, 3, delay=0.003, new_native=new_native)
    path = nvme_dir / "fail.bin"
    src = torch.from_numpy(random_bytes(n, 11))
    if not write:
        path.write_bytes(src.numpy().tobytes())
    buf = src.clone() if write else torch.zeros(n, dtype=torch.uint8)
    eng.submit(write, device_buffer(buf), str(path), 0)
    count, error = eng.drain()
    assert count == 1 and isinstance(error, OSError) and error.errno == errno.EIO
    assert str(error) == f"[Errno {errno.EIO}] injected failure at offset {offsets[failing[0]]}"
    # Nothing still runs into or out of the host chunks that the next op reuses.
    assert not any(native.busy() for native in natives)
    assert backend.finished == backend.copies
    assert path.exists() is not write  # a new file whose write failed is removed

    for native in natives:
        native.fail_at = set()
    eng.submit(True, device_buffer(src), str(path), 0)
    assert eng.drain() == (1, None)
    back = torch.zeros(n, dtype=torch.uint8)
    eng.submit(False, device_buffer(back), str(path), 0)
    assert eng.drain() == (1, None)
    assert file_bytes(path) == src.numpy().tobytes() and torch.equal(back, src)
    eng.close()


def test_host_chunks_are_pinned_once_and_unpinned_with_the_engine(nvme_dir):
    eng, backend = engine(8192, 3)
    for i in range(3):
        eng.submit(True, device_buffer(torch.from_numpy(random_bytes(30_000, i))),
                   str(nvme_dir / f"p{i}.bin"), 0)
    assert eng.drain() == (3, None)
    assert [n for _, n in backend.pinned] == [8192] * 3
    assert all(ptr % 4096 == 0 for ptr, _ in backend.pinned)
    pinned = [ptr for ptr, _ in backend.pinned]
    del eng
    import gc
    gc.collect()
    assert sorted(backend.unpinned) == sorted(pinned)


# -- through aio_handle ---------------------------------------------------------------------------

def test_every_method_moves_cuda_tensors(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=3)
    src = fake_cuda_bytes(50_001, 1)
    assert h.async_pwrite(src, nvme_dir / "a.bin") == 0
    assert h.wait() == 1
    assert file_bytes(nvme_dir / "a.bin") == src.numpy().tobytes()
    dst = on_fake_cuda(torch.zeros(50_001, dtype=torch.uint8))
    assert h.sync_pread(dst, nvme_dir / "a.bin") == 1
    assert torch.equal(plain(dst), plain(src))

    assert h.pwrite(src, nvme_dir / "b.bin", True, False, 4096 + 3) == 1   # validate, sync
    assert h.pread(dst, nvme_dir / "b.bin", True, True, 4096 + 3) == 0      # validate, async
    assert h.wait() == 1
    assert h.write(src, nvme_dir / "c.bin") == 0
    assert h.read(dst, nvme_dir / "c.bin") == 0
    assert file_bytes(nvme_dir / "c.bin") == src.numpy().tobytes()
    assert fake_cuda.fences == 6


def test_cuda_and_cpu_ops_complete_in_one_wait(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    dev = [fake_cuda_bytes(20_000 + i, i) for i in range(3)]
    cpu = [random_bytes(30_000 + i, 10 + i) for i in range(3)]
    for i in range(3):
        h.async_pwrite(dev[i], nvme_dir / f"d{i}.bin")
        h.async_pwrite(cpu[i], nvme_dir / f"c{i}.bin")
    assert h.sync_pwrite(fake_cuda_bytes(100), nvme_dir / "last.bin") == 7
    for i in range(3):
        assert file_bytes(nvme_dir / f"d{i}.bin") == dev[i].numpy().tobytes()
        assert file_bytes(nvme_dir / f"c{i}.bin") == cpu[i].tobytes()
    assert h.wait() == 0


def test_ops_on_cuda_tensors_run_in_submission_order(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    path = nvme_dir / "order.bin"
    path.write_bytes(bytes(40_000))  # the read checks the file's size when it is submitted
    first, second = fake_cuda_bytes(40_000, 1), fake_cuda_bytes(40_000, 2)
    back = on_fake_cuda(torch.zeros(40_000, dtype=torch.uint8))
    h.async_pwrite(first, path)
    h.async_pwrite(second, path)
    h.async_pread(back, path)
    assert h.wait() == 3
    assert torch.equal(plain(back), plain(second))


def test_open_fd_as_target(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    src = fake_cuda_bytes(30_000, 3)
    fd = os.open(nvme_dir / "fd.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        h.async_pwrite(src, fd, file_offset=100)
        assert h.wait() == 1
        dst = on_fake_cuda(torch.zeros(30_000, dtype=torch.uint8))
        h.sync_pread(dst, fd, file_offset=100)
    finally:
        os.close(fd)
    assert file_bytes(nvme_dir / "fd.bin")[100:] == src.numpy().tobytes()
    assert torch.equal(plain(dst), plain(src))
    with pytest.raises(ValueError, match="validate=True needs a path"):
        h.pwrite(src, 0, True)


def test_empty_cuda_tensor_behaves_like_an_empty_cpu_op(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    empty = on_fake_cuda(torch.from_numpy(np.empty(0, np.float32)))  # strides (0,)
    assert h.sync_pwrite(empty, nvme_dir / "e.bin", file_offset=5000) == 1
    assert h.sync_pwrite(np.empty(0, np.uint8), nvme_dir / "c.bin", file_offset=5000) == 1
    # An empty write creates the file but never extends it (as pwrite(2) of 0 bytes).
    assert file_bytes(nvme_dir / "e.bin") == file_bytes(nvme_dir / "c.bin") == b""
    assert h.sync_pread(empty, nvme_dir / "e.bin", file_offset=5000) == 1


def test_missing_file_and_short_file_raise_at_submit_and_are_not_counted(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    dst = on_fake_cuda(torch.zeros(10_000, dtype=torch.uint8))
    with pytest.raises(FileNotFoundError) as e:
        h.async_pread(dst, nvme_dir / "missing.bin")
    assert isinstance(e.value, nvmeio.AioError) and e.value.length == 10_000
    (nvme_dir / "short.bin").write_bytes(b"x" * 9_999)
    with pytest.raises(nvmeio.ShortReadError, match="holds 9999 bytes") as e:
        h.async_pread(dst, nvme_dir / "short.bin")
    assert e.value.errno == errno.ENODATA and e.value.offset == 0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        h.async_pwrite(dst, nvme_dir / "no" / "dir.bin")
    with pytest.raises(IsADirectoryError):
        h.async_pwrite(dst, nvme_dir)
    assert plain(dst).sum().item() == 0
    assert h.wait() == 0


@pytest.mark.parametrize("op", ["async_pread", "async_pwrite"])
def test_a_fifo_is_refused_at_submit_as_on_the_cpu_path(fake_cuda, nvme_dir, op):
    h = nvmeio.aio_handle()
    fifo = special_file(nvme_dir / "fifo", "fifo")
    errors = []
    for buf in (on_fake_cuda(torch.zeros(100, dtype=torch.uint8)), np.zeros(100, np.uint8)):
        with fifo_unblocked_after(fifo), pytest.raises(nvmeio.AioError) as e:
            getattr(h, op)(buf, fifo)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and f"[Errno {errno.ESPIPE}] open for " in errors[0]
    assert "a FIFO (named pipe) has no file offsets" in errors[0]
    assert h.wait() == 0


def test_failure_inside_an_op_is_raised_by_wait_and_undone(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    fake_cuda.fail_at = 3  # the third chunk copy of the first op fails
    h.async_pwrite(fake_cuda_bytes(8192 * 5), nvme_dir / "new.bin")
    good = fake_cuda_bytes(20_000, 9)
    h.async_pwrite(good, nvme_dir / "good.bin")
    with pytest.raises(RuntimeError, match="injected copy failure"):
        h.wait()
    assert not (nvme_dir / "new.bin").exists()   # a new file that failed is removed
    assert file_bytes(nvme_dir / "good.bin") == good.numpy().tobytes()
    assert h.wait() == 0

    old = random_bytes(5000).tobytes()
    (nvme_dir / "grow.bin").write_bytes(old)
    fake_cuda.fail_at = fake_cuda.copies + 3
    h.async_pwrite(fake_cuda_bytes(8192 * 5), nvme_dir / "grow.bin", file_offset=4096)
    with pytest.raises(RuntimeError, match="injected"):
        h.wait()
    assert len(file_bytes(nvme_dir / "grow.bin")) == 5000  # an existing file keeps its size
    assert h.sync_pwrite(good, nvme_dir / "after.bin") == 1  # the handle still works


def test_validation_failure_names_the_first_differing_byte(fake_cuda, nvme_dir, monkeypatch):
    h = nvmeio.aio_handle()
    src = fake_cuda_bytes(30_000, 4)
    path = nvme_dir / "v.bin"
    h.sync_pwrite(src, path)
    expected = src.numpy().tobytes()
    original_compare = cuda_staging.compare_with_file

    def compare_after_corruption(p, offset, nbytes, fetch, piece):
        with open(p, "r+b") as f:
            f.seek(offset + 20_000)
            f.write(bytes([expected[20_000] ^ 0xFF]))
        original_compare(p, offset, nbytes, fetch, piece)

    monkeypatch.setattr(cuda_staging, "compare_with_file", compare_after_corruption)
    with pytest.raises(nvmeio.ValidationError, match="differ at byte 20000") as e:
        h.pwrite(src, path, validate=True)
    assert e.value.filename == str(path) and e.value.length == 30_000
    assert path.exists()  # a write whose check fails is kept, as on the CPU path


def test_ops_pending_when_the_handle_is_dropped_still_complete(fake_cuda, nvme_dir):
    h = nvmeio.aio_handle()
    src = fake_cuda_bytes(100_000, 6)
    h.async_pwrite(src, nvme_dir / "drop.bin")
    engine_ops = h._device_ops
    del h
    assert engine_ops.drain() == (1, None)
    assert file_bytes(nvme_dir / "drop.bin") == src.numpy().tobytes()


def test_device_op_queue_counts_orders_and_reports_the_first_error():
    q = DeviceOpQueue()
    seen = []
    for i in range(5):
        def job(i=i):
            seen.append(i)
            if i in (2, 4):
                raise OSError(errno.EIO, f"job {i}")
        q.submit(job)
    n, error = q.drain()
    assert n == 5 and seen == [0, 1, 2, 3, 4] and str(error) == "[Errno 5] job 2"
    assert q.drain() == (0, None)
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(lambda: None)


# -- on a GPU ------------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
@pytest.mark.parametrize("numel,offset", [(1, 0), (1023, 4096 + 7), (3 * (1 << 20) + 5, 0),
                                          ((9 << 20) + 3, 123_457)])
def test_gpu_round_trip_odd_sizes_matches_the_cpu_path(nvme_dir, monkeypatch, dtype, numel, offset):
    monkeypatch.setenv("NVMEIO_STAGING_CHUNK_BYTES", str(4 << 20))
    h = nvmeio.aio_handle(intra_op_parallelism=4)
    src = torch.randint(0, 255, (numel,), dtype=torch.uint8, device="cuda")
    src = src.to(dtype) if dtype != torch.bfloat16 else src.float().to(dtype)
    assert h.sync_pwrite(src, nvme_dir / "g.bin", file_offset=offset) == 1
    assert h.sync_pwrite(src.cpu(), nvme_dir / "c.bin", file_offset=offset) == 1
    assert file_bytes(nvme_dir / "g.bin") == file_bytes(nvme_dir / "c.bin")
    dst = torch.empty_like(src)
    assert h.sync_pread(dst, nvme_dir / "g.bin", file_offset=offset) == 1
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@needs_gpu
def test_gpu_async_ops_overlap_with_compute_and_see_the_producing_kernels(nvme_dir):
    h = nvmeio.aio_handle(intra_op_parallelism=4)
    x = torch.randn(16 << 20, device="cuda")
    y = x * 3 + 1                     # queued on the current stream, not synchronized
    h.async_pwrite(y, nvme_dir / "y.bin")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):               # GPU work while the write runs
        a = torch.tanh(a @ a)
    assert h.wait() == 1
    assert file_bytes(nvme_dir / "y.bin") == y.cpu().numpy().tobytes()
    back = torch.empty_like(y)
    h.async_pread(back, nvme_dir / "y.bin")
    b = a @ a
    assert h.wait() == 1
    torch.cuda.synchronize()
    assert torch.equal(back, y) and torch.isfinite(b).all()


@needs_gpu
def test_gpu_staging_chunks_are_pinned_for_dma(nvme_dir):
    h = nvmeio.aio_handle()
    h.sync_pwrite(torch.ones(1000, device="cuda"), nvme_dir / "p.bin")
    chunks = h._device_ops._chunks.tensors
    assert len(chunks) == 3 and all(t.is_pinned() for t in chunks)


@needs_gpu
def test_gpu_one_gib_transfer_runs_near_host_memory_speed(nvme_dir):
    h = nvmeio.aio_handle(queue_depth=32, overlap_events=True, intra_op_parallelism=8)
    n = 1 << 30
    host = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    host.copy_(dev.cpu())
    h.sync_pwrite(host, nvme_dir / "h.bin")       # warm the file system
    t0 = time.perf_counter()
    h.sync_pwrite(host, nvme_dir / "h.bin")
    t_host = time.perf_counter() - t0
    t0 = time.perf_counter()
    h.sync_pwrite(dev, nvme_dir / "d.bin")
    t_dev = time.perf_counter() - t0
    print(f"1 GiB write: host {n / t_host / 2**30:.2f} GiB/s, cuda {n / t_dev / 2**30:.2f} GiB/s")
    assert t_dev < 2 * t_host


@needs_gpu
def test_gpu_write_waits_for_the_current_side_stream(nvme_dir):
    h = nvmeio.aio_handle()
    side = torch.cuda.Stream()
    x = torch.randn(8 << 20, device="cuda")
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(side):
        y = torch.cumsum(x, 0)       # queued on the side stream, the current one here
        h.async_pwrite(y, nvme_dir / "side.bin")
    assert h.wait() == 1
    side.synchronize()
    assert file_bytes(nvme_dir / "side.bin") == y.cpu().numpy().tobytes()
