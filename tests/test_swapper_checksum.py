"""Checksums: a swap file changed or truncated behind our back is an error naming the file."""
import importlib.util
import os

import pytest
import torch

from swapper import (
    AsyncTensorSwapper,
    PartitionedOptimizerSwapper,
    PartitionedParamSwapper,
    PinnedBufferPool,
    PipelinedOptimizerSwapper,
    SwapCorruptionError,
    SwapFileTruncatedError,
)
from swapper.checksum import ChecksumTable
from swapper._param_swapper import PartitionState, swap_file_name
from swapper._sub_group import SubGroupState
from swapper._swap_dir import SwapDirectory


def _algorithm(name, package=None):
    missing = package is not None and importlib.util.find_spec(package) is None
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"pip install {package}"))


# crc32 (zlib) always runs; the faster two need their packages (pyproject's test extra has them).
ALGORITHMS = [_algorithm("xxhash", "xxhash"), _algorithm("crc32c", "crc32c"), _algorithm("crc32")]


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_table_verifies_recorded_regions_inside_a_read(algorithm):
    table = ChecksumTable(algorithm)
    data = torch.arange(1000, dtype=torch.float32)
    table.record("f", 4096, data)
    table.verify("f", 0, torch.cat([torch.zeros(1024), data]))  # covers the region
    table.verify("f", 4096, data[:10])  # does not cover it: nothing to check
    bad = data.clone()
    bad[999] += 1
    with pytest.raises(SwapCorruptionError, match=r"swap file f changed .* bytes \[4096, 8096\)"):
        table.verify("f", 4096, bad)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_digest_taken_in_pieces_equals_the_one_taken_at_once(algorithm):
    from swapper.checksum import ChecksumAlgorithm, digest_chunks

    table = ChecksumTable(algorithm)
    data = torch.randn(100_003)
    raw = memoryview(data.numpy()).cast("B")
    pieces = [raw[:1], raw[1:4097], raw[4097:300_000], raw[300_000:]]
    assert digest_chunks(ChecksumAlgorithm(algorithm), pieces) == table.digest(data)
    assert digest_chunks(ChecksumAlgorithm(algorithm), []) == table.digest(torch.empty(0))


def test_digests_recorded_later_on_a_helper_thread_equal_those_taken_at_once():
    table, now = ChecksumTable("crc32"), ChecksumTable("crc32")
    regions = [(4096, torch.randn(5000)), (4096 + 20480, torch.randn(3))]
    pending = table.record_later("f", regions)
    for offset, t in regions:
        now.record("f", offset, t)
    pending.wait()
    for offset, t in regions:
        assert table.recorded("f", offset, t.numel() * 4) == now.recorded("f", offset, t.numel() * 4)
    table.verify("f", 4096, torch.cat([regions[0][1], torch.zeros(120), regions[1][1]]))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_helper_threads_hash_at_idle_priority_and_the_caller_keeps_its_own():
    """A helper runs only on a core nothing else wants (swapper/checksum.py's note): the matrix products'
    threads are never made to wait for a core it holds."""
    seen = []

    class Watched(ChecksumTable):
        def digest(self, data):
            seen.append(os.sched_getscheduler(0))
            return super().digest(data)

    table = Watched("crc32")
    table.record_later("f", [(0, torch.randn(1000)), (4096, torch.randn(10))]).wait()
    assert seen == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.parametrize("damaged", [0, 1, 2])
def test_a_read_of_several_large_regions_is_verified_in_parallel_and_any_damage_found(damaged):
    table = ChecksumTable("crc32")
    n = 1 << 20  # three 4 MiB regions: above PARALLEL_MIN_BYTES together
    data = torch.randn(3 * n)
    for k in range(3):
        table.record("f", k * n * 4, data[k * n:(k + 1) * n])
    table.verify("f", 0, data)
    bad = data.clone()
    bad[damaged * n + 7] += 1
    start = damaged * n * 4
    with pytest.raises(SwapCorruptionError, match=rf"bytes \[{start}, {start + n * 4}\)"):
        table.verify("f", 0, bad)


