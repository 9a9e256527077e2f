"""gds_handle: CUDA tensors through cuFile (kvikio).

Always run: the refusals without CUDA or without kvikio, and the handle's
logic against a stand-in kvikio module (settings mapping, both kvikio API
generations, compatibility-mode reporting, errors, registration counting)
with tensors that claim to be on cuda:0. With a GPU and kvikio installed the
last section runs real round trips.
"""

import errno
import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch

import nvmeio
from nvmeio._cufile_cache import CuFileCache
from helpers import file_bytes, random_bytes, run_child
from test_cuda_paths import fake_cuda, on_fake_cuda, plain  # noqa: F401 - fake_cuda: a fixture

gds_module = importlib.import_module("nvmeio._gds")


def _has_kvikio() -> bool:
    try:
        importlib.import_module("kvikio")
        return True
    except Exception:  # noqa: BLE001 - a kvikio that fails to load (its CUDA libraries) counts as absent
        return False


def needs_gds(test):
    """Runs only with a CUDA GPU and kvikio; marked ``cuda`` (bench/gpu_check.py runs the marked tests)."""
    return pytest.mark.cuda(pytest.mark.skipif(not (torch.cuda.is_available() and _has_kvikio()),
                                               reason="needs a CUDA GPU and kvikio (pip install nvmeio[gds])")(test))


# -- refusals --------------------------------------------------------------------------------------

def test_without_cuda_gds_handle_names_cuda_and_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as e:
        nvmeio.gds_handle()
    msg = str(e.value)
    assert msg.startswith("gds_handle needs CUDA and an NVIDIA GPU: ")
    assert "built without CUDA" in msg and "pip install torch --index-url" in msg
    assert nvmeio.gds_unavailable_reason() == msg


def test_with_cuda_torch_but_no_gpu_gds_handle_names_the_driver(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA and an NVIDIA GPU: .*no NVIDIA GPU or driver"):
        nvmeio.gds_handle(intra_op_parallelism=4)


@pytest.mark.parametrize("cuda,command,wheel", [
    ("12.8", "pip install nvmeio[gds]`", "kvikio-cu12"),
    ("13.0", "pip install nvmeio[gds-cu13]`", "kvikio-cu13"),
    ("11.8", "pip install nvmeio[gds]`", "kvikio-cu13"),
])
def test_without_kvikio_gds_handle_names_the_install_command(monkeypatch, cuda, command, wheel):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio raises ImportError
    with pytest.raises(RuntimeError) as e:
        nvmeio.gds_handle()
    msg = str(e.value)
    assert "gds_handle needs kvikio" in msg and "could not be imported" in msg
    assert command in msg and wheel in msg
    assert nvmeio.gds_unavailable_reason() == msg


# -- a stand-in kvikio -----------------------------------------------------------------------------

class FakeKvikio(types.ModuleType):
    """Enough of kvikio for gds_handle: CuFile over os.pread/os.pwrite,
    kvikio.defaults (new get/set API, or the old one), memory registration."""

    def __init__(self, new_api=True, compat=True, gds_available=None):
        super().__init__("kvikio")
        self.calls, self.registered, self.deregistered, self.opened = [], [], [], []
        self.files = []         # every CuFile made, open or closed
        self.fail = None        # exception raised by the next op
        self.short_by = 0       # bytes an op leaves out
        self.num_threads, self.compat, self.auto_direct_io_read = 1, compat, False
        kv = self
        defaults = types.ModuleType("kvikio.defaults")
        if new_api:
            defaults.get = lambda name: getattr(kv, {"num_threads": "num_threads",
                                                     "auto_direct_io_read": "auto_direct_io_read"}[name])
            defaults.set = lambda name, value: setattr(kv, name, value)
            defaults.is_compat_mode_preferred = lambda: kv.compat
        else:
            defaults.get_num_threads = lambda: kv.num_threads
            defaults.num_threads_reset = lambda n: setattr(kv, "num_threads", n)
            defaults.compat_mode = lambda: kv.compat
        self.defaults = defaults
        driver = types.ModuleType("kvikio.cufile_driver")
        if gds_available is not None:
            driver.get = lambda name: {"is_gds_available": gds_available}[name]
        self.cufile_driver = driver

        class CuFile:
            def __init__(self, path, flags="r"):
                self.fd = os.open(path, {"r": os.O_RDONLY, "r+": os.O_RDWR}[flags])
                self.path, self.flags, self.closed = str(path), flags, False
                kv.opened.append(flags)
                kv.files.append(self)

            def fileno(self):
                return self.fd

            def close(self):
                if not self.closed:
                    self.closed = True
                    os.close(self.fd)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

            def _op(self, name, buf, size, file_offset, task_size):
                kv.calls.append((name, size, file_offset, task_size))
                if kv.fail is not None:
                    raise kv.fail
                view = buf.as_subclass(torch.Tensor).numpy()
                n = size - kv.short_by
                if name == "pread":
                    view[:n] = np.frombuffer(os.pread(self.fd, n, file_offset), np.uint8)
                else:
                    n = os.pwrite(self.fd, view[:n].tobytes(), file_offset)
                return types.SimpleNamespace(get=lambda: n, done=lambda: True)

            def pread(self, buf, size=None, file_offset=0, task_size=None):
                return self._op("pread", buf, size, file_offset, task_size)

            def pwrite(self, buf, size=None, file_offset=0, task_size=None):
                return self._op("pwrite", buf, size, file_offset, task_size)

        self.CuFile = CuFile

    def open_files(self):
        return [f for f in self.files if not f.closed]

    def memory_register(self, buf):
        self.registered.append(buf.data_ptr())

    def memory_deregister(self, buf):
        self.deregistered.append(buf.data_ptr())


class Ready:
    def synchronize(self):
        pass


def install(monkeypatch, kv):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio", kv)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kv.defaults)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", kv.cufile_driver)
    monkeypatch.setattr(gds_module, "stream_fence", lambda device: Ready())
    return kv


