"""Several drives, no RAID: a swap file striped over one directory per drive (nvmeio.StripedFile).

Byte-exact round trips over 1-4 directories with the sizes, offsets, buffers and handle settings
of the single-path round trips (test_aio_roundtrip.py); the parts hold exactly the bytes the
stripe layout puts there; a missing or full drive is an error naming it, before any byte is
written; swappers and engines take ``nvme_path`` as a list, across file systems (a tmpfs beside
the disk), train exactly as on one directory, and save and load checkpoints.
"""
import contextlib
import errno
import os
import subprocess
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvmeio
import test_aio_roundtrip as single  # its strategies: the single-path patterns
from helpers import make_engine, random_bytes, train_engine
from nvmeio import StripedFile, faults
from nvmeio.striping import stripe_unit
from swapper import InsufficientSwapSpaceError, PartitionedParamSwapper, SwapDirectory
from swapper._param_swapper import swap_file_name
from zero.examples import GPTConfig, make_batches

MiB = 1 << 20


def assemble(f: StripedFile) -> bytes:
    """The logical bytes of a striped file, read from its parts by the layout's definition:
    unit i is in part i % N at (i // N) * unit (written here independently of StripedFile)."""
    parts = [open(p, "rb").read() if os.path.exists(p) else b"" for p in f.parts]
    n, out, i = len(parts), bytearray(), 0
    while True:
        chunk = parts[i % n][(i // n) * f.unit:(i // n + 1) * f.unit]
        if not chunk:
            break
        out += chunk
        if len(chunk) < f.unit:
            break
        i += 1
    return bytes(out)


def striped(dirs, name: str, unit: int) -> StripedFile:
    return StripedFile(tuple(os.path.join(d, name) for d in dirs), unit)


def drive_dirs(root, n: int):
    dirs = [root / f"drive{i}" for i in range(n)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    return [str(d) for d in dirs]


@contextlib.contextmanager
def tmpfs(path, size: str = "64m"):
    """A tmpfs mounted at ``path`` (another file system than the disk's), or a skip saying why not."""
    os.makedirs(path, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- the layout ---------------------------------------------------------------------------------

@settings(deadline=None)
@given(n=st.integers(1, 4), unit=st.sampled_from([4096, 65536, MiB]), offset=st.integers(0, 5 * MiB),
       nbytes=st.integers(0, 9 * MiB))
def test_pieces_cover_the_op_once_in_order(n, unit, offset, nbytes):
    f = StripedFile(tuple(f"/d{i}/x" for i in range(n)), unit)
    pieces = f.pieces(offset, nbytes)
    assert sum(p.length for p in pieces) == nbytes
    assert [p.start for p in pieces] == [sum(q.length for q in pieces[:i]) for i in range(len(pieces))]
    for p in pieces:
        index = (offset + p.start) // unit
        assert p.part == index % n and p.file_offset == (index // n) * unit + (offset + p.start) % unit
        assert (offset + p.start) // unit == (offset + p.start + p.length - 1) // unit  # inside one unit
    assert f.size_from_parts(f.part_bytes(offset + nbytes)) == offset + nbytes


def test_stripe_unit_is_the_block_size_rounded_up():
    assert stripe_unit(8 << 20) == 8 << 20
    assert stripe_unit(1_000_000) == 1_003_520 and stripe_unit(4096) == 64 << 10
    with pytest.raises(ValueError, match="multiple of 4096"):
        StripedFile(("/a", "/b"), 1000)
    with pytest.raises(ValueError, match="twice"):
        StripedFile(("/a", "/a"), 4096)


# -- byte-exact round trips through aio_handle ----------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 4), unit=st.sampled_from([4096, 65536, MiB]), nbytes=single.sizes, offset=single.offsets,
       cfg=single.handle_settings, src_kind=single.memory, dst_kind=single.memory,
       background=st.integers(0, 6 * MiB), seed=st.integers(0, 2**31))
def test_striped_round_trip_is_byte_exact(tmp_path, n, unit, nbytes, offset, cfg, src_kind, dst_kind, background,
                                          seed):
    h = nvmeio.aio_handle(**cfg)
    f = striped(drive_dirs(tmp_path, n), f"rt_{uuid.uuid4().hex}.bin", unit)
    old = random_bytes(background, seed + 1)
    if background:
        assert h.sync_pwrite(old, f, 0) == 1
    src = single.make_buffer(h, src_kind, nbytes)
    src[:] = random_bytes(nbytes, seed)

    assert h.sync_pwrite(src, f, file_offset=offset) == 1  # one op, however many pieces

    expected = bytearray(old.tobytes().ljust(offset, b"\0") if nbytes else old.tobytes())
    expected[offset:offset + nbytes] = src.tobytes()
    assert assemble(f) == bytes(expected)
    assert f.size() == len(expected)
    dst = single.make_buffer(h, dst_kind, nbytes)
    dst[:] = 0xAB
    assert h.sync_pread(dst, f, file_offset=offset) == 1
    assert np.array_equal(dst, src)
    h.close()


def test_async_ops_on_several_striped_files_complete_in_one_wait(tmp_path):
    dirs = drive_dirs(tmp_path, 3)
    h = nvmeio.aio_handle(block_size=65536, queue_depth=4, intra_op_parallelism=2)
    data = [random_bytes(n, n) for n in (1, 300_000, 2 * MiB + 17)]
    files = [striped(dirs, f"f{i}", 65536) for i in range(3)]
    for d, f in zip(data, files):
        h.async_pwrite(d, f, 4096)
    assert h.wait() == 3
    back = [np.zeros_like(d) for d in data]
    # Reads may all land before pending() is asked (a quick disk): f0's one request is held 0.5 s.
    with faults.inject(delay_us=500_000, op="read", path_contains=os.sep + "f0") as fired:
        for b, f in zip(back, files):
            h.async_pread(b, f, 4096)
        assert h.pending() >= 1 and h.wait() == 3
    assert fired()["delayed"] == 1
    assert all(np.array_equal(a, b) for a, b in zip(data, back))


# -- a failing drive names itself --------------------------------------------------------------------

def test_a_missing_drive_directory_is_named_before_anything_is_written(tmp_path):
    dirs = drive_dirs(tmp_path, 3)
    os.rmdir(dirs[1])
    f = striped(dirs, "x.swp", 4096)
    h = nvmeio.aio_handle()
    with pytest.raises(FileNotFoundError, match=rf"part 2 of 3 .*drive {dirs[1]}") as info:
        h.sync_pwrite(random_bytes(5 * 4096), f, 0)
    assert info.value.filename == f.parts[1]
    assert not os.path.exists(f.parts[0]) and not os.path.exists(f.parts[2])  # nothing left behind
    assert h.wait() == 0


def test_a_missing_or_short_part_fails_the_read_naming_its_drive(tmp_path):
    dirs = drive_dirs(tmp_path, 2)
    f = striped(dirs, "x.swp", 4096)
    h = nvmeio.aio_handle()
    h.sync_pwrite(random_bytes(4 * 4096), f, 0)
    os.truncate(f.parts[1], 4096)
    with pytest.raises(nvmeio.ShortReadError, match=rf"part 2 of 2 .*drive {dirs[1]}\) holds 4096 bytes"):
        h.sync_pread(np.zeros(4 * 4096, np.uint8), f, 0)
    os.unlink(f.parts[1])
    with pytest.raises(FileNotFoundError, match=rf"drive {dirs[1]}") as info:
        h.sync_pread(np.zeros(4096, np.uint8), f, 4096)
    assert info.value.filename == f.parts[1]
    h.sync_pread(np.zeros(4096, np.uint8), f, 0)  # the other drive's units still read


def test_a_full_drive_is_named_and_no_part_keeps_the_failed_range(tmp_path):
    with tmpfs(tmp_path / "small", size="1m") as small:
        disk = drive_dirs(tmp_path, 1)[0]
        f = StripedFile((os.path.join(disk, "x.swp"), os.path.join(small, "x.swp")), 65536)
        h = nvmeio.aio_handle()
        with pytest.raises(OSError, match=rf"part 2 of 2 .*drive {small}") as info:
            h.sync_pwrite(random_bytes(8 * MiB), f, 0)
        assert info.value.errno == errno.ENOSPC and info.value.filename == f.parts[1]
        assert not os.path.exists(f.parts[0]) and not os.path.exists(f.parts[1])


# -- the swap directory ------------------------------------------------------------------------------

def test_swap_directory_of_several_drives(tmp_path):
    dirs = drive_dirs(tmp_path, 3)
    free = {dirs[0]: 1 << 40, dirs[1]: 1 << 40, dirs[2]: MiB}
    d = SwapDirectory(dirs, "job", 0, "params", free_space_fn=lambda p: free[p], stripe_unit=65536)
    f = d.create("a.swp")
    assert isinstance(f, StripedFile) and f.parts == tuple(os.path.join(p, "job", "rank0", "params", "a.swp")
                                                           for p in dirs)
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in f.parts)
    d.check_free_space(3 * MiB // 2, "tensors")  # each drive holds its share: a third, and a unit
    with pytest.raises(InsufficientSwapSpaceError, match=rf"under {dirs[2]} \(drive 3 of 3"):
        d.check_free_space(10 * MiB, "3 partitions")
    d.cleanup()
    assert all(os.listdir(p) == [] for p in dirs)


def test_swap_directory_refuses_a_missing_drive_and_a_drive_named_twice(tmp_path):
    dirs = drive_dirs(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match=r"nvme_path .*nope \(drive 3 of 3\) is not an existing directory"):
        SwapDirectory([*dirs, str(tmp_path / "nope")], "job")
    with pytest.raises(ValueError, match="twice"):
        SwapDirectory([dirs[0], dirs[0] + "/."], "job")
    assert all(os.listdir(p) == [] for p in dirs)  # the first drives' claims were given back


def test_one_directory_keeps_plain_paths(tmp_path):
    for given in (str(tmp_path), [str(tmp_path)]):
        d = SwapDirectory(given, "job")
        assert d.create("a.swp") == os.path.join(str(tmp_path), "job", "rank0", "swap", "a.swp")
        d.cleanup()


# -- swappers and engines on several drives ------------------------------------------------------------

def _data(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_param_swapper_round_trip_over_drives(tmp_path_factory, swappers, n):
    dirs = drive_dirs(tmp_path_factory.mktemp("drives"), n)  # (swappers checks that tmp_path is left empty)
    s = swappers(PartitionedParamSwapper(dirs if n > 1 else dirs[0], {"block_size": 4096, "queue_depth": 8},
                                         buffer_count=3, max_in_cpu=0))
    sizes = [1, 17, 4097, 70_000, 250_001, 12345, 64]
    dtypes = [torch.float32, torch.bfloat16, torch.float64]
    data = {f"p{i}": _data(k, dtypes[i % 3], i) for i, k in enumerate(sizes)}
    for pid, t in data.items():
        s.register(pid, t.numel(), t.dtype)
    s.swap_out_tensors(list(data), list(data.values()), async_op=True)
    s.synchronize()
    for pid, t in data.items():
        f = s.swap_dir.file(swap_file_name(pid))
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (assemble(f) if n > 1 else open(f, "rb").read()) == raw
    if n > 1:  # the 250,001 x 8 bytes of p4 are on every drive
        f = s.swap_dir.file(swap_file_name("p4"))
        assert all(os.path.getsize(p) > 0 for p in f.parts)
    ids = list(data)
    for batch in (ids[:3], ids[3:5], ids[5:]):
        for pid, got in zip(batch, s.swap_in(batch)):
            assert torch.equal(got, data[pid])
        s.release(batch)
    s.cleanup()
    assert all(os.listdir(d) == [] for d in dirs)


def _striped_settings(dirs):
    """Every swap file of the test model over ``dirs``, in 64 KiB units (aio block 4096)."""
    return {"aio": {"block_size": 4096}, "zero_optimization": {
        "sub_group_size": 100_000,
        "offload_param": {"nvme_path": dirs}, "offload_optimizer": {"nvme_path": dirs}}}


def test_engine_on_striped_drives_trains_and_checkpoints_as_on_one(tmp_path):
    """A list of nvme_path directories, one a tmpfs (another file system), trains with exactly the
    losses of one directory; its checkpoint (on the disk) loads back into a striped engine and into
    a single-directory one, and both continue exactly."""
    cfg = GPTConfig()
    batches = make_batches(cfg, 6, 4)
    with tmpfs(tmp_path / "tmpfs", size="256m") as fast:
        dirs = [*drive_dirs(tmp_path, 2), fast]
        one = make_engine(tmp_path / "one", overrides={"aio": {"block_size": 4096},
                                                       "zero_optimization": {"sub_group_size": 100_000}})
        expected = train_engine(one, batches, 6)
        one.destroy()

        engine = make_engine(dirs[0], overrides=_striped_settings(dirs))
        assert train_engine(engine, batches[:3], 3) == expected[:3]
        files = [os.path.join(r, x) for d in dirs for r, _, names in os.walk(d) for x in names]
        assert all(any(f.startswith(d) and os.path.getsize(f) for f in files) for d in dirs)  # every drive used
        engine.save_checkpoint(tmp_path / "ckpt")
        assert train_engine(engine, batches[3:], 3) == expected[3:]
        engine.destroy()

        for target in (dirs, str(tmp_path / "one")):
            resumed = make_engine(tmp_path / "one", seed=1, overrides=_striped_settings(target))
            resumed.load_checkpoint(tmp_path / "ckpt")
            assert train_engine(resumed, batches[3:], 3) == expected[3:]
            resumed.destroy()
    assert all(os.listdir(d) == [] for d in dirs[:2])  # every swap file and directory removed


def test_nvme_tune_times_the_striped_layout_of_several_dirs(tmp_path):
    from nvmeio.tune._measure import Workload
    from nvmeio.tune._space import Config

    dirs = drive_dirs(tmp_path, 3)
    config = Config(backend="psync", block_size=65536, queue_depth=4, intra_op_parallelism=2, single_submit=False,
                    overlap_events=False)
    with Workload(dirs, 3 * MiB + 8192) as w:
        sample = w.measure(config)
        assert sample.error is None and sample.write_gbps > 0 and sample.read_gbps > 0
        # the timed write laid the buffer out as the swappers would, in units of the block size
        f = StripedFile(tuple(w.names), 65536)
        assert assemble(f)[:w.nbytes] == w._buffer.numpy().tobytes()
        assert [os.path.getsize(p) for p in f.parts[1:]] == f.part_bytes(w.nbytes)[1:]


def test_an_io_error_on_one_drive_names_it_and_the_swap_can_be_retried(tmp_path_factory, swappers):
    dirs = drive_dirs(tmp_path_factory.mktemp("drives"), 3)
    s = swappers(PartitionedParamSwapper(dirs, {"block_size": 4096}, buffer_count=2, max_in_cpu=0))
    t = _data(200_000, torch.float32, 0)  # 800 KB: units on every drive
    s.register("w", t.numel(), t.dtype)
    with nvmeio.faults.inject(fail_nth=1, errno="EIO", path_contains=os.path.basename(dirs[1]) + "/", op="write"):
        with pytest.raises(OSError) as info:
            s.swap_out_tensors(["w"], [t], async_op=False)
    assert info.value.errno == errno.EIO and info.value.filename.startswith(dirs[1] + os.sep)
    s.swap_out_tensors(["w"], [t], async_op=False)  # the drive is back: the retry writes every byte
    assert torch.equal(s.swap_in(["w"])[0], t)
    s.release(["w"])


# -- checksums per drive (swapper/checksum.py, [Note: a drive's share of a striped region]) ------------

def _corrupt(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("later", [False, True], ids=["record", "record_later"])
def test_a_mismatch_in_a_striped_region_names_the_drive_whose_share_changed(later):
    from swapper import SwapCorruptionError
    from swapper.checksum import ChecksumTable

    f = StripedFile(("/d0/x.swp", "/d1/x.swp", "/d2/x.swp"), unit=65536)
    data = torch.from_numpy(np.frombuffer(random_bytes(5 * 65536 + 1000), dtype=np.uint8).copy())
    table = ChecksumTable("crc32")
    if later:
        table.record_later(f, [(4096, data)]).wait()
    else:
        table.record(f, 4096, data)
    table.verify(f, 4096, data)  # unchanged: no error
    for part in range(3):
        piece = next(p for p in f.pieces(4096, data.numel()) if p.part == part)
        changed = data.clone()
        changed[piece.start + 7] ^= 1
        with pytest.raises(SwapCorruptionError) as info:
            table.verify(f, 4096, changed)
        assert f"the changed bytes are on {f.parts[part]}" in str(info.value)
        assert info.value.filename == f.parts[part]
    assert table.recorded(f, 4096, data.numel()) == table.digest(data)  # the plain digest, as a checkpoint carries


def test_a_digest_assigned_from_elsewhere_names_the_drives_its_region_spans():
    from swapper import SwapCorruptionError
    from swapper.checksum import ChecksumTable

    f = StripedFile(("/d0/x.swp", "/d1/x.swp", "/d2/x.swp"), unit=65536)
    data = torch.zeros(2 * 65536, dtype=torch.uint8)  # units 0 and 1: drives 0 and 1, not 2
    table = ChecksumTable("crc32")
    table.assign(f, 0, data.numel(), table.digest(data) ^ 1)
    with pytest.raises(SwapCorruptionError, match="on the drives of /d0/x.swp, /d1/x.swp \\(no digest per drive"):
        table.verify(f, 0, data)


def test_a_changed_swap_file_on_one_of_three_drives_is_named_by_the_swapper(tmp_path_factory, swappers):
    from swapper import SwapCorruptionError

    dirs = drive_dirs(tmp_path_factory.mktemp("drives"), 3)
    s = swappers(PartitionedParamSwapper(dirs, {"block_size": 4096}, buffer_count=2, max_in_cpu=0,
                                         checksum="crc32"))
    t = _data(200_000, torch.float32, 0)  # 800 KB: units on every drive
    s.register("w", t.numel(), t.dtype)
    s.swap_out_tensors(["w"], [t], async_op=False)
    f = s.swap_dir.file(swap_file_name("w"))
    _corrupt(f.parts[2])
    with pytest.raises(SwapCorruptionError) as info:
        s.swap_in(["w"])
    assert info.value.filename == f.parts[2] and f"the changed bytes are on {f.parts[2]}" in str(info.value)
    assert f.parts[0] + "," not in str(info.value).split("the changed bytes")[1]


def test_config_takes_a_list_of_nvme_paths_and_names_a_bad_one(tmp_path):
    from zero import ConfigError
    from zero.config.load import load_config

    dirs = drive_dirs(tmp_path, 2)

    def config(path):
        return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path}}}

    assert load_config(config(dirs)).zero_optimization.offload_param.nvme_path == dirs
    assert load_config(config(dirs[0])).zero_optimization.offload_param.nvme_path == dirs[0]
    for bad, message in (([dirs[0], str(tmp_path / "gone")], "gone' does not exist"),
                         ([dirs[0], dirs[0]], "more than once"), ([dirs[0], dirs[0] + "/."], "the same directory"),
                         ([], "non-empty list")):
        with pytest.raises(ConfigError, match=message):
            load_config(config(bad))
