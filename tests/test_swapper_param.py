"""PartitionedParamSwapper: round trips, states, max_in_cpu, buffer sizing, stable file names."""
import os

import pytest
import torch

from swapper import BufferTooSmallError, PartitionedParamSwapper, PoolExhaustedError, SwapStateError
from swapper._param_swapper import PartitionState, swap_file_name

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]


def _data(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 127, (numel,), generator=g, dtype=dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _disk_bytes(root):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(root) for f in files)


@pytest.fixture
def swapper_factory(tmp_path, swappers):
    def make(buffer_count=4, buffer_size=None, max_in_cpu=0, **kwargs):
        return swappers(
            PartitionedParamSwapper(
                tmp_path, {"queue_depth": 8}, buffer_count=buffer_count, buffer_size=buffer_size,
                max_in_cpu=max_in_cpu, **kwargs,
            )
        )

    return make


@pytest.mark.parametrize("async_op", [False, True])
def test_round_trip_of_many_partitions_of_odd_sizes_and_dtypes(swapper_factory, async_op):
    s = swapper_factory(buffer_count=3)
    sizes = [1, 2, 3, 17, 255, 1000, 4097, 12345, 7, 64]
    data = {f"layer{i}.weight": _data(n, DTYPES[i % len(DTYPES)], i) for i, n in enumerate(sizes)}
    for pid, t in data.items():
        assert s.register(pid, t.numel(), t.dtype) is PartitionState.UNWRITTEN
    s.swap_out_tensors(list(data), list(data.values()), async_op=async_op)
    s.synchronize()
    for pid, t in data.items():
        assert s.state(pid) is PartitionState.ON_NVME
        with open(s.swap_dir.file(swap_file_name(pid)), "rb") as f:
            assert f.read() == _raw(t)
    ids = list(data)
    for batch in (ids[0:3], ids[3:6], ids[6:9], ids[9:]):
        out = s.swap_in(batch, async_op=async_op)
        if async_op:
            assert all(s.state(p) is PartitionState.READING for p in batch)
            s.synchronize()
        for pid, t in zip(batch, out):
            assert s.state(pid) is PartitionState.AVAILABLE
            assert t.dtype == data[pid].dtype and torch.equal(t, data[pid])
        s.release(batch)
    assert s.pool.free_count == 3


def test_changes_to_a_swapped_in_tensor_persist_through_swap_out(swapper_factory):
    s = swapper_factory()
    s.register(0, 100)
    s.swap_out_tensors([0], [torch.zeros(100)])
    (t,) = s.swap_in([0])
    t.add_(3)
    s.swap_out([0], async_op=True)
    assert s.state(0) is PartitionState.WRITING
    s.synchronize()
    assert s.state(0) is PartitionState.ON_NVME and s.pool.free_count == 4
    assert torch.equal(s.swap_in([0])[0], torch.full((100,), 3.0))


def test_swap_in_during_a_write_keeps_the_buffer_without_reading(swapper_factory):
    s = swapper_factory()
    s.register("w", 10)
    buf = s.get_buffer("w")
    buf.copy_(torch.arange(10.0))
    s.swap_out(["w"], async_op=True)
    (t,) = s.swap_in(["w"], async_op=True)
    assert t.data_ptr() == buf.data_ptr()
    s.synchronize()
    assert s.state("w") is PartitionState.AVAILABLE and torch.equal(t, torch.arange(10.0))
    s.release(["w"])  # clean: the file holds the same bytes
    assert s.state("w") is PartitionState.ON_NVME


def test_max_in_cpu_keeps_partitions_off_nvme_counted_in_bytes_on_disk(swapper_factory, tmp_path):
    sizes = [300, 500, 200, 1000, 50, 700]
    s = swapper_factory(max_in_cpu=1000, dtype=torch.float16)
    states = [s.register(i, n) for i, n in enumerate(sizes)]
    # first fit in registration order: 300 + 500 + 200 = 1000 elements stay in host memory
    assert states == [PartitionState.IN_CPU] * 3 + [PartitionState.UNWRITTEN] * 3
    assert s.cpu_numel == 1000 and s.nvme_bytes == (1000 + 50 + 700) * 2
    data = [_data(n, torch.float16, i) for i, n in enumerate(sizes)]
    s.swap_out_tensors(list(range(6)), data)
    assert _disk_bytes(tmp_path) == s.nvme_bytes
    assert sorted(os.listdir(s.swap_dir.path)) == sorted(swap_file_name(i) for i in (3, 4, 5))
    out = s.swap_in(list(range(6)))
    assert all(torch.equal(a, b) for a, b in zip(out, data))
    assert s.pool.free_count == 4 - 3  # host-resident partitions take no pool buffer


