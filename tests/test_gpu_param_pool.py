"""The parameter swap pool on the GPU with ``aio.use_gds`` (swapper/_pool_kind.py [Note: a parameter
pool on the GPU]).

Here the pool's memory is a CPU tensor that claims cuda:0 and the swapper's aio_handle moves it
through its staging pipeline over the fake CUDA backend of tests/test_cuda_paths.py (a gds_handle
does the same where cuFile has no GPUDirect path, and DMA with one): partitions written from host
values and read back, read ahead, stored in another owner's file and filled from memory are byte
for byte what was given, and every byte crossed through the device side. The engine's choice (the
pool on the GPU only with use_gds on a CUDA device; checksums off there, a named one refused) and
the memory model's place for the pool are checked directly; on a GPU with kvikio the last test
trains with use_gds against the same engine without it.
"""
import os

import pytest
import torch

import nvmeio
import swapper._span_pool as span_pool
from helpers import base_config, make_engine, train_engine
from swapper import PackedSpans, PartitionedParamSwapper
from swapper._param_swapper import swap_file_name
from test_cuda_paths import fake_cuda, on_fake_cuda, plain  # noqa: F401 - fake_cuda: a fixture
from test_gds_handle import FakeKvikio, install
from zero.config import ConfigError
from zero.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from zero.stores.param_store import gds_checksum, gds_pool
from zero.stores.rank_memory import DEVICE, HOST, RankSizes, rank_memory_parts

CUDA = torch.device("cuda", 0)
SIZES = {"a": 10_000, "b": 3, "c": 5000, "d": 7777}


@pytest.fixture
def device_pool(monkeypatch, fake_cuda):  # noqa: F811 - the fixture
    """Pool memory that claims cuda:0; returns the tensors made."""
    made = []

    def storage(nbytes, device):
        assert device == CUDA
        t = on_fake_cuda(torch.zeros(nbytes, dtype=torch.uint8))
        made.append(t)
        return t

    monkeypatch.setattr(span_pool, "device_storage", storage)
    return made


def make_swapper(path, **kwargs):
    return PartitionedParamSwapper(path, {"block_size": 4096}, buffer_count=4, buffer_size=10_000 + 2048, max_in_cpu=0,
                                   pool=PackedSpans(spare_buffers=1, device=CUDA), **kwargs)


def values():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(n, generator=g) for k, n in SIZES.items()}


def test_partitions_go_between_the_drive_and_a_pool_on_the_gpu(tmp_path, device_pool, fake_cuda):  # noqa: F811
    sw = make_swapper(tmp_path)
    data = values()
    for k, v in data.items():
        sw.register(k, v.numel())
    sw.swap_out_tensors(list(data), list(data.values()))  # host values into the GPU's spans, then to NVMe
    for k, v in data.items():  # the files hold the bytes given
        with open(sw.swap_dir.file(swap_file_name(k)), "rb") as f:
            assert f.read(v.numel() * 4) == v.numpy().tobytes()
    copies = fake_cuda.copies
    assert copies > 0  # the writes went through the device side
    for k, v in data.items():
        got = sw.swap_in([k])[0]
        assert got.device == CUDA and torch.equal(plain(got), v)
        sw.release([k])
    assert sw.read_ahead(["a", "c"]) == 2
    got = sw.swap_in(["a", "c"])
    assert all(t.device == CUDA for t in got)
    assert torch.equal(plain(got[0]), data["a"]) and torch.equal(plain(got[1]), data["c"])
    sw.release(["a", "c"])
    assert fake_cuda.copies > copies and len(device_pool) == 1
    sw.cleanup()


def test_homed_partitions_are_read_from_their_owners_file_and_filled_from_memory(tmp_path, device_pool):
    data = values()
    base = 4096 + 8  # homes off a page, as in an optimizer's file
    owner = tmp_path / "owner.swp"
    owner.write_bytes(b"\xab" * base + torch.cat(list(data.values())).numpy().tobytes() + b"\xcd" * 8192)
    homes, offset = {}, base
    for k, v in data.items():
        homes[k] = (str(owner), offset)
        offset += v.numel() * 4
    (tmp_path / "swap").mkdir()
    sw = make_swapper(tmp_path / "swap")
    for k, v in data.items():
        sw.register(k, v.numel())
    sw.store_at(list(data), [homes[k] for k in data], list(data.values()))
    sw.release(list(data))
    for k, v in data.items():  # read from the owner's file into the GPU's spans
        assert torch.equal(plain(sw.swap_in([k])[0]), v)
        sw.release([k])
    sw.fill(["b", "d"], [data["b"], data["d"]])  # the owner's values in memory: copied in, no read
    got = sw.swap_in(["b", "d"])
    assert torch.equal(plain(got[0]), data["b"]) and torch.equal(plain(got[1]), data["d"])
    sw.release(["b", "d"])
    sw.cleanup()


