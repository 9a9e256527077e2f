"""zero/runtime/write_back.py: a step's values reach shards on the GPU through a registered staging
ring, each copy asynchronous, and no region of the ring is written again before the copy that
reads it has run. The CUDA copy and its event are stood in for on the CPU by a copy that runs
only when its event is waited for (or a later one is: one stream runs them in order), and that
checks its source was not changed meanwhile."""
import pytest
import torch

from zero.runtime.write_back import StagedWrites


class Host:
    """nvmeio.RegisteredHost's part that StagedWrites uses."""

    def __init__(self):
        self.made, self.closed = [], False

    def empty(self, nbytes, staging=False):
        assert staging  # torch's pinned memory where CUDA refuses registration (nvmeio/_cuda.py)
        self.made.append(nbytes)
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes, never sent

    def close(self):
        self.closed = True


class Stream:
    """Copies queued in order; each runs when its event, or a later one, is waited for."""

    def __init__(self):
        self.queued = []

    def copy(self, dest, src):
        event = Copy(self, dest, src)
        self.queued.append(event)
        return event


class Copy:
    def __init__(self, stream, dest, src):
        self.stream, self.dest, self.src, self.expected = stream, dest, src, src.clone()
        self.ran = False

    def query(self):
        return self.ran

    def synchronize(self):
        for event in self.stream.queued[:self.stream.queued.index(self) + 1]:
            if not event.ran:
                assert torch.equal(event.src, event.expected), "a staged region was written before its copy ran"
                event.dest.copy_(event.src)
                event.ran = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_write_lands_cast_and_no_region_is_reused_before_its_copy_ran(dtype):
    torch.manual_seed(0)
    stream, host = Stream(), Host()
    ring = 4096
    writes = StagedWrites(host, ring_bytes=ring, copy=stream.copy)
    sizes = [1, 7, 100, 300, 511, 512, 513, 1000, 2048, 3, 64, 900] * 3  # some over half the ring
    dests = [torch.zeros(n, dtype=dtype) for n in sizes]
    values = [torch.randn(n) for n in sizes]  # an fp32 master's slices
    for dest, value in zip(dests, values):
        writes.write(dest, value)
    piece = (ring // 2) // dests[0].element_size()
    assert writes.copies == sum(-(-n // piece) for n in sizes) == len(stream.queued)
    assert writes.waits > 0  # the ring wrapped onto copies not yet run, and waited for them
    assert not all(e.ran for e in stream.queued)  # the latest are still in flight
    writes.close()
    assert host.closed and host.made == [ring] and all(e.ran for e in stream.queued)
    for dest, value in zip(dests, values):
        assert torch.equal(dest, value.to(dtype))


def test_a_copy_that_ran_already_is_never_waited_for():
    stream, host = Stream(), Host()
    writes = StagedWrites(host, ring_bytes=1024, copy=stream.copy)
    dests = [torch.zeros(64) for _ in range(40)]  # 256 bytes each: the ring holds four
    for i, dest in enumerate(dests):
        writes.write(dest, torch.full((64,), float(i)))
        stream.queued[-1].synchronize()  # a GPU that keeps up
    assert writes.waits == 0 and writes.copies == 40
    assert all(torch.equal(d, torch.full((64,), float(i))) for i, d in enumerate(dests))


def test_a_write_of_the_wrong_size_is_refused():
    writes = StagedWrites(Host(), ring_bytes=1024, copy=Stream().copy)
    with pytest.raises(ValueError, match="a write-back of 5 values into a shard of 4"):
        writes.write(torch.zeros(4), torch.zeros(5))


def test_a_ring_too_small_for_two_regions_is_refused():
    with pytest.raises(ValueError, match="a staging ring of 64 bytes; it needs at least 128"):
        StagedWrites(Host(), ring_bytes=64)


def test_only_host_values_into_a_gpu_shard_are_staged_and_not_registered_ones_in_its_dtype(monkeypatch):
    shard = torch.empty(4, device="meta")  # stands in for a CUDA tensor by its device type
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0) if t.is_meta
                                                         else torch.device("cpu")))
    pinned = {}
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: pinned.get(t.data_ptr(), False))
    fp32, bf16 = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    assert StagedWrites.takes(fp32, shard)  # pageable (an NVMe optimizer's pool buffer)
    assert StagedWrites.takes(bf16, shard)  # another dtype: the cast goes into the ring
    pinned[fp32.data_ptr()] = True
    assert not StagedWrites.takes(fp32, shard)  # a registered fp32 master: copied as it is
    assert not StagedWrites.takes(fp32, torch.zeros(4))  # a host shard: not this path


class EagerStream(Stream):
    """A GPU that runs each copy at once (the compute stream reads the shard after it)."""

    def copy(self, dest, src):
        event = super().copy(dest, src)
        event.synchronize()
        return event


@pytest.mark.parametrize("optimizer,precision", [("nvme", "fp32"), ("nvme", "bf16"), ("cpu", "bf16")])
def test_training_with_the_write_backs_staged_equals_training_without(tmp_path, monkeypatch, optimizer, precision):
    """Parameters on the compute device, the optimizer on the host or NVMe: every step's write-back
    goes through the ring (forced here, where the shards are host memory), in pieces of a ring
    smaller than the larger units, and the run is the same bit for bit."""
    from helpers import base_config, make_engine, same_weights, train_engine, weights
    from zero.examples import GPTConfig, make_batches
    from zero.stores.param_store import FlatParamStore

    steps = 3
    batches = make_batches(GPTConfig(), steps, 4, seed=5)

    def run(where, staged):
        engine = make_engine(tmp_path / where, config=base_config("none", optimizer, tmp_path / where,
                                                                  precision=precision))
        store = engine.parts.param_store
        assert isinstance(store, FlatParamStore) and not store.aliased and store.staged_writes is None
        if staged is not None:
            store.staged_writes = staged
        losses = train_engine(engine, batches, steps)
        return losses, weights(engine.module)

    plain_losses, plain_weights = run("plain", None)
    monkeypatch.setattr(StagedWrites, "takes", staticmethod(lambda values, shard: True))
    staged = StagedWrites(Host(), ring_bytes=8192, copy=EagerStream().copy)
    losses, final = run("staged", staged)
    assert losses == plain_losses and same_weights(final, plain_weights)
    assert staged.copies > steps * 10  # every unit, every step; the larger ones in pieces
