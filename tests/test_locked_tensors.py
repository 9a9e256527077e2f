"""new_cpu_locked_tensor / free_cpu_locked_tensor / is_pinned."""

import os
import sys

import pytest
import torch

import nvmeio
from helpers import is_root, run_process


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_locked_tensor_is_aligned_typed_and_pinned(dtype):
    h = nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(12345, torch.empty(3, dtype=dtype))
    assert t.dtype == dtype and t.shape == (12345,) and t.device.type == "cpu"
    assert t.data_ptr() % 4096 == 0
    assert h.is_pinned(t) and h.is_pinned(t[100:200])
    assert not h.is_pinned(torch.empty(10, dtype=dtype))
    h.free_cpu_locked_tensor(t)
    assert not h.is_pinned(t)


def test_memory_stays_valid_after_free():
    h = nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0))
    t.fill_(2.5)
    h.free_cpu_locked_tensor(t)
    t += 1
    assert torch.all(t == 3.5)


def test_free_returns_true_when_it_freed_the_tensor():
    h = nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(100, torch.empty(0))
    assert h.free_cpu_locked_tensor(t) is True
    assert not h.is_pinned(t)


def test_free_of_a_tensor_the_handle_did_not_allocate_returns_false_as_deepspeed_does():
    h, other = nvmeio.aio_handle(), nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(100, torch.empty(0))
    assert other.free_cpu_locked_tensor(t) is False         # another handle's
    assert h.is_pinned(t)                                    # ... left locked
    assert h.free_cpu_locked_tensor(torch.empty(100)) is False
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False              # freed already


def test_bad_arguments():
    h = nvmeio.aio_handle()
    with pytest.raises(ValueError, match="num_elem"):
        h.new_cpu_locked_tensor(-1, torch.empty(0))
    with pytest.raises(TypeError, match="example_tensor"):
        h.new_cpu_locked_tensor(10, "float32")
    assert h.new_cpu_locked_tensor(0, torch.empty(0)).numel() == 0


def test_mlock_refused_falls_back_visibly():
    # Without CAP_IPC_LOCK and with a 1 MiB memlock limit, locking 64 MiB
    # fails: the tensor still works, is_pinned says False, a warning says why.
    if not is_root():
        pytest.skip("needs root to drop CAP_IPC_LOCK from a child process")
    code = (
        "import resource, warnings, torch, nvmeio\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))\n"
        "h = nvmeio.aio_handle()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    t = h.new_cpu_locked_tensor(16 << 20, torch.empty(0))\n"
        "t.fill_(1.0)\n"
        "print('pinned', h.is_pinned(t), 'sum', int(t.sum()))\n"
        "print('warning', w[0].message)\n"
    )
    out = run_process(["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
                       sys.executable, "-c", code])
    if out.returncode and "setpriv" in out.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert f"pinned False sum {16 << 20}" in out.stdout
    assert "could not lock 67108864 bytes" in out.stdout and "memlock limit 1048576 bytes" in out.stdout


def test_large_locked_tensor_sits_on_a_huge_page_boundary():
    # See [Note: huge pages for I/O buffers] in native/locked.cpp.
    h = nvmeio.aio_handle()
    t = h.new_cpu_locked_tensor(3 << 20, torch.empty(0, dtype=torch.uint8))
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(9)
    assert int(t.sum()) == 9 * (3 << 20)
    small = h.new_cpu_locked_tensor(100, torch.empty(0))
    assert small.data_ptr() % 4096 == 0


def _thp_eligible(address: int) -> bool:
    """The smaps THPeligible flag of the mapping holding ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_unlocked_io_buffers_sit_on_huge_pages_and_the_swap_pool_uses_them():
    # pin_memory off (the default) still gets huge-page memory: a direct request from 4 KiB
    # pages is split by the device (see nvmeio._locked.huge_page_tensor).
    from nvmeio._locked import huge_page_tensor
    from swapper._buffer_pool import PinnedBufferPool

    t = huge_page_tensor(5 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 5 << 20 and t.data_ptr() % (2 << 20) == 0
    t.fill_(3)
    assert int(t.sum()) == 3 * (5 << 20)
    assert huge_page_tensor(0).numel() == 0
    pool = PinnedBufferPool(buffer_count=2, buffer_size=1 << 20, dtype=torch.float32, pin_memory=False)
    base = pool._storage.data_ptr()
    assert base % (2 << 20) == 0
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("this kernel gives no transparent huge pages (THP off or absent)")
    assert _thp_eligible(t.data_ptr()) and _thp_eligible(base)
