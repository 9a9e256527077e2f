"""Swap checksums are of the host bytes a swap file gets, never of the caller's tensor: a CUDA
tensor handed to the parameter swapper (``store_at``, the fp32 shards homed in the optimizer's
master) is digested after its copy to host memory, as the bytes written are.

Here a CPU stand-in for a CUDA tensor (tests/helpers.py ``OnFakeCuda``: its device says cuda:0
and its ``.numpy()`` refuses, as a CUDA tensor's does) goes where a GPU run's tensors go; on a
machine with a GPU the last test runs the engine's three paths that hand over CUDA tensors
(zero.initialize of a model on the GPU, GatheredParameters(modifier_rank=0) in training,
zero.load_pretrained into a built engine) on real ones.
"""
import pytest
import torch

import zero
from helpers import base_config, make_engine, on_fake_cuda, train_engine
from swapper import PartitionedParamSwapper, PartitionState
from swapper.checksum import ChecksumTable
from swapper._param_swapper import HOME_SLACK_BYTES
from zero.examples import GPT, GPTConfig, make_batches

SIZES = {"a": 1000, "b": 3, "c": 5000}
BASE = 4096 + 8  # a header page, then 8 bytes: the homes start off a page, as in an optimizer's file


@pytest.fixture
def owner(tmp_path_factory):
    """Another owner's file holding every partition's fp32 values back to back (then whole pages for
    the reads), and the homes."""
    g = torch.Generator().manual_seed(0)
    values = {k: torch.randn(n, generator=g) for k, n in SIZES.items()}
    path = tmp_path_factory.mktemp("owner") / "owner.swp"
    path.write_bytes(b"\xab" * BASE + torch.cat(list(values.values())).numpy().tobytes() + b"\xcd" * 5000)
    homes, offset = {}, BASE
    for key, n in SIZES.items():
        homes[key] = (str(path), offset)
        offset += n * 4
    return values, homes


def swapper(tmp_path, swappers):
    s = swappers(PartitionedParamSwapper(tmp_path, {"queue_depth": 8}, buffer_count=3, max_in_cpu=0,
                                         checksum="xxhash", buffer_size=max(SIZES.values()) + HOME_SLACK_BYTES // 4))
    for key, n in SIZES.items():
        s.register(key, n)
    return s


def test_store_at_digests_the_host_bytes_of_a_device_tensor(tmp_path, swappers, owner):
    values, homes = owner
    s = swapper(tmp_path, swappers)
    s.store_at(list(SIZES), [homes[k] for k in SIZES], [on_fake_cuda(values[k]) for k in SIZES])
    table = ChecksumTable("xxhash")
    for key in SIZES:
        assert s.state(key) is PartitionState.ON_NVME
        assert s._checksums.recorded(homes[key][0], homes[key][1], SIZES[key] * 4) == table.digest(values[key])
        assert torch.equal(s.swap_in([key])[0], values[key]), key  # read back, verified against that digest
        s.release([key])


def test_store_at_into_a_held_buffer_digests_the_buffer_it_filled(tmp_path, swappers, owner):
    values, homes = owner
    s = swapper(tmp_path, swappers)
    s.store_at(list(SIZES), [homes[k] for k in SIZES], [values[k] for k in SIZES])
    held = s.swap_in(["a"])[0]
    new = values["a"] * 2
    path, offset = homes["a"]
    with open(path, "r+b") as f:  # the owner writes the new values, as a step does
        f.seek(offset)
        f.write(new.numpy().tobytes())
    s.store_at(["a"], [homes["a"]], [on_fake_cuda(new)])
    assert s.state("a") is PartitionState.AVAILABLE and torch.equal(held, new)
    s.release(["a"])
    assert torch.equal(s.swap_in(["a"])[0], new)  # read again, verified against the new digest


def test_a_digest_of_a_device_tensor_is_refused_saying_to_copy_it_to_the_host():
    with pytest.raises(ValueError, match=r"a checksum is computed on host memory, got a tensor on cuda:0: copy it "
                                         r"to the host \(the staging buffer that is written\) first"):
        ChecksumTable("xxhash").digest(on_fake_cuda(torch.ones(4)))


def test_gathered_parameters_written_back_from_a_device_tensor_keep_their_checksums(tmp_path, monkeypatch):
    """GatheredParameters(modifier_rank=0) on several GPUs writes back the broadcast full value, a
    CUDA tensor, into fp32 shards homed in the optimizer's master on NVMe, checksums on (the default)."""
    engine = make_engine(tmp_path, "nvme", lr=1e-2)
    assert engine.parts.param_store.master is not None  # the homed case: store_at
    train_engine(engine, make_batches(GPTConfig(), 1, 4), 1)
    model = engine.module
    # Under NCCL the broadcast full value is on the GPU: the stand-in returns it "there".
    monkeypatch.setattr(engine.comm, "broadcast", lambda t, src: on_fake_cuda(t))
    with zero.GatheredParameters([model.head.weight], modifier_rank=0):
        model.head.weight.data.fill_(0.25)
    monkeypatch.undo()
    engine.parts.param_store.flush()
    with zero.GatheredParameters([model.head.weight]):  # read back from NVMe, verified
        assert torch.equal(model.head.weight, torch.full_like(model.head.weight, 0.25))
    train_engine(engine, make_batches(GPTConfig(), 1, 4), 1)  # trains on from it
    engine.destroy()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU stand-in covers the rest)")
def test_on_a_gpu_every_path_that_hands_over_cuda_tensors_keeps_checksums(tmp_path):
    c = GPTConfig()
    torch.manual_seed(0)
    model = GPT(c).cuda()  # a model already on the GPU
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2)
    config["compute_device"] = "cuda"  # the suite pins the CPU (tests/conftest.py)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    assert engine.device.type == "cuda" and engine.parts.param_store.master is not None
    train_engine(engine, make_batches(c, 1, 4), 1)
    with zero.GatheredParameters([model.head.weight], modifier_rank=0):
        model.head.weight.data.fill_(0.25)
    with zero.GatheredParameters([model.head.weight]):
        assert torch.equal(model.head.weight, torch.full_like(model.head.weight, 0.25))
    pretrained = GPT(c)  # the head is tied to the embedding, so named_parameters() lists it once
    zero.save_pretrained(pretrained, tmp_path / "pretrained")
    zero.load_pretrained(engine, tmp_path / "pretrained")
    with zero.GatheredParameters(list(model.parameters())):
        for name, p in pretrained.named_parameters():
            assert torch.equal(model.get_parameter(name).cpu(), p.detach()), name
    train_engine(engine, make_batches(c, 1, 4), 1)
    engine.destroy()
