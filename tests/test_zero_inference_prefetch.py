"""ZeRO-Inference with parameters on NVMe: reads ahead across forwards, into the buffers it computes on.

An engine with no optimizer lends the pool buffer a unit was read into to its
parameters (no copy), prefetches the next forward's first units at the end of
a forward, and its swapper waits for the read it needs only, not every read in
flight; none of this changes a single bit of the outputs. A training engine
lends only to Linears (tests/test_zero_lend_training.py) and reads ahead within
an iteration only.
"""
import copy

import pytest
import torch

import zero
from swapper import PartitionedParamSwapper
from swapper._param_swapper import PartitionState
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig(layers=3)


def inference_config(tmp_path, buffer_count: int) -> dict:
    config = base_config("nvme", "none", tmp_path)
    del config["optimizer"]
    config["zero_optimization"]["offload_param"]["buffer_count"] = buffer_count
    return config


def spy_lending(model, seen: list) -> None:
    """Records, for each Linear's forward, whether its unit views a lent pool buffer."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight._zero_unit.lent))


@pytest.mark.parametrize("buffer_count", [3, 4, 12])
def test_inference_from_nvme_gives_the_plain_logits_forward_after_forward(tmp_path, buffer_count):
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    plain = copy.deepcopy(model)
    engine, optimizer, _, _ = zero.initialize(model=model, config=inference_config(tmp_path, buffer_count))
    assert optimizer is None
    seen: list = []
    spy_lending(model, seen)
    store, coord = engine.parts.param_store, engine.parts.coordinator
    try:
        for i, (x, _) in enumerate(make_batches(CFG, 4, 2, seed=1)):
            with torch.no_grad():
                assert torch.equal(engine(x), plain(x)), f"forward {i}"
            # Every span is back but those read ahead for the next forward.
            assert not any(u.lent for u in engine.parts.units)
            assert store.swapper.pool.held_bytes == sum(store._prefetched.values())
            if i >= 1:  # the trace is known: the next forward's first units are on their way
                assert store._prefetched.keys() & set(coord.prefetcher.trace[:3])
        assert any(seen), "no unit computed on a lent pool buffer"
        if buffer_count == 3:  # 2 spare buffers of 3: some units must be copied instead
            assert not all(seen)
    finally:
        engine.destroy()


def test_a_training_engine_lends_only_to_linears_and_reads_ahead_within_an_iteration(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config("nvme", "cpu", tmp_path)
    config["zero_optimization"]["offload_param"]["buffer_count"] = 12
    engine, _, _, _ = zero.initialize(model=model, config=config)
    seen: list = []
    spy_lending(model, seen)
    lent_to_others: list = []
    for name, m in model.named_modules():  # the embedding (tied to the head) and the layer norms
        if "weight" in m._parameters and not isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: lent_to_others.append(mod.weight._zero_unit.lent))
    try:
        train_engine(engine, make_batches(CFG, 3, 4), 3)
        assert any(seen), "no Linear computed on a lent pool buffer"
        assert lent_to_others and not any(lent_to_others)
        assert not engine.parts.coordinator.prefetcher.ahead
    finally:
        engine.destroy()


def test_writing_a_unit_that_views_a_lent_buffer_keeps_the_buffer(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    plain = copy.deepcopy(model)
    engine, _, _, _ = zero.initialize(model=model, config=inference_config(tmp_path, 12))
    store = engine.parts.param_store
    fc = model.blocks[1].fc
    states = []

    def modify(module, args):
        if not module.weight._zero_unit.lent:
            return
        with zero.GatheredParameters(module.weight, modifier_rank=0):
            module.weight.data.add_(1.0)
        # Written back, and the unit still computes on the buffer: it must not be in the pool.
        states.append(store.swapper.state(store._ids[module.weight._zero_unit.index]))

    x = make_batches(CFG, 1, 2, seed=3)[0][0]
    try:
        with torch.no_grad():
            engine(x)  # records the trace; the second forward reads ahead and lends
            handle = fc.register_forward_pre_hook(modify)
            out = engine(x)
            handle.remove()
            assert states == [PartitionState.AVAILABLE]
            plain.blocks[1].fc.weight.add_(1.0)
            assert torch.equal(out, plain(x))
            assert torch.equal(engine(x), plain(x))  # read back from NVMe
    finally:
        engine.destroy()


@pytest.mark.parametrize("read_queues", [1, 2])
def test_a_blocking_swap_in_waits_for_its_own_read_only(tmp_path, read_queues):
    s = PartitionedParamSwapper(tmp_path, {"queue_depth": 8}, buffer_count=4, buffer_size=1000, max_in_cpu=0,
                                read_queues=read_queues)
    try:
        data = {pid: torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i, pid in enumerate("ab")}
        for pid, t in data.items():
            s.register(pid, t.numel())
        s.swap_out_tensors(list(data), list(data.values()))
        s.swap_in(["a"], async_op=True)
        s.swap_in(["b"], async_op=True)  # a later batch, on the second queue when there is one
        a = s.swap_in(["a"])[0]
        assert torch.equal(a, data["a"])
        # One queue: its wait completed b's read too. Two: b's read is still in flight.
        assert s.state("b") is (PartitionState.AVAILABLE if read_queues == 1 else PartitionState.READING)
        s.synchronize()
        assert s.state("b") is PartitionState.AVAILABLE and torch.equal(s.swap_in(["b"])[0], data["b"])
        s.release(["a", "b"])
        assert s.pool.free_count == 4
    finally:
        s.cleanup()


def test_read_queues_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="read_queues must be a positive integer, got 0"):
        PartitionedParamSwapper(tmp_path, buffer_count=2, buffer_size=10, read_queues=0)


def test_read_ahead_is_bounded_by_the_pools_bytes_not_its_buffer_count(tmp_path):
    # A large embedding sizes the pool's buffers; the blocks' units are a small fraction of it.
    cfg = GPTConfig(layers=4, vocab=4096, tie=False)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    plain = copy.deepcopy(model)
    buffer_count = 4
    engine, _, _, _ = zero.initialize(model=model, config=inference_config(tmp_path, buffer_count))
    store = engine.parts.param_store
    pool = store.swapper.pool
    largest = max(store.swapper.buffer_bytes(pid) for pid in store._ids.values())
    ahead = []  # (units, bytes) read ahead and not fetched yet, after each prefetch

    def prefetch(layouts, original=store.prefetch):
        started = original(layouts)
        ahead.append((len(store._prefetched), sum(store._prefetched.values())))
        return started

    store.prefetch = prefetch
    try:
        for x, _ in make_batches(cfg, 3, 2, seed=1):
            with torch.no_grad():
                assert torch.equal(engine(x), plain(x))
        # Whole buffers would have held buffer_count - SPARE_BUFFERS units ahead at most.
        assert max(units for units, _ in ahead) > buffer_count - store.SPARE_BUFFERS
        assert max(nbytes for _, nbytes in ahead) <= pool.main_bytes == (buffer_count - store.SPARE_BUFFERS) * largest
    finally:
        engine.destroy()