@pytest.fixture
def kv(monkeypatch):
    """kvikio on a machine with the GDS driver: CUDA tensors go to cuFile."""
    return install(monkeypatch, FakeKvikio(compat=False, gds_available=True))


def fake_cuda_bytes(n, seed=0):
    return on_fake_cuda(torch.from_numpy(random_bytes(n, seed)))


# -- the handle, against the stand-in --------------------------------------------------------------

def test_settings_map_to_kvikio_thread_pool_and_task_size(kv, nvme_dir):
    h = nvmeio.gds_handle(block_size=2 << 20, queue_depth=16, intra_op_parallelism=8)
    assert kv.num_threads == 8 and h.get_kvikio_num_threads() == 8
    nvmeio.gds_handle(intra_op_parallelism=4)
    assert kv.num_threads == 8  # the pool is process-wide: grown, never shrunk
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == \
        (2 << 20, 16, 8)
    h.sync_pwrite(fake_cuda_bytes(5000), nvme_dir / "t.bin", file_offset=3)
    assert kv.calls == [("pwrite", 5000, 3, 2 << 20)] and kv.opened == ["r+"]


def test_old_kvikio_api_is_used_when_the_new_one_is_missing(monkeypatch, nvme_dir):
    kv = install(monkeypatch, FakeKvikio(new_api=False, compat=False))
    h = nvmeio.gds_handle(intra_op_parallelism=3)
    assert kv.num_threads == 3
    assert h.get_compat_mode() is False and h.get_io_mode() == "cufile"


@pytest.mark.parametrize("compat,gds,mode", [(True, True, "posix"), (False, True, "gds"),
                                             (False, False, "cufile-compat"),
                                             (False, None, "cufile")])
def test_the_handle_reports_which_io_path_is_active(monkeypatch, compat, gds, mode):
    install(monkeypatch, FakeKvikio(compat=compat, gds_available=gds))
    h = nvmeio.gds_handle()
    assert h.get_compat_mode() is compat and h.get_io_mode() == mode
    assert f"io_mode={mode!r}" in repr(h)


@pytest.mark.parametrize("n,offset", [(0, 0), (1, 0), (4095, 1), (4096, 4096), (123_457, 9_999)])
def test_round_trip_of_cuda_tensors_matches_the_cpu_path(kv, nvme_dir, n, offset):
    h = nvmeio.gds_handle()
    src = fake_cuda_bytes(n, n)
    assert h.async_pwrite(src, nvme_dir / "g.bin", file_offset=offset) == 0
    assert h.wait() == 1
    nvmeio.aio_handle().sync_pwrite(plain(src), nvme_dir / "c.bin", file_offset=offset)
    assert file_bytes(nvme_dir / "g.bin") == file_bytes(nvme_dir / "c.bin")
    dst = on_fake_cuda(torch.zeros(n, dtype=torch.uint8))
    assert h.sync_pread(dst, nvme_dir / "g.bin", file_offset=offset) == 1
    assert torch.equal(plain(dst), plain(src))
    assert h.pwrite(src, nvme_dir / "v.bin", True) == 1  # validate=True compares the bytes
    assert len(kv.calls) == (3 if n else 0)               # empty ops never reach cuFile


