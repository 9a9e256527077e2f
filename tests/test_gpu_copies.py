"""The CUDA path's copies (issue 30): gradients cross to the host once per window and once per
unit, a unit's host-to-GPU copy waits for nothing but itself, and swap pools are registered with
CUDA.

The arithmetic of the crossing runs here on CPU tensors (it is the same torch code on either
side); the stream protocol is checked on a GPU (marked cuda), where a training step with its
parameters on NVMe must not synchronize a stream or the device per unit.
"""
import gc
import warnings

import pytest
import torch

import zero
from helpers import (RecordingBackend, base_config, make_engine, same_weights, train_engine, train_windows,
                     weights)
from swapper import PinnedBufferPool, SpanPool
from zero.examples import GPTConfig, make_batches
from zero.runtime.device_to_host import GradCrossing, fold_on_device
from zero.stores.pinned_host import MAX_IN_FLIGHT

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def in_loop_order(dst: torch.Tensor, grads, add: bool) -> torch.Tensor:
    """What the micro-batch loop leaves: copied, then added one by one on the host."""
    out = dst.clone()
    for i, g in enumerate(grads):
        if i == 0 and not add:
            out.copy_(g)
        else:
            out.add_(g)
    return out


def window_of(sizes, gen, dtype=torch.float32, k=1, adds=None):
    """One backward's host slices of ``sizes``, ``k`` gradients each, whether each adds, and the
    loop's sums."""
    adds = adds or [False] * len(sizes)
    dsts = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(dtype) for _ in range(k)] for n in sizes]
    return dsts, grads, adds, [in_loop_order(d, g, a) for d, g, a in zip(dsts, grads, adds)]


def cross_all(crossing, dsts, grads, adds) -> None:
    """Each slice's gradients sent as a unit of its own, then all landed."""
    for u, (d, g, a) in enumerate(zip(dsts, grads, adds)):
        crossing.put(u, d, g, a)
        crossing.send(u)
    crossing.flush()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 3, 16])
@pytest.mark.parametrize("add", [False, True])
def test_a_windows_gradients_cross_once_with_the_loops_sums(dtype, k, add):
    gen = torch.Generator().manual_seed(k)
    grads = [(torch.randn(1031, generator=gen) * 10 ** (i % 5)).to(dtype) for i in range(k)]
    dst = torch.randn(1031, generator=gen)
    expected = in_loop_order(dst, grads, add)
    crossing = GradCrossing(torch.device("cpu"))
    crossing.put(0, dst, grads, add)
    crossing.send(0)
    crossing.flush()
    assert torch.equal(dst, expected)


def test_a_units_gradients_cross_in_one_copy_and_land_only_when_flushed_or_two_are_in_flight(monkeypatch):
    """zero/runtime/device_to_host.py [Note: a unit's gradients cross in one copy]: payloads of mixed dtypes
    and odd sizes packed at aligned offsets; the host slices change only when their copy lands."""
    from zero.runtime import device_to_host

    monkeypatch.setattr(device_to_host, "BATCH_BYTES", 1)  # every unit crosses on its own
    gen = torch.Generator().manual_seed(3)
    parts = {u: [torch.randn(n, generator=gen) for n in (7, 1031, 64)] for u in range(3)}
    grads = {u: [[(torch.randn(n, generator=gen)).to(dt) for _ in range(k)]
                 for n, dt, k in ((7, torch.bfloat16, 1), (1031, torch.float32, 1), (64, torch.bfloat16, 3))]
             for u in range(3)}
    expected = {u: [in_loop_order(d, g, add=u == 1) for d, g in zip(parts[u], grads[u])] for u in range(3)}
    crossing = GradCrossing(torch.device("cpu"))
    before = {u: [d.clone() for d in parts[u]] for u in range(3)}
    for u in range(3):
        for d, g in zip(parts[u], grads[u]):
            crossing.put(u, d, g, add=u == 1)
        crossing.send(u)
        assert crossing.copies == u + 1  # one per unit, whatever its parameters
    assert crossing.in_flight == 2  # the third send landed the first
    assert all(torch.equal(a, b) for a, b in zip(parts[0], expected[0]))
    assert all(torch.equal(a, b) for u in (1, 2) for a, b in zip(parts[u], before[u]))
    crossing.flush()
    assert crossing.in_flight == 0
    assert all(torch.equal(a, b) for u in range(3) for a, b in zip(parts[u], expected[u]))
    crossing.send(0)  # nothing pending: no copy
    assert crossing.copies == 3