def test_buffer_size_none_sizes_buffers_from_the_largest_partition(swapper_factory):
    s = swapper_factory(buffer_size=None, dtype=torch.float32)
    s.register(0, 10)
    s.register(1, 1000, torch.float64)  # 8000 bytes = 2000 float32 elements
    assert s.pool is None
    s.swap_out_tensors([0, 1], [torch.ones(10), torch.ones(1000, dtype=torch.float64)])
    assert s.pool.buffer_size == 2000
    with pytest.raises(BufferTooSmallError, match="sized at first use"):
        s.register(2, 2001)


def test_explicit_buffer_size_too_small_is_refused_at_registration(swapper_factory):
    s = swapper_factory(buffer_size=1000, buffer_count=2)
    s.register("small", 1000)
    with pytest.raises(BufferTooSmallError) as info:
        s.register("big", 1001)
    message = str(info.value)
    assert "'big' has 1001 elements" in message and "4000 bytes per buffer" in message
    assert "buffer_size >= 1001" in message and "buffer_size=None" in message


def test_swap_in_beyond_the_free_buffers_names_the_holders(swapper_factory):
    s = swapper_factory(buffer_count=2)
    for i in range(3):
        s.register(i, 8)
    s.swap_out_tensors([0, 1, 2], [torch.ones(8)] * 3)
    s.swap_in([0])
    with pytest.raises(PoolExhaustedError, match=r"asks for 2 buffers but only 1 of 2 are free; held by: partition 0"):
        s.swap_in([1, 2])
    s.release([0])
    assert len(s.swap_in([1, 2])) == 2
    s.release([1, 2])
    with pytest.raises(PoolExhaustedError, match="asks for 3 buffers at once, but the pool has only 2"):
        s.swap_in([0, 1, 2])
    assert s.pool.free_count == 2


def test_writes_in_flight_give_their_buffers_to_a_swap_in(swapper_factory):
    s = swapper_factory(buffer_count=2)
    for i in range(4):
        s.register(i, 8)
    s.swap_out_tensors([0, 1, 2, 3], [torch.full((8,), float(i)) for i in range(4)], async_op=True)
    out = s.swap_in([0, 1])  # both buffers are busy writing 2 and 3: completed first, then reused
    assert [t[0].item() for t in out] == [0.0, 1.0]


def test_release_refuses_data_that_is_not_on_nvme(swapper_factory):
    s = swapper_factory()
    s.register(0, 4)
    s.get_buffer(0).fill_(1)
    with pytest.raises(SwapStateError, match="not on NVMe yet"):
        s.release([0])
    s.swap_out([0])
    s.release([0])  # nothing held: a no-op


def test_partitions_without_data_cannot_be_swapped(swapper_factory):
    s = swapper_factory(max_in_cpu=4)
    s.register("cpu", 4)
    s.register("nvme", 4)
    for pid in ("cpu", "nvme"):
        with pytest.raises(SwapStateError, match="never written"):
            s.swap_in([pid])
        with pytest.raises(SwapStateError, match="no data"):
            s.swap_out([pid])


def test_ids_are_stable_file_names():
    assert swap_file_name(12) == "param_12.swp"
    assert swap_file_name("model.layers.0.attn/q") == "param_model.layers.0.attn%2Fq.swp"
    long_id = "x" * 500
    assert swap_file_name(long_id) == swap_file_name(long_id) and len(swap_file_name(long_id)) < 255
    assert swap_file_name(long_id) != swap_file_name("x" * 499 + "y")


def test_registration_errors(swapper_factory):
    s = swapper_factory()
    s.register(1, 4)
    with pytest.raises(ValueError, match="registered already"):
        s.register("1", 4)  # same file name as the int id 1
    with pytest.raises(KeyError, match="not registered"):
        s.swap_in([2])
    with pytest.raises(TypeError):
        s.register(1.5, 4)
    with pytest.raises(ValueError):
        s.register(3, -1)


def test_remove_deletes_the_file_and_returns_the_buffer(swapper_factory):
    s = swapper_factory()
    s.register(0, 4)
    s.swap_out_tensors([0], [torch.ones(4)])
    s.swap_in([0])
    s.remove([0])
    assert os.listdir(s.swap_dir.path) == [] and s.pool.free_count == 4 and s.nvme_bytes == 0


def test_unknown_aio_config_key_gets_a_hint(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'queue_depth'"):
        PartitionedParamSwapper(tmp_path, {"queue_dept": 8})
    assert os.listdir(tmp_path) == []