@pytest.mark.parametrize("compat,gds,forced,path", [
    (True, None, None, "staging"),     # kvikio's compatibility mode: POSIX through its bounce buffers
    (False, False, None, "staging"),   # cuFile without the GDS driver: cuFile's own fallback
    (False, True, None, "cufile"),     # the driver: GPUDirect
    (False, None, None, "cufile"),     # kvikio cannot tell: cuFile decides
    (True, None, "0", "cufile"),       # NVMEIO_GDS_STAGING forces either way
    (False, True, "1", "staging")])
def test_cuda_tensors_take_the_staging_pipeline_where_cufile_has_no_gpudirect_path(
        monkeypatch, fake_cuda, nvme_dir, compat, gds, forced, path):  # noqa: F811 - the fixture
    """See [Note: without GPUDirect, CUDA tensors take nvmeio's staging] in nvmeio/_gds.py."""
    kv = install(monkeypatch, FakeKvikio(compat=compat, gds_available=gds))
    if forced is not None:
        monkeypatch.setenv("NVMEIO_GDS_STAGING", forced)
    h = nvmeio.gds_handle()
    assert h.get_device_path() == path == nvmeio.gds_device_path() and f"device_path={path!r}" in repr(h)
    src = fake_cuda_bytes(100_000, 7)
    assert h.sync_pwrite(src, nvme_dir / "s.bin", file_offset=4096) == 1
    dst = on_fake_cuda(torch.zeros(100_000, dtype=torch.uint8))
    assert h.sync_pread(dst, nvme_dir / "s.bin", file_offset=4096) == 1
    assert torch.equal(plain(dst), plain(src))
    assert file_bytes(nvme_dir / "s.bin")[4096:] == plain(src).numpy().tobytes()
    cufile_ops = [c[0] for c in kv.calls]
    assert cufile_ops == (["pwrite", "pread"] if path == "cufile" else [])
    assert (fake_cuda.copies > 0) == (path == "staging")  # the staging chunks' copies to and from the device
    h.close()


def test_host_buffers_go_through_the_native_core(kv, nvme_dir):
    h = nvmeio.gds_handle()
    cpu = random_bytes(10_000, 3)
    h.async_pwrite(cpu, nvme_dir / "h.bin")
    h.async_pwrite(fake_cuda_bytes(10_000, 4), nvme_dir / "d.bin")
    assert h.wait() == 2
    assert file_bytes(nvme_dir / "h.bin") == cpu.tobytes()
    assert [c[0] for c in kv.calls] == ["pwrite"]


def test_a_kvikio_failure_is_an_aio_error_raised_by_wait(kv, nvme_dir):
    h = nvmeio.gds_handle()
    kv.fail = RuntimeError("cuFile error: boom")
    h.async_pwrite(fake_cuda_bytes(8192), nvme_dir / "new.bin", file_offset=4096)
    with pytest.raises(nvmeio.AioError, match="kvikio pwrite failed: cuFile error: boom") as e:
        h.wait()
    assert (e.value.errno, e.value.filename, e.value.offset, e.value.length) == \
        (errno.EIO, str(nvme_dir / "new.bin"), 4096, 8192)
    assert not (nvme_dir / "new.bin").exists()  # a new file that failed is removed
    assert h.wait() == 0


def test_a_short_transfer_is_an_error(kv, nvme_dir):
    h = nvmeio.gds_handle()
    (nvme_dir / "s.bin").write_bytes(bytes(8192))
    kv.short_by = 100
    with pytest.raises(nvmeio.AioError, match="cuFile pread moved 8092 of 8192 bytes"):
        h.sync_pread(on_fake_cuda(torch.zeros(8192, dtype=torch.uint8)), nvme_dir / "s.bin")