def test_small_units_cross_together_and_a_large_one_on_its_own_with_the_same_sums(monkeypatch):
    """[Note: small units cross together]: units under BATCH_BYTES are packed as they come and
    cross when the next would not fit, when a larger unit comes, or at flush; each lands where
    and as it would alone."""
    from zero.runtime import device_to_host

    monkeypatch.setattr(device_to_host, "BATCH_BYTES", 4096)
    gen = torch.Generator().manual_seed(6)
    sizes = [100, 200, 7, 300, 2000, 50]  # fp32: 400, 800, 28, 1200 bytes packed; 8000 alone; 200
    dsts = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2)] for n in sizes]
    adds = [u % 2 == 1 for u in range(len(sizes))]
    expected = [in_loop_order(d, g, a) for d, g, a in zip(dsts, grads, adds)]
    crossing = GradCrossing(torch.device("cpu"))
    before = [d.clone() for d in dsts]
    copies = []
    for u, (d, g, a) in enumerate(zip(dsts, grads, adds)):
        crossing.put(u, d, g, a)
        crossing.send(u)
        copies.append(crossing.copies)
    assert copies == [0, 0, 0, 0, 2, 2]  # the four small ones together, then the large one
    assert crossing.in_flight == 2 and all(torch.equal(d, b) for d, b in zip(dsts, before))  # none landed
    crossing.flush()
    assert crossing.copies == 3 and crossing.in_flight == 0
    assert all(torch.equal(d, e) for d, e in zip(dsts, expected))


def test_a_unit_larger_than_a_slab_crosses_in_element_ranges_with_the_same_sums(monkeypatch):
    """The staging memory is bounded: a unit past SLAB_BYTES goes as several copies, each a range
    of every parameter's elements (a window's two 16-bit gradients in the same ranges)."""
    from zero.runtime import device_to_host

    monkeypatch.setattr(device_to_host, "SLAB_BYTES", 8192)
    gen = torch.Generator().manual_seed(4)
    dsts = [torch.randn(n, generator=gen) for n in (5000, 3, 2049)]
    grads = [[torch.randn(5000, generator=gen).to(torch.bfloat16) for _ in range(2)],
             [torch.randn(3, generator=gen)], [torch.randn(2049, generator=gen)]]
    expected = [in_loop_order(d, g, add=False) for d, g in zip(dsts, grads)]
    crossing = GradCrossing(torch.device("cpu"))
    for d, g in zip(dsts, grads):
        crossing.put(0, d, g, add=False)
    crossing.send(0)
    crossing.flush()
    assert crossing.copies == 4  # 20000 + 12 + 8196 bytes (and padding), 8 KiB at a time
    assert all(s.numel() <= 8192 for s in crossing._free)
    assert all(torch.equal(d, e) for d, e in zip(dsts, expected))


def test_an_abandoned_backward_lands_nothing():
    dst = torch.zeros(100)
    crossing = GradCrossing(torch.device("cpu"))
    crossing.put(0, dst, [torch.ones(100)], add=False)
    crossing.send(0)
    crossing.put(1, dst, [torch.ones(100)], add=True)  # put, never sent
    crossing.abandon()
    crossing.flush()
    assert crossing.in_flight == 0 and bool((dst == 0).all())
    copies = crossing.copies  # 0: unit 0 was still packed, waiting for others (small units cross together)
    crossing.send(1)  # abandoned: nothing pending
    crossing.flush()
    assert crossing.copies == copies == 0 and bool((dst == 0).all())


@pytest.mark.parametrize("together", [False, True], ids=["unit by unit", "small units together"])
@pytest.mark.parametrize("case", ["bf16 loop", "bf16 train_batch", "fp32 nvme stash"])
def test_training_through_the_crossing_equals_training_without_it(tmp_path, monkeypatch, case, together):
    """The engine's gradients forced through GradCrossing on the CPU (as on a GPU with the
    optimizer offloaded): losses and weights bit-identical to the direct path; one copy per unit
    with gradients per backward, or fewer where small units cross together."""
    from zero.runtime import device_to_host

    if not together:
        monkeypatch.setattr(device_to_host, "BATCH_BYTES", 1)
    precision, mode = case.split(" ", 1)
    offload = "nvme" if mode == "nvme stash" else "cpu"
    k, steps = 2, 2
    batches = make_batches(GPTConfig(), steps * k, 4, seed=5)

    def run(where):
        engine = make_engine(tmp_path / where, offload, accumulation=k, precision=precision)
        if mode == "train_batch":
            losses = train_windows(engine, batches, steps, accumulation=k)
        else:
            losses = train_engine(engine, batches, steps, accumulation=k)
        return engine, losses, weights(engine.module)

    direct, direct_losses, direct_weights = run("direct")
    monkeypatch.setattr(GradCrossing, "applies", lambda self, grad, dst: True)
    crossed, losses, crossed_weights = run("crossed")
    assert losses == direct_losses
    assert same_weights(crossed_weights, direct_weights)
    with_grads = sum(1 for u in crossed.units if u.grad_count)
    backwards = steps * (1 if mode == "train_batch" else k)
    if together:  # the small model's units (all under BATCH_BYTES) cross a few at a time
        assert backwards <= crossed.parts.reducer.crossing.copies < with_grads * backwards
    else:
        assert crossed.parts.reducer.crossing.copies == with_grads * backwards
    assert direct.parts.reducer.crossing.copies == 0