@pytest.mark.parametrize("drives", [1, 2], ids=["one drive", "striped over two"])
@pytest.mark.parametrize("damaged", [None, 0, 3])
def test_a_landed_batch_of_reads_is_hashed_together_each_region_once(tmp_path, monkeypatch, damaged, drives):
    """A batch of reads is hashed as it lands, the waiting thread and the helpers together, and the
    reads' verification uses those digests (swapper/checksum.py, [Note: a landed batch of reads is
    hashed at once]): each region hashed once, not all on the waiting thread, damage still found."""
    import threading
    import time

    n = 1 << 20  # four 4 MiB partitions: above PARALLEL_MIN_BYTES together
    values = [torch.randn(n) for _ in range(4)]
    ids = ["a", "b", "c", "d"]
    dirs = [tmp_path / f"d{i}" for i in range(drives)]
    for d in dirs:
        d.mkdir()
    with PartitionedParamSwapper(dirs if drives > 1 else dirs[0], {"block_size": 4096}, buffer_size=n, max_in_cpu=0,
                                 checksum="crc32") as s:
        for pid in ids:
            s.register(pid, n)
        s.swap_out_tensors(ids, values)
        s.synchronize()
        if damaged is not None:
            path = s.swap_dir.file(swap_file_name(ids[damaged]))
            _flip_byte(path.parts[0] if drives > 1 else path, 1234)
        hashed = []
        digest = ChecksumTable.digest
        helper_began = threading.Event()

        def watched(table, data):
            name = threading.current_thread().name
            hashed.append((name, data.numel() * data.element_size()))
            if name.startswith("nvmeio-verify"):
                helper_began.set()
            # The waiting thread waits for a helper to begin: helpers run at SCHED_IDLE, which a busy machine
            # may leave without a core for longer than the sleeps (none within 20 s: the assert below fails).
            elif not helper_began.wait(timeout=20):
                helper_began.set()
            time.sleep(0.05)  # (as a large region takes)
            return digest(table, data)

        monkeypatch.setattr(ChecksumTable, "digest", watched)
        if damaged is None:
            got = s.swap_in(ids)
            assert all(torch.equal(g, v) for g, v in zip(got, values))
        else:
            with pytest.raises(SwapCorruptionError) as info:
                s.swap_in(ids)
            assert info.value.filename == (path.parts[0] if drives > 1 else path)  # the drive, when striped
            assert s.state(ids[damaged]) is PartitionState.ON_NVME
            assert [s.state(p) for p in ids if p != ids[damaged]] == [PartitionState.AVAILABLE] * 3
        assert sorted(b for _, b in hashed) == [4 * n] * 4  # each region once
        assert any(name.startswith("nvmeio-verify") for name, _ in hashed)
        assert any(name == threading.current_thread().name for name, _ in hashed)


def test_rewriting_a_region_forgets_the_old_digest():
    table = ChecksumTable("crc32")
    table.record("f", 0, torch.zeros(100))
    table.record("f", 200, torch.ones(100))  # overlaps [0, 400)
    assert len(table) == 1
    table.verify("f", 0, torch.cat([torch.zeros(50), torch.ones(100)]))


def test_unknown_algorithm_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        PartitionedParamSwapper(tmp_path, None, checksum="md5")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_param_file_changed_between_swap_out_and_swap_in_is_detected(tmp_path, algorithm):
    with PartitionedParamSwapper(tmp_path, None, buffer_size=None, max_in_cpu=0, checksum=algorithm) as s:
        s.register("w", 1000)
        s.register("v", 1000)
        s.swap_out_tensors(["w", "v"], [torch.randn(1000), torch.randn(1000)])
        path = s.swap_dir.file(swap_file_name("w"))
        _flip_byte(path, 2345)
        with pytest.raises(SwapCorruptionError) as info:
            s.swap_in(["v", "w"])
        assert path in str(info.value) and info.value.filename == path
        assert s.state("w") is PartitionState.ON_NVME  # its buffer went back, nothing half-valid
        assert s.state("v") is PartitionState.AVAILABLE
        s.release(["v"])
        assert s.pool.free_count == s.pool.buffer_count


