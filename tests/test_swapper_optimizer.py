"""PartitionedOptimizerSwapper: master + states (+ gradient) of each sub-group in, step, out."""
import errno
import os

import pytest
import torch

from nvmeio import faults
from swapper import PartitionedOptimizerSwapper, SwapCorruptionError, SwapStateError
from swapper._sub_group import SubGroupState

SIZES = [5, 1000, 4097, 33]


def _randn(n, seed, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.fixture
def make(tmp_path, swappers):
    return lambda **kwargs: swappers(PartitionedOptimizerSwapper(tmp_path, {"queue_depth": 8}, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_of_master_and_states(make, dtype):
    s = make(dtype=dtype)
    data = {}
    for i, n in enumerate(SIZES):
        s.register_sub_group(i, n)
    for i, n in enumerate(SIZES):
        data[i] = (_randn(n, i, dtype), _randn(n, 100 + i, dtype), _randn(n, 200 + i, dtype).abs())
        s.initialize(i, data[i][0], {"exp_avg": data[i][1], "exp_avg_sq": data[i][2]})
        assert s.state(i) is SubGroupState.ON_NVME
    for i in reversed(range(len(SIZES))):
        t = s.swap_in(i)
        assert torch.equal(t.master, data[i][0])
        assert torch.equal(t.exp_avg, data[i][1]) and torch.equal(t.exp_avg_sq, data[i][2])
        assert t.grad is None
        s.release(i)
    assert s.pool.free_count == s.pool.buffer_count == 1


def test_states_start_at_zero_and_the_file_holds_aligned_regions(make):
    s = make()
    layout = s.register_sub_group(0, 1001)
    s.initialize(0, torch.ones(1001))
    path = s.swap_dir.file("subgroup0.swp")
    assert os.path.getsize(path) == layout.written_bytes == 4096 + 3 * 4096  # a header page, 3 regions
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4096] == bytes(4096)  # left for a checkpoint's header
    assert raw[4096:4096 + 4004] == torch.ones(1001).numpy().tobytes()
    assert raw[8192:8192 + 4004] == bytes(4004) and raw[12288:12288 + 4004] == bytes(4004)


def test_step_runs_the_function_on_every_sub_group_in_order_and_persists(make):
    s = make()
    for i, n in enumerate(SIZES):
        s.register_sub_group(i, n)
    for i, n in enumerate(SIZES):
        s.initialize(i, torch.full((n,), float(i)))
    seen = []

    def fn(sg, t):
        seen.append(sg)
        t.master.mul_(2)
        t.exp_avg.add_(sg + 1)

    stats = s.step(fn, [3, 1, 0, 2])
    assert seen == [3, 1, 0, 2] and stats.sub_groups == 4
    s.step(fn)
    for i, n in enumerate(SIZES):
        t = s.swap_in(i)
        assert torch.equal(t.master, torch.full((n,), 4.0 * i))
        assert torch.equal(t.exp_avg, torch.full((n,), 2.0 * (i + 1)))
        s.release(i)


def test_gradients_written_in_pieces_reach_the_step_and_are_consumed(make):
    s = make(swap_gradients=True, checksum="crc32")
    for i, n in enumerate(SIZES):
        s.register_sub_group(i, n)
    for i, n in enumerate(SIZES):
        s.initialize(i, torch.zeros(n))
    grads = {i: _randn(n, i) for i, n in enumerate(SIZES)}
    for i, n in enumerate(SIZES):
        cut = n // 3
        tickets = s.swap_out_gradients(i, grads[i][cut:], offset=cut)
        tickets += s.swap_out_gradients(i, grads[i][:cut].double(), offset=0)  # converted to fp32
    got = {}

    def fn(sg, t):
        got[sg] = t.grad.clone()
        t.master.sub_(t.grad)

    s.step(fn)
    assert all(torch.equal(got[i], grads[i]) for i in grads)
    s.step(lambda sg, t: None if t.grad is None else pytest.fail("gradient not consumed"))
    t = s.swap_in(1)
    assert torch.equal(t.master, -grads[1])
    s.release(1)


def test_a_partial_gradient_is_refused(make):
    s = make(swap_gradients=True)
    s.register_sub_group(0, 100)
    s.initialize(0, torch.zeros(100))
    s.swap_out_gradients(0, torch.ones(60), offset=0)
    s.swap_out_gradients(0, torch.ones(30), offset=50)
    with pytest.raises(SwapStateError, match="covers 80 of 100 elements"):
        s.swap_in(0)
    with pytest.raises(ValueError, match="fall outside"):
        s.swap_out_gradients(0, torch.ones(10), offset=95)


def test_a_gradient_whose_write_failed_is_never_read(make):
    s = make(swap_gradients=True, checksum=None)  # no checksum to catch what was not written
    s.register_sub_group(0, 1000)
    s.initialize(0, torch.full((1000,), 3.0))
    with faults.inject(fail_nth=1, errno="EIO", op="write"):
        s.swap_out_gradients(0, torch.ones(1000))  # asynchronous: the failure comes later
        with pytest.raises(OSError, match="Input/output error") as info:
            s.wait_gradients()
    assert info.value.errno == errno.EIO
    lost = r"the gradient of sub-group 0 was never written to .*subgroup0.*it is lost; drop_gradients\(0\)"
    for use in (s.wait_gradients, lambda: s.swap_in(0), lambda: s.swap_in_gradients(0, torch.empty(1000))):
        with pytest.raises(SwapCorruptionError, match=lost):
            use()
    s.drop_gradients(0)
    t = s.swap_in(0)
    assert t.grad is None and torch.equal(t.master, torch.full((1000,), 3.0))
    s.release(0)
    s.swap_out_gradients(0, torch.full((1000,), 2.0))  # the next gradient is written and read
    s.step(lambda sg, t: t.master.sub_(t.grad))
    assert torch.equal(s.swap_in(0).master, torch.ones(1000))
    s.release(0)


def test_gradients_need_the_switch(make):
    s = make()
    s.register_sub_group(0, 4)
    with pytest.raises(SwapStateError, match="swap_gradients=False"):
        s.swap_out_gradients(0, torch.ones(4))


def test_a_failing_step_function_returns_buffers_and_keeps_each_sub_group_whole(make):
    s = make()
    for i in range(3):
        s.register_sub_group(i, 10)
    for i in range(3):
        s.initialize(i, torch.zeros(10))

    def fn(sg, t):
        t.master.add_(1)
        if sg == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        s.step(fn)
    assert s.pool.free_count == s.pool.buffer_count
    masters = []
    for i in range(3):
        masters.append(s.swap_in(i).master[0].item())
        s.release(i)
    assert masters == [1.0, 0.0, 0.0]


def test_custom_state_names(make):
    s = make(state_names=("momentum_buffer",))
    s.register_sub_group(0, 7)
    s.initialize(0, torch.ones(7), {"momentum_buffer": torch.full((7,), 2.0)})
    t = s.swap_in(0)
    assert list(t.states) == ["momentum_buffer"] and torch.equal(t.states["momentum_buffer"], torch.full((7,), 2.0))
    s.release(0)
    with pytest.raises(ValueError, match="unknown optimizer states"):
        s.initialize(0, torch.ones(7), {"exp_avg": torch.ones(7)})


def test_buffer_count_below_the_schedule_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needs buffer_count >= 1, got 0|positive integer"):
        PartitionedOptimizerSwapper(tmp_path, None, buffer_count=0)
    assert os.listdir(tmp_path) == []


def test_uninitialized_sub_groups_cannot_be_stepped(make):
    s = make()
    s.register_sub_group(0, 4)
    with pytest.raises(SwapStateError, match="never initialized"):
        s.step(lambda sg, t: None)
    with pytest.raises(ValueError, match="registered already"):
        s.register_sub_group(0, 4)


def test_stored_file_and_import_state_move_bytes_file_to_file(make, tmp_path):
    s = make()
    n = 4097
    s.register_sub_group(0, n)
    master, m, v = _randn(n, 1), _randn(n, 2), _randn(n, 3).abs()
    s.initialize(0, master, {"exp_avg": m, "exp_avg_sq": v})
    t = s.swap_in(0)
    t.master.add_(1.0)  # held in memory, changed: stored_file writes it out first
    path, offsets = s.stored_file(0)
    assert s.state(0) is SubGroupState.ON_NVME and set(offsets) == {"master", "exp_avg", "exp_avg_sq"}
    raw = open(path, "rb").read()
    for name, want in (("master", master + 1.0), ("exp_avg", m), ("exp_avg_sq", v)):
        got = torch.frombuffer(bytearray(raw[offsets[name]:offsets[name] + 4 * n]), dtype=torch.float32)
        assert torch.equal(got, want), name

    source = tmp_path / "elsewhere.bin"  # e.g. a checkpoint shard: tensors back to back, unaligned
    new = [_randn(n, 10 + i) for i in range(3)]
    source.write_bytes(b"x" * 13 + b"".join(t.numpy().tobytes() for t in new))
    s.import_state(0, {name: (str(source), 13 + 4 * n * i)
                       for i, name in enumerate(("master", "exp_avg", "exp_avg_sq"))})
    t = s.swap_in(0)
    assert torch.equal(t.master, new[0]) and torch.equal(t.exp_avg, new[1]) and torch.equal(t.exp_avg_sq, new[2])
    s.release(0)
    with pytest.raises(ValueError, match="exactly"):
        s.import_state(0, {"master": (str(source), 0)})
    source.unlink()


def test_link_state_and_adopt_file_share_the_file_and_never_change_it(make, tmp_path):
    s = make()
    n = 1001
    s.register_sub_group(0, n)
    master = _randn(n, 1)
    s.initialize(0, master)
    header = b"H" * 4096
    dest = tmp_path / "shard.bin"
    assert s.link_state(0, str(dest), header)  # no byte copied: the swap file is also `dest`
    path = s.swap_dir.file("subgroup0.swp")
    assert os.path.samefile(path, dest) and dest.read_bytes()[:4096] == header
    kept = dest.read_bytes()
    t = s.swap_in(0)
    t.master.add_(1.0)
    s.swap_out(0)  # goes to a new file
    assert not os.path.samefile(path, dest) and dest.read_bytes() == kept
    assert not s.link_state(0, str(tmp_path / "x"), b"short")  # a header must fill the page

    assert s.adopt_file(0, str(dest), s.stored_file(0)[1])  # back: the shard becomes the swap file
    assert os.path.samefile(path, dest)
    t = s.swap_in(0)
    assert torch.equal(t.master, master)
    t.master.add_(2.0)
    s.swap_out(0)
    assert dest.read_bytes() == kept  # the adopted file is left alone too
    dest.unlink()


@pytest.mark.parametrize("checksum", [None, "crc32"])
def test_a_linked_state_file_never_changes_while_gradients_come_and_go(tmp_path, swappers, checksum):
    """The gradient has a file of its own: writing it, reading it with the state, stepping and
    swapping out leave a linked (checkpointed) state file byte-identical."""
    s = swappers(PartitionedOptimizerSwapper(tmp_path, {"queue_depth": 8}, swap_gradients=True,
                                             checksum=checksum))
    n = 1000
    s.register_sub_group(0, n)
    master = _randn(n, 1)
    s.initialize(0, master)
    dest = tmp_path / "shard.bin"
    assert s.link_state(0, str(dest), b"H" * 4096)
    kept = dest.read_bytes()
    grad = _randn(n, 2)
    s.swap_out_gradients(0, grad[:400])
    s.swap_out_gradients(0, grad[400:], offset=400)
    assert os.path.getsize(s.swap_dir.file("subgroup0.grad")) == n * 4
    assert dest.read_bytes() == kept  # the gradient went to its own file
    assert s.link_state(0, str(tmp_path / "again.bin"), b"H" * 4096)  # linked twice: not rewritten
    assert not s.link_state(0, str(tmp_path / "other.bin"), b"X" * 4096)  # another header: refused
    assert not (tmp_path / "other.bin").exists() and dest.read_bytes() == kept
    back = torch.empty(n)
    s.swap_in_gradients(0, back)
    assert torch.equal(back, grad)
    s.step(lambda sg, t: t.master.sub_(t.grad))
    assert dest.read_bytes() == kept and (tmp_path / "again.bin").read_bytes() == kept
    t = s.swap_in(0)
    assert torch.equal(t.master, master - grad) and t.grad is None
    s.release(0)
    assert torch.equal(torch.frombuffer(bytearray(kept[4096:4096 + n * 4]), dtype=torch.float32), master)
    dest.unlink()
    (tmp_path / "again.bin").unlink()


def test_a_file_adopted_with_carried_checksums_is_verified_at_swap_in(make, tmp_path):
    """stored_checksums are what a checkpoint carries; adopt_file takes them back: the adopted
    file's swap-ins verify against them, and a swapper with checksums refuses a file that
    carries none or another algorithm's."""
    from swapper import SwapCorruptionError

    s = make(checksum="crc32")
    n = 1001
    s.register_sub_group(0, n)
    master = _randn(n, 3)
    s.initialize(0, master)
    path, offsets = s.stored_file(0)
    digests = s.stored_checksums(0)
    assert set(digests) == {"master", "exp_avg", "exp_avg_sq"}
    dest = tmp_path / "shard.bin"
    assert s.link_state(0, str(dest), b"H" * 4096)
    t = s.swap_in(0)
    t.master.add_(1.0)
    s.swap_out(0)  # a new file: the shard keeps the state that digests describe
    assert not s.adopt_file(0, str(dest), offsets)  # no checksums carried
    assert not s.adopt_file(0, str(dest), offsets, ("xxhash", digests))
    assert s.adopt_file(0, str(dest), offsets, ("crc32", digests))
    assert s.stored_checksums(0) == digests
    t = s.swap_in(0)
    assert torch.equal(t.master, master)
    s.release(0)
    with open(dest, "r+b") as f:  # damage inside the master region
        f.seek(4096 + 40)
        f.write(b"\xff\xff")
    with pytest.raises(SwapCorruptionError, match="sub-group 0"):
        s.swap_in(0)
    dest.unlink()