class SnapshotAhead:
    """A CPU stand-in for zero/runtime/host_to_device.py AheadCopy: the values at the copy's start
    (a copy started before a change must not show it), counted when started and when taken."""

    started = taken = 0
    last = None  # the tensor the latest take() handed over

    def __init__(self, shard, device, after=None):
        type(self).started += 1
        self.values = shard.clone()

    def take(self):
        type(self).taken += 1
        type(self).last = self.values
        return self.values


@pytest.mark.parametrize("case", ["fp32 loop", "bf16 loop", "fp32 train_batch", "bf16 quantized"])
def test_host_resident_shards_read_ahead_onto_the_device_train_as_gathered_ones(tmp_path, monkeypatch, case):
    """zero/stores/param_store.py [Note: host-resident shards are read ahead onto the GPU], forced on the
    CPU: units gathered from copies started ahead (as on a GPU, where a host shard is never free
    to view) train bit-identically to units copied when gathered, across steps that change the
    shards (the fp32 master stepped in place) and a load of new weights; most gathers after the
    first iteration take a copy started ahead, and none outlives a change of its shard; on one rank
    a unit gathered from a copy is that copy (not copied once more)."""
    from zero.examples import GPT, add_lora
    from zero.runtime.unit import ParamUnit

    precision, mode = case.split(" ", 1)
    k, steps = 2, 3
    batches = make_batches(GPTConfig(), steps * k, 4, seed=7)
    monkeypatch.setattr(ParamUnit, "free_gather", lambda self: False)  # a host shard, a GPU's compute
    lora = mode == "quantized"

    def run(where, ahead):
        overrides = {"zero_optimization": {"zero_quantized_nontrainable_weights": True}} if lora else None
        engine = make_engine(tmp_path / where, "cpu", accumulation=k, precision=precision, overrides=overrides,
                             model=(lambda: add_lora(GPT(GPTConfig()), rank=2)) if lora else None)
        store = engine.parts.param_store
        assert store.copy_ahead is None and not store.reads_ahead  # computing on the CPU: nothing to copy
        store.copy_ahead = ahead
        run = train_windows if mode == "train_batch" else train_engine
        losses = run(engine, batches[:k], 1, accumulation=k)
        zero.load_pretrained(engine, tmp_path / "pretrained")  # new weights in every shard, then a refresh
        after_load.update(gathers=len(gathers), taken=SnapshotAhead.taken)
        losses += run(engine, batches[k:], steps - 1, accumulation=k)
        after_load.update(trained=len(gathers), trained_taken=SnapshotAhead.taken)
        return losses, weights(engine.module)

    zero.save_pretrained(add_lora(GPT(GPTConfig()), rank=2) if lora else GPT(GPTConfig()), tmp_path / "pretrained")
    gathers, after_load = [], {}
    direct_losses, direct_weights = run("direct", None)
    SnapshotAhead.started = SnapshotAhead.taken = 0
    real_gather = ParamUnit.gather
    copied_again = []

    def gather(self, *args, **kwargs):
        gathers.append(self)
        taken = SnapshotAhead.taken
        out = real_gather(self, *args, **kwargs)
        quantized = self.store.frozen.packs(self.layout)  # the unit is its dequantized copy
        if SnapshotAhead.taken > taken and not quantized and self.full is not SnapshotAhead.last:
            copied_again.append(self.layout.index)
        return out

    monkeypatch.setattr(ParamUnit, "gather", gather)
    losses, ahead_weights = run("ahead", SnapshotAhead)
    assert losses == direct_losses
    assert not copied_again, copied_again
    assert same_weights(ahead_weights, direct_weights)
    # the trace is recorded by then: nearly every gather of the iterations after the load finds its copy
    taken = after_load["trained_taken"] - after_load["taken"]
    gathered = after_load["trained"] - after_load["gathers"]
    assert SnapshotAhead.started >= SnapshotAhead.taken and taken >= 0.8 * gathered > 0, (taken, gathered)


def test_a_copy_read_ahead_before_a_step_is_never_gathered_after_it(tmp_path, monkeypatch):
    """A step changes the fp32 master in place (the store is the master, so ``write`` never sees
    it): the refresh after it drops every copy started before, and the next gather reads the new
    values."""
    from zero.runtime.param_state import ParamState
    from zero.runtime.unit import ParamUnit

    monkeypatch.setattr(ParamUnit, "free_gather", lambda self: False)
    engine = make_engine(tmp_path, "cpu")
    store, coordinator = engine.parts.param_store, engine.parts.coordinator
    assert store.aliased
    store.copy_ahead = SnapshotAhead
    u = next(u for u in engine.units if u.layout.shard_numel > 0 and u.state is ParamState.NOT_AVAILABLE)
    assert store.prefetch([u.layout]) == 1
    u.mark_prefetched()
    store.shard(u.layout).add_(1.0)  # what the step does to the master
    coordinator.refresh()
    assert u.state is ParamState.NOT_AVAILABLE
    with zero.GatheredParameters(u.params):
        gathered = torch.cat([p.detach().reshape(-1) for p in u.params])
    assert torch.equal(gathered, store.shard(u.layout)[:gathered.numel()])
    engine.destroy()

    engine = make_engine(tmp_path / "bf16", "cpu", precision="bf16")  # a store of its own, written to
    store = engine.parts.param_store
    assert not store.aliased
    store.copy_ahead = SnapshotAhead
    u = next(u for u in engine.units if u.layout.shard_numel > 0 and u.state is ParamState.NOT_AVAILABLE)
    store.prefetch([u.layout])
    u.mark_prefetched()
    store.write(u.layout, torch.zeros(u.layout.shard_numel))  # a write drops the copy started before it
    with zero.GatheredParameters(u.params):
        assert all(bool((p == 0).all()) for p in u.params)