def test_without_checksums_a_changed_file_goes_unnoticed(tmp_path):
    with PartitionedParamSwapper(tmp_path, None, buffer_size=None, max_in_cpu=0) as s:
        s.register(0, 10)
        s.swap_out_tensors([0], [torch.zeros(10)])
        _flip_byte(s.swap_dir.file(swap_file_name(0)), 0)
        assert not torch.equal(s.swap_in([0])[0], torch.zeros(10))


def test_truncated_param_file_is_reported_even_without_checksums(tmp_path):
    with PartitionedParamSwapper(tmp_path, None, buffer_size=None, max_in_cpu=0) as s:
        s.register(0, 1000)
        s.swap_out_tensors([0], [torch.randn(1000)])
        path = s.swap_dir.file(swap_file_name(0))
        os.truncate(path, 3000)
        with pytest.raises(SwapFileTruncatedError, match=f"{path} of partition 0 is 3000 bytes, expected 4000"):
            s.swap_in([0])
        assert s.pool.free_count == s.pool.buffer_count


@pytest.mark.parametrize("cls", [PartitionedOptimizerSwapper, PipelinedOptimizerSwapper])
def test_optimizer_state_changed_on_disk_stops_the_step(tmp_path, cls):
    with cls(tmp_path, None, checksum="crc32") as s:
        for i in range(4):
            s.register_sub_group(i, 500)
        for i in range(4):
            s.initialize(i, torch.zeros(500))
        layout = s.register_sub_group(4, 500)
        s.initialize(4, torch.zeros(500))
        _flip_byte(s.swap_dir.file("subgroup2.swp"), layout.offset(2) + 17)  # exp_avg_sq of sub-group 2
        stepped = []
        with pytest.raises(SwapCorruptionError, match="subgroup2.swp changed"):
            s.step(lambda sg, t: (stepped.append(sg), t.master.add_(1)))
        assert 2 not in stepped  # corrupt data never reached the step function
        assert s.pool.free_count == s.pool.buffer_count
        assert s.state(2) is SubGroupState.ON_NVME
        t = s.swap_in(0)
        assert torch.equal(t.master, torch.ones(500))  # sub-groups before it were stepped and written
        s.release(0)


def test_truncated_optimizer_file_is_reported(tmp_path):
    with PartitionedOptimizerSwapper(tmp_path, None) as s:
        s.register_sub_group(0, 100)
        s.initialize(0, torch.zeros(100))
        path = s.swap_dir.file("subgroup0.swp")
        os.truncate(path, 100)
        with pytest.raises(SwapFileTruncatedError, match=f"{path} of sub-group 0 is 100 bytes"):
            s.step(lambda sg, t: None)


def test_async_swapper_detects_a_changed_file(tmp_path):
    swap_dir = SwapDirectory(tmp_path, "job", 0, "tensors")
    with PinnedBufferPool(2, 4096, torch.uint8) as pool:
        swap = AsyncTensorSwapper(swap_dir, pool, checksum="crc32")
        swap.swap_out([torch.arange(3000, dtype=torch.int16)], ["a.swp"])
        swap.synchronize()
        _flip_byte(swap_dir.file("a.swp"), 5000)
        with pytest.raises(SwapCorruptionError, match="a.swp changed"):
            swap.swap_in([torch.empty(3000, dtype=torch.int16)], ["a.swp"])
        assert pool.free_count == 2
    swap_dir.cleanup()


def test_a_missing_checksum_package_names_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "xxhash", None)
    with pytest.raises(ImportError, match=r"pip install xxhash\); checksum='crc32' works"):
        ChecksumTable("xxhash")