def test_a_pool_on_the_gpu_takes_no_checksum(tmp_path, device_pool):
    with pytest.raises(ValueError, match="checksum=None with a device pool"):
        make_swapper(tmp_path, checksum="crc32")
    assert not os.path.exists(tmp_path / "default")  # refused before any directory was made


@pytest.mark.parametrize("compat,gds,on_gpu", [(False, True, True), (False, None, True),
                                               (True, None, False), (False, False, False)])
def test_the_engine_puts_the_pool_on_the_gpu_only_where_cufile_moves_it(monkeypatch, compat, gds, on_gpu):
    """use_gds, a CUDA device, swap files on one drive and a GPUDirect path (cuFile with the GDS
    driver, or cuFile deciding): the pool is GPU memory; without GPUDirect (kvikio's compatibility
    mode, cuFile without the driver) it stays in host memory, as it would bounce there anyway."""
    install(monkeypatch, FakeKvikio(compat=compat, gds_available=gds))
    gds_settings, plain_aio = nvmeio.AioSettings(use_gds=True), nvmeio.AioSettings()
    assert gds_pool(gds_settings, CUDA) is on_gpu and gds_pool({"use_gds": True}, "cuda") is on_gpu
    assert not gds_pool(gds_settings, torch.device("cpu")) and not gds_pool(plain_aio, CUDA)
    assert not gds_pool(gds_settings, CUDA, striped=True)  # a striped file takes host buffers


@pytest.mark.skipif(nvmeio.gds_unavailable_reason() is None, reason="a gds_handle can be made here: the "
                    "case without one cannot be shown")
def test_the_engine_puts_the_pool_on_the_gpu_only_with_kvikio():
    assert not gds_pool(nvmeio.AioSettings(use_gds=True), CUDA)  # no kvikio here: no gds_handle


def test_a_pool_on_the_gpu_that_cufile_cannot_register_warns_and_works(tmp_path, device_pool):
    class Refusing:
        def pin_device_tensor(self, t):
            raise RuntimeError("cuFile could not register 1 MiB of device memory: BAR1 exhausted")

    with pytest.warns(RuntimeWarning, match="could not be registered with cuFile.*BAR1"):
        pool = span_pool.SpanPool(1 << 20, handle=Refusing(), device=CUDA)
    span = pool.take([5000])[0]
    assert span.tensor.device == CUDA and span.nbytes >= 5000
    pool.release([span])
    pool.close()


def test_the_checksum_of_a_pool_on_the_gpu():
    assert gds_checksum("auto") is None and gds_checksum("none") is None  # DeepSpeed's GDS path has none either
    with pytest.raises(ConfigError, match="offload_param.checksum.*'xxhash' hashes the host bytes"):
        gds_checksum("xxhash")


def test_the_memory_model_counts_the_pool_on_the_device():
    sizes = RankSizes(world_size=1, total=10_000_000, shard=10_000_000, largest_shard=1_000_000,
                      largest_unit=1_000_000, largest_sub_group=10_000_000)
    zc = base_config("nvme", "cpu", "/tmp")["zero_optimization"]
    section = OffloadParamConfig(**{**zc["offload_param"], "buffer_count": 5, "pin_memory": True})
    optimizer = OffloadOptimizerConfig(**zc["offload_optimizer"])

    def pool(gds, compute, param=section):
        parts = rank_memory_parts(sizes, stage=3, offload_param=param, offload_optimizer=optimizer, itemsize=2,
                                  compute_device=compute, gds_param_pool=gds)
        return next(p for p in parts if p.what.startswith("parameter swap buffers"))

    assert pool(False, "cuda").where == HOST and pool(False, "cuda").locked
    on_gpu = pool(True, "cuda")
    assert on_gpu.where == DEVICE and not on_gpu.locked and on_gpu.nbytes == 5 * 1_000_000 * 2
    striped = section.model_copy(update={"nvme_path": ["/tmp", "/var/tmp"]})
    assert pool(True, "cuda", striped).where == HOST  # striped files take host buffers


@pytest.mark.cuda
@pytest.mark.skipif(nvmeio.gds_unavailable_reason() is not None, reason="needs a CUDA GPU and kvikio "
                    "(pip install nvmeio[gds])")
def test_gpu_training_with_use_gds_equals_training_without(tmp_path, monkeypatch):
    """With cuFile forced (a machine without the GDS driver would keep the pool in host memory), the
    pool is GPU memory and training equals the host pool's exactly."""
    from zero.examples import GPTConfig, make_batches

    monkeypatch.setenv("NVMEIO_GDS_STAGING", "0")

    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 4, 4)]
    losses = {}
    for use_gds in (False, True):
        engine = make_engine(tmp_path / str(use_gds), checksum="none",
                             overrides={"compute_device": "cuda", "aio": {"use_gds": use_gds}})
        assert engine.parts.param_store.swapper.pool.device == (CUDA if use_gds else None)
        losses[use_gds] = train_engine(engine, batches, 4)
        engine.destroy()
    assert losses[True] == losses[False]