def test_each_direction_has_a_copy_stream_of_its_own_on_each_device(monkeypatch):
    """zero/runtime/host_to_device.py [Note: a copy stream per direction]: reads ahead onto a device
    and copies off it (which first wait for the compute stream) never share a stream; each is
    made once per device."""
    from zero.runtime import host_to_device

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(host_to_device, "_streams", {})
    copy_stream = host_to_device.copy_stream
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    onto, off = copy_stream(d0), copy_stream(d0, to_host=True)
    assert onto is not off and copy_stream(d0) is onto and copy_stream(d0, to_host=True) is off
    assert copy_stream(d1) not in (onto, off) and copy_stream(d1, to_host=True) not in (onto, off)
    assert made == [0, 0, 1, 1]


def test_a_host_shard_is_read_only_after_the_writes_from_the_device_landed(tmp_path, monkeypatch):
    """zero/stores/param_store.py [Note: writes from the device land before a shard is read], the
    CUDA event stood in for on the CPU: with the optimizer beside the compute and the parameters in
    host memory, each step writes every shard back; a copy ahead starts after the latest write's
    event, and no gather reads a host shard before the CPU waited for it (at most once a step);
    the training equals the one without events."""
    from zero.runtime.unit import ParamUnit
    from zero.stores import param_store
    from zero.stores.param_store import FlatParamStore

    class Landing:
        made, waits = [], 0

        def __init__(self):
            self.landed = False
            Landing.made.append(self)

        def synchronize(self):  # the copies run in order on one stream: the ones before landed too
            for e in Landing.made[:Landing.made.index(self) + 1]:
                e.landed = True
            Landing.waits += 1

    def ahead(shard, device, after=None):  # the copy stream reads the shard once ``after`` landed
        assert all(e.landed for e in Landing.made) or after is Landing.made[-1]
        return SnapshotAhead(shard, device)

    real_fetch = FlatParamStore.fetch

    def fetch(self, layout, widen=False):
        copied_ahead = layout.index in self._ahead
        out = real_fetch(self, layout, widen)
        assert copied_ahead or all(e.landed for e in Landing.made)  # else the caller reads the host shard
        return out

    steps = 3
    batches = make_batches(GPTConfig(), steps, 4, seed=3)
    monkeypatch.setattr(ParamUnit, "free_gather", lambda self: False)  # a host shard, a GPU's compute

    def run(where, with_events):
        engine = make_engine(tmp_path / where, config=base_config("cpu", "none", precision="bf16"))
        store = engine.parts.param_store
        assert isinstance(store, FlatParamStore) and not store.aliased  # every step writes the shards
        store.copy_ahead = ahead
        if with_events:
            monkeypatch.setattr(param_store, "copy_landing", lambda source, dest, after: Landing())
            monkeypatch.setattr(FlatParamStore, "fetch", fetch)
        losses = train_engine(engine, batches, steps)
        return losses, weights(engine.module)

    plain_losses, plain_weights = run("plain", False)
    losses, final = run("events", True)
    assert losses == plain_losses and same_weights(final, plain_weights)
    assert len(Landing.made) >= steps * 2 and all(e.landed for e in Landing.made)
    assert Landing.waits <= steps  # the CPU waits at most once a step (the copies ahead wait on the device)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_cuda_pinned_host_shards_are_read_ahead_and_unpinned_ones_are_not(tmp_path, precision):
    """fp32 shards live in the optimizer's master, pinned as its pin_memory says; bf16 ones in the
    parameter store's own memory, pinned as offload_param's says."""
    from zero.runtime.host_to_device import AheadCopy

    for param_pin, optimizer_pin in ((True, False), (False, True), (True, True), (False, False)):
        engine = make_engine(tmp_path / f"{param_pin}-{optimizer_pin}", "cpu", precision=precision, overrides={
            "compute_device": "cuda", "zero_optimization": {"offload_param": {"pin_memory": param_pin},
                                                            "offload_optimizer": {"pin_memory": optimizer_pin}}})
        try:
            store = engine.parts.param_store
            assert store.aliased == (precision == "fp32")
            pinned = optimizer_pin if store.aliased else param_pin
            assert (store.copy_ahead is AheadCopy) == pinned and store.reads_ahead == pinned
            batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 2, 4, seed=1)]
            losses = train_engine(engine, batches, 2)
            assert all(torch.isfinite(torch.tensor(losses)))
        finally:
            engine.destroy()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_one_gpu_a_unit_copied_from_host_memory_is_that_copy(tmp_path, monkeypatch, offload, precision):
    """zero/runtime/unit.py: a shard copied onto the GPU for a gather (read ahead from host memory, or
    from a swap pool when gathered) is the unit's buffer on one rank, never copied once more."""
    from zero.runtime.comm import Comm

    engine = make_engine(tmp_path / offload, offload, precision=precision, overrides={"compute_device": "cuda"})
    copies = []
    real = Comm.all_gather_into
    monkeypatch.setattr(Comm, "all_gather_into", lambda self, *a, **kw: (copies.append(1), real(self, *a, **kw))[1])
    try:
        batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 2, 4, seed=1)]
        losses = train_engine(engine, batches, 2)
    finally:
        engine.destroy()
    assert all(torch.isfinite(torch.tensor(losses))) and copies == []


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("optimizer,precision,pinned,staged", [
    ("nvme", "fp32", True, True), ("nvme", "bf16", True, True), ("cpu", "bf16", True, True),
    ("cpu", "fp32", True, False), ("cpu", "bf16", False, None), ("nvme", "fp32", False, None)])