class _DoneHandle:
    """An aio_handle stand-in whose ops are done when submitted."""

    def async_pread(self, buffer, path, offset):
        pass

    def wait(self):
        return 0


def test_a_batch_whose_hashing_ahead_fails_still_runs_every_callback_and_keeps_no_digest():
    """IoQueue runs a landed batch's callbacks inside ``on_batch``'s context; if hashing ahead fails,
    every callback still runs (buffers go back, states move), each read is verified on its own,
    and the error is raised after them; a table keeps no digest past its batch."""
    from swapper._io_queue import IoKind, IoQueue

    table = ChecksumTable("crc32")
    data = [torch.randn(1 << 20) for _ in range(3)]  # 12 MiB: hashed ahead
    for i, t in enumerate(data):
        table.record(f"f{i}", 0, t)
    verified = []

    def on_done(i):
        return lambda error: (table.verify(f"f{i}", 0, data[i]), verified.append(i))

    queue = IoQueue(_DoneHandle(), on_batch=lambda ops: table.hashed_ahead([(op.path, op.offset, op.buffer)
                                                                           for op in ops]))
    for i, t in enumerate(data):
        queue.submit(IoKind.READ, t, f"f{i}", 0, on_done(i))
    assert queue.drain() == 3 and verified == [0, 1, 2] and table._ahead == {}

    def broken(ops):
        raise RuntimeError("hashing ahead failed")

    queue.on_batch, verified[:] = broken, []
    data[1][5] += 1  # and one read is damaged: its own verification finds it
    for i, t in enumerate(data):
        queue.submit(IoKind.READ, t, f"f{i}", 0, on_done(i))
    with pytest.raises(RuntimeError, match="hashing ahead failed") as info:
        queue.drain()
    assert verified == [0, 2] and "SwapCorruptionError" in "".join(getattr(info.value, "__notes__", []))


def _hash_together_then(tail: str):
    """A fresh Python that hashes four jobs together (``want``), then runs ``tail``."""
    import subprocess
    import sys

    code = ("import atexit, os, torch\n"
            "from swapper.checksum import ChecksumTable, hash_together\n"
            "t = ChecksumTable('crc32')\n"
            "jobs = [lambda i=i: t.digest(torch.full((10,), float(i))) for i in range(4)]\n"
            "want = hash_together(jobs)\n" + tail)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_hashes_together_with_helpers_of_its_own():
    """The helper pool's threads are not in a forked child: it starts its own (a pool inherited
    empty would take the jobs and never run them)."""
    out = _hash_together_then(
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if hash_together(jobs) == want else 3)\n"
        "print('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    assert out.returncode == 0 and out.stdout.strip() == "child 0", out.stdout + out.stderr


def test_hashing_together_in_an_atexit_cleanup_hashes_on_the_calling_thread():
    """At exit the helper pool takes no new work (concurrent.futures refuses it once the
    interpreter shuts down): a cleanup that drains reads then still verifies them."""
    out = _hash_together_then("atexit.register(lambda: print('at exit', hash_together(jobs) == want, flush=True))\n")
    assert out.returncode == 0 and out.stdout.strip() == "at exit True", out.stdout + out.stderr


def test_hashing_together_with_helpers_that_never_run_is_done_by_the_caller(monkeypatch):
    """Helpers at SCHED_IDLE may get no core on a busy machine: the caller takes every job nobody
    started, so it never waits for a helper that has not begun."""
    from swapper import checksum

    import concurrent.futures

    class Starved:  # a pool whose threads never get a core: its futures never finish
        def submit(self, fn):
            return concurrent.futures.Future()

    monkeypatch.setattr(checksum, "_hash_pool", Starved())
    table = ChecksumTable("crc32")
    data = [torch.full((100,), float(i)) for i in range(5)]
    assert checksum.hash_together([lambda t=t: table.digest(t) for t in data]) == [table.digest(t) for t in data]
    with pytest.raises(ZeroDivisionError):
        checksum.hash_together([lambda: 1, lambda: 1 // 0, lambda: 3])