def test_a_missing_or_short_file_raises_at_submit_and_is_not_counted(kv, nvme_dir):
    h = nvmeio.gds_handle()
    dst = on_fake_cuda(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(FileNotFoundError):
        h.async_pread(dst, nvme_dir / "missing.bin")
    (nvme_dir / "short.bin").write_bytes(b"x" * 99)
    with pytest.raises(nvmeio.ShortReadError, match="holds 99 bytes"):
        h.async_pread(dst, nvme_dir / "short.bin")
    assert h.wait() == 0 and kv.calls == []


def test_registration_is_counted_per_cuda_allocation(kv, monkeypatch):
    # Two tensors in one caching-allocator segment, one in another.
    base, other = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    segments = {base.data_ptr(): (0, 1), other.data_ptr(): (0, 2)}
    monkeypatch.setattr(gds_module, "_allocation_of", lambda t: next(
        key for start, key in segments.items() if start <= t.data_ptr() < start + (1 << 16)))
    a, b, c = on_fake_cuda(base[:1000]), on_fake_cuda(base[8192:9000]), on_fake_cuda(other)
    h = nvmeio.gds_handle()
    assert h.pin_device_tensor(a) and h.pin_device_tensor(b) and h.pin_device_tensor(c)
    assert h.pin_device_tensor(a)  # pinning twice is harmless
    assert kv.registered == [a.data_ptr(), c.data_ptr()]
    assert h.is_pinned(a) and h.is_pinned(on_fake_cuda(base[8200:8300]))
    assert not h.is_pinned(on_fake_cuda(base[2000:3000]))
    assert h.unpin_device_tensor(a) and kv.deregistered == []  # b still uses the allocation
    assert h.unpin_device_tensor(b) and kv.deregistered == [a.data_ptr()]  # via the registrant
    assert h.free_pinned_device_tensor(c) and kv.deregistered == [a.data_ptr(), c.data_ptr()]
    with pytest.raises(ValueError, match="not pinned by this gds_handle"):
        h.unpin_device_tensor(a)
    with pytest.raises(ValueError, match="takes a CUDA tensor"):
        h.pin_device_tensor(torch.zeros(4))


# -- cuFile handles kept open (nvmeio/_cufile_cache.py) --------------------------------------------

def test_a_file_is_opened_once_for_all_its_ops(kv, nvme_dir):
    h = nvmeio.gds_handle()
    path = nvme_dir / "once.bin"
    src = [fake_cuda_bytes(8192, i) for i in range(3)]
    for i, t in enumerate(src):
        h.async_pwrite(t, path, file_offset=i * 8192)
    assert h.wait() == 3
    back = on_fake_cuda(torch.zeros(8192, dtype=torch.uint8))
    for i, t in enumerate(src):
        assert h.sync_pread(back, path, file_offset=i * 8192) == 1
        assert torch.equal(plain(back), plain(t))
    assert kv.opened == ["r+"]  # one open (and cuFile registration) for six ops
    h.close()
    assert kv.open_files() == []


def test_the_open_file_limit_is_nvmeio_cufile_handles(kv, nvme_dir, monkeypatch):
    """A swapper reads many units' files in turn: past the limit each op reopens its file."""
    paths = [nvme_dir / f"f{i}.bin" for i in range(3)]
    monkeypatch.setenv("NVMEIO_CUFILE_HANDLES", "2")
    h = nvmeio.gds_handle()
    for p in paths:
        h.sync_pwrite(fake_cuda_bytes(4096, 1), p)
    assert len(kv.open_files()) == 2 and len(kv.opened) == 3
    monkeypatch.setenv("NVMEIO_CUFILE_HANDLES", "3")
    h3 = nvmeio.gds_handle()
    back = on_fake_cuda(torch.zeros(4096, dtype=torch.uint8))
    for _ in range(2):
        for p in paths:
            h3.sync_pread(back, p)
    assert len(kv.opened) == 6  # three more opens, then every read from the kept handles
    h.close()
    h3.close()


def test_a_write_after_reads_reopens_the_file_for_writing(kv, nvme_dir):
    h = nvmeio.gds_handle()
    path = nvme_dir / "ro.bin"
    path.write_bytes(random_bytes(4096, 1).tobytes())
    back = on_fake_cuda(torch.zeros(4096, dtype=torch.uint8))
    h.sync_pread(back, path)
    h.sync_pread(back, path)
    new = fake_cuda_bytes(4096, 2)
    h.sync_pwrite(new, path)
    h.sync_pread(back, path)
    assert kv.opened == ["r", "r+"] and [f.flags for f in kv.open_files()] == ["r+"]
    assert file_bytes(path) == new.numpy().tobytes() and torch.equal(plain(back), plain(new))


@pytest.mark.parametrize("how", ["deleted", "renamed over"])
def test_a_file_replaced_under_the_same_name_gets_a_handle_of_its_own(kv, nvme_dir, how):
    h = nvmeio.gds_handle()
    path = nvme_dir / "same.bin"
    old, new = fake_cuda_bytes(8192, 1), fake_cuda_bytes(8192, 2)
    h.sync_pwrite(old, path)
    if how == "deleted":
        os.remove(path)
        h.sync_pwrite(new, path)
    else:
        (nvme_dir / "tmp.bin").write_bytes(new.numpy().tobytes())
        os.replace(nvme_dir / "tmp.bin", path)
    back = on_fake_cuda(torch.zeros(8192, dtype=torch.uint8))
    assert h.sync_pread(back, path) == 1
    assert torch.equal(plain(back), plain(new))
    assert file_bytes(path) == new.numpy().tobytes()
    # The old file has no name left: its handle was closed when the new one opened.
    assert len(kv.files) == 2 and kv.files[0].closed and kv.open_files() == [kv.files[1]]


def test_an_fd_target_shares_the_handle_of_its_file(kv, nvme_dir):
    h = nvmeio.gds_handle()
    path = nvme_dir / "fd.bin"
    src = fake_cuda_bytes(5000, 3)
    h.sync_pwrite(src, path)
    back = on_fake_cuda(torch.zeros(5000, dtype=torch.uint8))
    for _ in range(2):
        fd = os.open(path, os.O_RDWR)
        try:
            assert h.sync_pread(back, fd) == 1
        finally:
            os.close(fd)
    assert torch.equal(plain(back), plain(src)) and kv.opened == ["r+"]


def test_a_failed_op_closes_its_handle_and_the_next_op_reopens_the_file(kv, nvme_dir):
    h = nvmeio.gds_handle()
    path = nvme_dir / "f.bin"
    h.sync_pwrite(fake_cuda_bytes(4096, 1), path)
    kv.fail = RuntimeError("cuFile error: boom")
    with pytest.raises(nvmeio.AioError, match="boom"):
        h.sync_pwrite(fake_cuda_bytes(4096, 2), path)
    assert kv.open_files() == []
    kv.fail = None
    good = fake_cuda_bytes(4096, 3)
    assert h.sync_pwrite(good, path) == 1
    assert kv.opened == ["r+", "r+"] and file_bytes(path) == good.numpy().tobytes()


class FakeFile:
    def __init__(self, path, flags, log):
        self.fd = os.open(path, os.O_RDWR if flags == "r+" else os.O_RDONLY)
        self.path, self.flags, self.closed = path, flags, False
        log.append(self)

    def fileno(self):
        return self.fd

    def close(self):
        self.closed = True
        os.close(self.fd)


def test_the_least_recently_used_handle_is_closed_past_the_limit(nvme_dir):
    made = []
    cache = CuFileCache(lambda path, flags: FakeFile(path, flags, made), limit=2)
    paths = [str(nvme_dir / f"{i}.bin") for i in range(3)]
    for p in paths:
        open(p, "wb").close()
    a, b = cache.get(paths[0], False), cache.get(paths[1], True)
    assert cache.get(paths[0], False) is a  # a is now the most recently used
    cache.get(paths[2], False)               # past the limit: b goes
    assert len(cache) == 2 and b.closed and not a.closed
    assert cache.get(paths[1], False) is not b and a.closed  # b reopened, a the oldest now
    cache.close()
    assert len(cache) == 0 and all(f.closed for f in made) and len(made) == 4
    with pytest.raises(FileNotFoundError):
        cache.get(str(nvme_dir / "missing.bin"), False)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        CuFileCache(lambda path, flags: None, limit=0)


def test_kvikio_posix_reads_use_o_direct_unless_told_otherwise(monkeypatch):
    kv = install(monkeypatch, FakeKvikio())
    monkeypatch.delenv("KVIKIO_AUTO_DIRECT_IO_READ", raising=False)
    nvmeio.gds_handle()
    assert kv.auto_direct_io_read is True
    for name, value in [("KVIKIO_AUTO_DIRECT_IO_READ", "0"), ("NVMEIO_DIRECT_IO", "0")]:
        kv = install(monkeypatch, FakeKvikio())
        with monkeypatch.context() as m:
            m.setenv(name, value)
            nvmeio.gds_handle()
        assert kv.auto_direct_io_read is False, name
    kv = install(monkeypatch, FakeKvikio(new_api=False))  # no such setting: nothing to do
    nvmeio.gds_handle()
    assert kv.auto_direct_io_read is False


# -- on a GPU with kvikio --------------------------------------------------------------------------

@needs_gds
@pytest.mark.parametrize("route", ["cufile", "staging"])  # each path, whichever this machine would take
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("numel,offset", [(1, 0), (1023, 4096 + 7), ((5 << 20) + 3, 123_457)])
def test_gpu_round_trip_matches_the_cpu_path(nvme_dir, monkeypatch, route, dtype, numel, offset):
    monkeypatch.setenv("NVMEIO_GDS_STAGING", "1" if route == "staging" else "0")
    h = nvmeio.gds_handle(intra_op_parallelism=4)
    assert h.get_device_path() == route
    src = torch.randint(0, 255, (numel,), dtype=torch.uint8, device="cuda").to(dtype)
    assert h.sync_pwrite(src, nvme_dir / "g.bin", file_offset=offset) == 1
    nvmeio.aio_handle().sync_pwrite(src.cpu(), nvme_dir / "c.bin", file_offset=offset)
    assert file_bytes(nvme_dir / "g.bin") == file_bytes(nvme_dir / "c.bin")
    dst = torch.empty_like(src)
    assert h.sync_pread(dst, nvme_dir / "g.bin", file_offset=offset) == 1
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


GDS_MODE_CODE = r"""
import json, sys, torch, nvmeio
h = nvmeio.gds_handle()
t = torch.arange(1 << 21, dtype=torch.int32, device="cuda")  # 8 MiB: past kvikio's GDS threshold
h.sync_pwrite(t, sys.argv[1])
h.sync_pread(t, sys.argv[1])
with open("/proc/self/maps") as f:
    cufile_loaded = "libcufile" in f.read()
print(json.dumps({"compat": h.get_compat_mode(), "io_mode": h.get_io_mode(), "cufile_loaded": cufile_loaded}))
"""


def kvikio_compat_mode_expected(cufile_loaded: bool) -> bool:
    """kvikio's rule (``defaults::infer_compat_mode_if_auto`` and ``is_cufile_available`` in its C++
    library): KVIKIO_COMPAT_MODE=ON or OFF decides; AUTO, the default, runs POSIX I/O unless
    libcufile.so.0 loads, /run/udev is readable and this is not WSL."""
    setting = os.environ.get("KVIKIO_COMPAT_MODE", "AUTO").strip().lower()
    if setting in ("on", "true", "yes", "1"):
        return True
    if setting in ("off", "false", "no", "0"):
        return False
    with open("/proc/sys/kernel/osrelease") as f:
        wsl = "microsoft" in f.read().lower()
    return not (cufile_loaded and os.access("/run/udev", os.R_OK) and not wsl)


@needs_gds
def test_gpu_compat_mode_is_what_kvikio_decides_for_this_machine(nvme_dir):
    """In a fresh process (where nothing but kvikio loads libcufile): compatibility mode is on
    exactly where kvikio's rule puts it (no libcufile, no /run/udev, WSL, or the environment
    variable), and the I/O path reported matches it."""
    got = run_child(GDS_MODE_CODE, str(nvme_dir / "m.bin"))
    assert got["compat"] is kvikio_compat_mode_expected(got["cufile_loaded"]), got
    if got["compat"]:
        assert got["io_mode"] == "posix", got
    else:
        assert got["cufile_loaded"] and got["io_mode"] in ("gds", "cufile-compat", "cufile"), got


@needs_gds
def test_gpu_pinned_device_tensors_and_async_ops_overlapping_compute(nvme_dir):
    h = nvmeio.gds_handle(intra_op_parallelism=4)
    t = h.new_pinned_device_tensor(8 << 20, torch.empty(0, dtype=torch.float32, device="cuda"))
    small = [h.new_pinned_device_tensor(1000, torch.empty(0, device="cuda")) for _ in range(3)]
    assert t.is_cuda and t.dtype == torch.float32 and h.is_pinned(t)
    t.copy_(torch.randn(8 << 20, device="cuda") * 2)   # not synchronized before the write
    h.async_pwrite(t, nvme_dir / "p.bin")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        a = torch.tanh(a @ a)
    assert h.wait() == 1
    assert file_bytes(nvme_dir / "p.bin") == t.cpu().numpy().tobytes()
    back = h.new_pinned_device_tensor(8 << 20, t)
    assert h.sync_pread(back, nvme_dir / "p.bin") == 1 and torch.equal(back, t)
    for x in [t, back, *small]:
        assert h.free_pinned_device_tensor(x)
    assert not h.is_pinned(t)