def test_on_cuda_a_steps_write_back_is_staged_unless_registered_in_the_shards_dtype(
        tmp_path, optimizer, precision, pinned, staged):
    """zero/runtime/write_back.py [Note: a write-back goes through registered staging]: shards on the
    GPU, the optimizer on the host or NVMe; a pinned fp32 master is copied from as it is, and without
    the optimizer's pin_memory there is no ring (``staged`` None: pageable copies, as asked)."""
    config = base_config("none", optimizer, tmp_path, precision=precision)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = pinned
    config["compute_device"] = "cuda"
    engine = make_engine(tmp_path, config=config)
    try:
        writes = engine.parts.param_store.staged_writes
        assert (writes is None) == (staged is None)
        batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 2, 4, seed=1)]
        losses = train_engine(engine, batches, 2)
        assert all(torch.isfinite(torch.tensor(losses)))
        assert writes is None or (writes.copies > 0) == staged
    finally:
        engine.destroy()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_staged_writes_queued_behind_kernels_land_exactly(dtype):
    """A small ring, its copies held back by a kernel queued before them: the ring wraps onto
    copies not yet run, waits for them, and every shard gets its values bit for bit."""
    from nvmeio import RegisteredHost
    from zero.runtime.write_back import StagedWrites

    torch.manual_seed(0)
    writes = StagedWrites(RegisteredHost(), ring_bytes=8192)
    sizes = [1, 100, 1000, 1500, 3000, 17, 512] * 4  # some over half the ring: in pieces
    values = [torch.randn(n) for n in sizes]
    dests = [torch.zeros(n, dtype=dtype, device="cuda") for n in sizes]
    writes.write(torch.empty(1, dtype=dtype, device="cuda"), torch.zeros(1))  # the ring made and registered
    writes.synchronize()
    torch.cuda._sleep(10 ** 9)  # about half a second of GPU time before the first copy (time to queue them all)
    for dest, value in zip(dests, values):
        writes.write(dest, value)
    assert writes.waits > 0
    writes.close()
    for dest, value in zip(dests, values):
        assert torch.equal(dest.cpu(), value.to(dtype))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("planned", [0, 2 << 20], ids=["growing slabs", "planned slabs"])
def test_on_cuda_gradients_queued_behind_kernels_cross_exactly(monkeypatch, planned):
    """The crossing's copies held back by a kernel queued before the gradients they carry: the
    outbound stream waits for the compute stream, the host lands a unit only after its copy's
    event, and a slab is reused or released only once landed; every host slice gets the loop's
    sums bit for bit, units over the slab limit in ranges."""
    from nvmeio import RegisteredHost
    from zero.runtime import device_to_host

    monkeypatch.setattr(device_to_host, "SLAB_BYTES", 2 << 20)  # the 600k-element unit crosses in ranges
    monkeypatch.setattr(device_to_host, "BATCH_BYTES", 1)  # every unit crosses on its own
    gen = torch.Generator().manual_seed(11)
    sizes = [1000, 600_000, 7, 70_000, 200_000, 5]
    host = RegisteredHost()
    crossing = GradCrossing(torch.device("cuda"), host, planned)
    try:
        for _ in range(2):
            dsts, grads, adds, expected = window_of(sizes, gen, torch.bfloat16, 2,
                                                    [u % 2 == 1 for u in range(len(sizes))])
            on_gpu = [[g.cuda() for g in gs] for gs in grads]
            torch.cuda._sleep(10 ** 8)  # tens of milliseconds before the gradients exist
            cross_all(crossing, dsts, [[g.clone() for g in gs] for gs in on_gpu], adds)  # made behind the sleep
            assert all(torch.equal(d, e) for d, e in zip(dsts, expected))
        assert crossing.copies == 2 * (len(sizes) + 1)  # the large unit in two ranges
    finally:
        host.close()


@pytest.mark.parametrize("dtypes,add,on_device", [
    ([torch.bfloat16], False, False), ([torch.float32], False, False),  # one crossing either way
    ([torch.bfloat16], True, False),  # 2 bytes over and added there, not 4 over, 4 back
    ([torch.bfloat16] * 2, False, False), ([torch.bfloat16] * 3, False, True),
    ([torch.float32] * 2, False, True), ([torch.float32] * 2, True, False),
    ([torch.bfloat16] * 16, True, True), ([torch.float32] * 16, False, True)])
def test_the_sum_is_made_where_fewer_bytes_cross(dtypes, add, on_device):
    assert fold_on_device([torch.zeros(1, dtype=d) for d in dtypes], add) is on_device


class RefusingBackend(RecordingBackend):
    def __init__(self, why: str):
        super().__init__()
        self.why = why

    def pin_host(self, ptr, nbytes):
        return self.why


@pytest.mark.parametrize("make", [lambda: PinnedBufferPool(3, 5000, pin_memory=False),
                                  lambda: SpanPool(3 * 5000, pin_memory=False)], ids=["buffers", "spans"])
def test_a_pool_is_registered_with_cuda_once_whole_and_unregistered_when_it_dies(make):
    backend = RecordingBackend()
    pool = make()
    start, nbytes = pool._storage.data_ptr(), pool.nbytes
    assert pool.register_with_cuda(backend) is None
    assert pool.register_with_cuda(backend) is None  # once
    assert backend.pinned == [(start, nbytes)]
    pool.close()
    assert backend.unpinned == [start]  # at close, before the memory goes, not when the pool dies
    del pool
    gc.collect()
    assert backend.unpinned == [start]


def test_a_pool_never_closed_is_unregistered_when_it_dies():
    backend = RecordingBackend()
    pool = PinnedBufferPool(2, 1000, pin_memory=False)
    start = pool._storage.data_ptr()
    pool.register_with_cuda(backend)
    del pool
    gc.collect()
    assert backend.unpinned == [start]


def test_a_refused_registration_says_why_and_registers_nothing():
    backend = RefusingBackend("cudaHostRegister returned error 2")
    pool = PinnedBufferPool(2, 1000, pin_memory=False)
    assert pool.register_with_cuda(backend) == "cudaHostRegister returned error 2"
    pool.close()
    del pool
    gc.collect()
    assert backend.unpinned == []


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("train_batch", [False, True], ids=["loop", "train_batch"])
def test_no_stream_or_device_synchronize_per_unit_on_cuda(tmp_path, monkeypatch, train_batch):
    """A step with parameters and optimizer on NVMe, computing on CUDA: the units' copies wait on
    their own events; the step may synchronize once (zero/engine/optimizer.py), never once per unit."""
    k = 4
    engine = make_engine(tmp_path / "nvme", "nvme", accumulation=k, overrides={"compute_device": "cuda"})
    units = len(engine.units)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 3 * k, 4, seed=1)]
    syncs = []
    real_stream_sync, real_device_sync = torch.cuda.Stream.synchronize, torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: (syncs.append("stream"), real_stream_sync(self))[1])
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: (syncs.append("device"), real_device_sync(device))[1])
    steps = 3
    if train_batch:
        for s in range(steps):
            engine.train_batch(batches[s * k:(s + 1) * k])
    else:
        train_engine(engine, batches, steps, accumulation=k)
    assert syncs.count("stream") == 0, syncs
    assert syncs.count("device") <= 2 * steps < units, syncs


@pytest.mark.cuda
@needs_gpu
def test_with_everything_on_the_gpu_a_step_synchronizes_nothing(tmp_path, monkeypatch):
    """The step's device synchronize is for copies to and from host memory: with parameters and
    optimizer on the GPU the stream orders everything, and the CPU keeps queueing."""
    engine = make_engine(tmp_path, "none", overrides={"compute_device": "cuda"})
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(GPTConfig(), 3, 4, seed=1)]
    syncs = []
    real_device_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: (syncs.append("device"), real_device_sync(device))[1])
    try:
        train_engine(engine, batches, 3)
    finally:
        monkeypatch.undo()
        engine.destroy()
    assert syncs == []


def test_registered_host_tensors_are_their_size_registered_once_each_and_released_at_close():
    from nvmeio import RegisteredHost

    backend = RecordingBackend()
    host = RegisteredHost(backend)
    a = host.empty(1000, torch.float32)
    b = host.empty(3, torch.bfloat16)
    assert (a.dtype, a.numel(), b.dtype, b.numel()) == (torch.float32, 1000, torch.bfloat16, 3)
    assert backend.pinned == [(a.data_ptr(), 4000), (b.data_ptr(), 6)]
    assert a.data_ptr() % 4096 == 0
    host.close()
    assert sorted(backend.unpinned) == sorted([a.data_ptr(), b.data_ptr()])
    a.fill_(1.5)  # the memory outlives its registration
    assert torch.equal(a, torch.full((1000,), 1.5))


def test_a_registration_dropped_without_close_is_unregistered():
    from nvmeio import RegisteredHost

    backend = RecordingBackend()
    host = RegisteredHost(backend)
    ptr = host.empty(4096).data_ptr()  # the caller drops its tensor at once: the host keeps it
    assert backend.unpinned == []
    del host
    gc.collect()
    assert backend.unpinned == [ptr]


def test_a_refused_registration_warns_once_and_still_gives_memory():
    from nvmeio import RegisteredHost
    from zero.stores import pinned_host

    backend = RefusingBackend("cudaHostRegister returned error 1")
    host = RegisteredHost(backend, on_refused=pinned_host._warn)
    with pytest.warns(RuntimeWarning, match="could not be registered with CUDA .cudaHostRegister returned error 1"):
        t = host.empty(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t2 = host.empty(10)  # not tried again, no second warning
    assert t.numel() == t2.numel() == 10 and host.refused == "cudaHostRegister returned error 1"
    host.close()
    assert backend.unpinned == []


class PinningBackend(RefusingBackend):
    """Refuses cudaHostRegister, gives torch's pinned memory (here plain memory, recorded)."""

    def __init__(self, why, gives=True, offset=0):
        super().__init__(why)
        self.gives, self.offset, self.allocated, self.given = gives, offset, [], []

    def alloc_pinned(self, nbytes):
        self.allocated.append(nbytes)
        if not self.gives:
            return None
        base = torch.empty(nbytes + 2 * 4096, dtype=torch.uint8)
        start = -base.data_ptr() % 4096 + self.offset  # page-aligned, as cudaHostAlloc's is, unless offset
        t = base[start:start + nbytes]
        self.given.append(t.data_ptr())
        return t


def test_where_registration_is_refused_staging_comes_from_torchs_pinned_allocator_and_the_rest_stays_pageable():
    """[Note: staging memory where CUDA refuses registration]: the staging buffer asked for when the
    refusal is found, and every one after it, are the pinned allocator's; other memory is not."""
    from nvmeio import RegisteredHost

    backend = PinningBackend("cudaHostRegister returned error 801")
    host = RegisteredHost(backend, on_refused=lambda why: None)
    first = host.empty(3000, staging=True)  # registration tried, refused: then the pinned allocator
    assert host.refused == "cudaHostRegister returned error 801" and backend.allocated == [3000]
    second = host.empty(500, torch.float32, staging=True)
    store = host.empty(1000, torch.float32)  # a store's memory: pageable, not rounded by that allocator
    assert backend.allocated == [3000, 2000] and [first.data_ptr(), second.data_ptr()] == backend.given
    assert (first.numel(), first.dtype, second.numel(), second.dtype) == (3000, torch.uint8, 500, torch.float32)
    assert store.numel() == 1000 and store.data_ptr() % 4096 == 0
    assert len({first.data_ptr(), second.data_ptr(), store.data_ptr()}) == 3
    second.fill_(2.5)
    assert torch.equal(second, torch.full((500,), 2.5))
    host.close()
    assert backend.unpinned == []


@pytest.mark.parametrize("gives,offset", [(False, 0), (True, 64)], ids=["refused too", "not page-aligned"])
def test_staging_is_plain_memory_where_the_pinned_allocator_fails_or_gives_unaligned_memory(gives, offset):
    """Staging memory is page-aligned, as the huge-page memory it replaces: a buffer off a page boundary is not taken."""
    from nvmeio import RegisteredHost

    backend = PinningBackend("cudaHostRegister returned error 801", gives=gives, offset=offset)
    host = RegisteredHost(backend, on_refused=lambda why: None)
    t = host.empty(8192, staging=True)
    assert backend.allocated == [8192] and t.numel() == 8192 and t.data_ptr() % 4096 == 0
    assert t.data_ptr() not in backend.given


def test_the_pinned_allocators_failure_is_none_not_an_error():
    from nvmeio import CudaBackend

    if torch.cuda.is_available():
        pytest.skip("on a GPU torch's pinned allocator succeeds: this is the CPU-only build's refusal")
    assert CudaBackend().alloc_pinned(4096) is None  # a CPU-only torch refuses pin_memory


def test_a_failed_registration_clears_cudas_last_error(monkeypatch):
    """Else torch's next kernel launch check raises it as that kernel's error (seen on an H200)."""
    from nvmeio import CudaBackend

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 712

        def cudaGetLastError(self):
            calls.append(("get_last_error",))
            return 712

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    assert CudaBackend().pin_host(4096, 8192) == "cudaHostRegister returned error 712"
    assert calls == [("register", 4096, 8192, 1), ("get_last_error",)]


def scenario_crossed(rank, world_size, scratch, forced, offload):
    """scenario_train with the reduced shards forced through GradCrossing (``forced``)."""
    from helpers import scenario_train

    if forced:
        GradCrossing.applies = lambda self, grad, dst: True  # this rank's process only
    return scenario_train(rank, world_size, scratch, offload_optimizer=offload, offload_param=offload,
                          accumulation=2, steps=3, overlap_comm=True)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_two_ranks_reduced_shards_through_the_crossing_equal_the_direct_path(tmp_path, offload):
    from helpers import run_ranks

    results = run_ranks(2, [(name, scenario_crossed, {"forced": name == "crossed", "offload": offload})
                            for name in ("direct", "crossed")], tmp_path)
    for r in results:
        assert "error" not in r["direct"] and "error" not in r["crossed"], r
        assert r["crossed"] == r["direct"]


class SlabHost:
    """nvmeio.RegisteredHost's part that GradCrossing uses, counting the slabs it holds."""

    def __init__(self):
        self.live, self.made, self.most, self.most_slabs = {}, 0, 0, 0

    def empty(self, nbytes, staging=False):
        assert staging  # torch's pinned memory where CUDA refuses registration (nvmeio/_cuda.py)
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.live[t.data_ptr()] = nbytes
        self.made += 1
        self.most = max(self.most, sum(self.live.values()))
        self.most_slabs = max(self.most_slabs, len(self.live))
        return t

    def release(self, t):
        del self.live[t.data_ptr()]


def test_the_crossings_host_slabs_are_at_most_two_of_the_largest_copy_and_stop_growing(monkeypatch):
    """Units of growing sizes each need a larger slab: a free one too small is given back before
    a larger one is made, so the crossing never holds more than MAX_IN_FLIGHT slabs; slabs only
    grow, so once both are as large as the largest copy (here in the second step) nothing more is
    allocated. Sums land as in the loop."""
    from zero.runtime import device_to_host

    mib = 1 << 20
    monkeypatch.setattr(device_to_host, "BATCH_BYTES", 1)  # every unit crosses on its own
    host = SlabHost()
    crossing = GradCrossing(torch.device("cpu"), host)
    gen = torch.Generator().manual_seed(8)
    sizes = [n * mib // 4 for n in (1, 2, 3, 5, 8, 2, 13)]  # fp32 elements: 1 ... 13 MiB
    made = []
    for step in range(4):
        dsts, grads, adds, expected = window_of(sizes, gen)
        cross_all(crossing, dsts, grads, adds)
        assert all(torch.equal(d, e) for d, e in zip(dsts, expected))
        made.append(host.made)
    assert host.most_slabs == MAX_IN_FLIGHT and host.most <= MAX_IN_FLIGHT * 14 * mib
    assert len(host.live) == 2 and max(host.live.values()) == 14 * mib  # whole huge pages
    assert made == [6, 8, 8, 8]  # two grown in the second step, then reused


def test_slabs_planned_for_the_largest_shard_are_made_once_and_never_grow(monkeypatch):
    """The engine plans the slabs for its largest trained shard (zero/stores/pinned_host.py
    crossing_slab_bytes): two slabs of that size, made at the first copies, then only reused."""
    from zero.runtime import device_to_host
    from zero.stores.pinned_host import crossing_slab_bytes

    monkeypatch.setattr(device_to_host, "BATCH_BYTES", 1)  # every unit crosses on its own
    sizes = [n * (1 << 20) // 8 for n in (1, 2, 3, 5, 8, 2, 13)]  # at 8 bytes an element at most: 1 ... 13 MiB
    planned = crossing_slab_bytes(max(sizes))
    host = SlabHost()
    crossing = GradCrossing(torch.device("cpu"), host, planned)
    gen = torch.Generator().manual_seed(9)
    for step in range(3):
        dsts, grads, adds, expected = window_of(sizes, gen, torch.bfloat16, 2)
        cross_all(crossing, dsts, grads, adds)
        assert all(torch.equal(d, e) for d, e in zip(dsts, expected))
    assert host.made == MAX_IN_FLIGHT and sorted(host.live.values()) == [planned] * MAX_IN_FLIGHT
    assert planned == 14 << 20  # 13 MiB of payloads and their alignment's room, in whole huge pages


def test_registered_host_releases_one_tensor_and_keeps_the_others():
    from nvmeio import RegisteredHost

    backend = RecordingBackend()
    host = RegisteredHost(backend)
    a, b = host.empty(4096), host.empty(8192)
    host.release(a)
    assert backend.unpinned == [a.data_ptr()]
    host.release(torch.empty(3))  # not registered here: ignored
    host.close()
    assert backend.unpinned == [a.data_ptr(), b.data_ptr()]


def test_a_closed_registered_host_registers_nothing_more():
    """Its finalizer has run: a registration made after close would outlive its memory."""
    from nvmeio import RegisteredHost

    backend = RecordingBackend()
    host = RegisteredHost(backend)
    host.empty(4096)
    host.close()
    t = host.empty(8192)
    assert t.numel() == 8192 and len(backend.pinned) == 1 and host.register(t) == "closed"


def test_a_failed_unregistration_clears_cudas_last_error(monkeypatch):
    from nvmeio import CudaBackend
    from nvmeio import _cuda

    cleared = []

    class Runtime:
        def cudaHostUnregister(self, ptr):
            return 712  # cudaErrorHostMemoryNotRegistered

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(_cuda, "_clear_last_error", cleared.append)
    CudaBackend().unpin_host(1234)
    assert len(cleared) == 1 and isinstance(cleared[0], Runtime)
