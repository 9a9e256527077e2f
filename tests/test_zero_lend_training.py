"""Training lends pool buffers to the parameters of Linears (zero/runtime/hooks.py, [Note: lending in training]).

With parameters on NVMe, a unit read into a pool buffer is computed on in place
when its one user is an nn.Linear running ZeroLinear. Anything that could keep a
view of the data past the unit's release (another module reading the weight, a
Linear fed a strided input, whose F.linear keeps ``weight.t()``) copies it first
and ends the lending for that unit; so does a forward recomputed by
torch.utils.checkpoint, whose saved-tensor hook keeps the weight's data. Losses equal
plain PyTorch's in every case.
"""
import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.runtime.linear import KEEPS_LEAVES
from zero.examples import GPT, Embedding, GPTConfig, make_batches, train_reference
from helpers import CheckpointedGPT, base_config

CFG = GPTConfig(layers=3)


def nvme_config(tmp_path, buffer_count: int = 6) -> dict:
    # Units released right after use (no reuse distance): their buffers are soon read into again.
    config = base_config("nvme", "cpu", tmp_path, lr=1e-2, stage3_max_reuse_distance=0)
    config["zero_optimization"]["offload_param"]["buffer_count"] = buffer_count
    return config


class SavedInPool:
    """Counts the tensors autograd saves for backward that view the parameter pool's memory: their
    data would change once the buffer is read into again."""

    def __init__(self, engine):
        storage = engine.parts.param_store.swapper.pool._storage
        self.start, self.stop = storage.data_ptr(), storage.data_ptr() + storage.numel()
        self.count = 0

    def pack(self, t):
        # A parameter itself is fine (ZeroLinear keeps it: backward reads what it holds then).
        if not isinstance(t, nn.Parameter) and self.start <= t.untyped_storage().data_ptr() < self.stop:
            self.count += 1
        return t

    def __call__(self):
        def pack(t):
            return self.pack(t)
        setattr(pack, KEEPS_LEAVES, True)  # it keeps a parameter as itself: lending goes on under it
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def train_watched(engine, batches, steps, watch: "SavedInPool" = None):
    losses = []
    for x, y in batches[:steps]:
        with watch() if watch is not None else contextlib.nullcontext():
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def lent_units(engine):
    return {u.layout.module_name for u in engine.parts.units if u.owner is not None}


def test_linears_compute_on_their_pool_buffers_and_train_exactly(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 4, 4)
    engine, _, _, _ = zero.initialize(model=model, config=nvme_config(tmp_path, buffer_count=12))
    watch = SavedInPool(engine)
    lent = []
    for m in model.modules():
        if type(m) is nn.Linear:
            m.register_forward_pre_hook(lambda mod, args: lent.append(mod.weight._zero_unit.lent))
    try:
        owners = lent_units(engine)
        losses = train_watched(engine, batches, 4, watch)
    finally:
        engine.destroy()
    # The head shares the embedding's weight: two users, never lent. Each block's Linears are.
    assert "wte" not in owners and "blocks.0.attn.qkv" in owners and "blocks.2.out" in owners
    assert any(lent) and watch.count == 0
    assert losses == train_reference(reference, batches, 4, lr=1e-2)


class StridedInput(nn.Module):
    """A Linear fed a transposed (non-contiguous) input, and a weight read by its parent."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = Embedding(c.vocab, c.d_model)
        self.square = nn.Linear(c.seq, c.seq)  # mixes positions: its input is x transposed
        self.mix = nn.Linear(c.d_model, c.d_model)
        self.out = nn.Linear(c.d_model, c.vocab)

    def forward(self, idx, targets):
        x = self.wte(idx)
        x = x + self.square(x.transpose(1, 2)).transpose(1, 2)
        x = self.mix(x)
        x = x + F.linear(x, self.mix.weight) * 0.5  # the parent reads mix's weight itself
        logits = self.out(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_a_use_that_keeps_the_data_copies_it_and_ends_the_lending(tmp_path):
    torch.manual_seed(0)
    model = StridedInput(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 5, 4)
    engine, _, _, _ = zero.initialize(model=model, config=nvme_config(tmp_path))
    watch = SavedInPool(engine)
    try:
        assert lent_units(engine) == {"square", "mix", "out"}
        losses = train_watched(engine, batches, 5, watch)
        assert watch.count == 0, "autograd kept a view of a pool buffer"
        assert lent_units(engine) == {"out"}
        assert not any(u.lent for u in engine.parts.units if u.layout.module_name in ("square", "mix"))
    finally:
        engine.destroy()
    assert losses == train_reference(reference, batches, 5, lr=1e-2)


def test_a_checkpointed_forward_copies_the_weights_it_recomputes_with(tmp_path):
    torch.manual_seed(0)
    model = CheckpointedGPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 4, 4)
    engine, _, _, _ = zero.initialize(model=model, config=nvme_config(tmp_path))
    try:
        assert "blocks.0.attn.qkv" in lent_units(engine)
        losses = train_watched(engine, batches, 4)
        assert not any(name.startswith("blocks.") for name in lent_units(engine))
    finally:
        engine.destroy()
    assert losses == train_reference(reference, batches, 4, lr=1e-2)


def test_kept_units_give_their_pool_room_to_forward_s_read_ahead(tmp_path):
    """Every unit is reused in backward, so kept lent units filled the small pool and the forward
    read one unit at a time (zero/runtime/prefetch.py, [Note: kept units give way to read-ahead]). Now forward's
    fetches find their units read ahead, and backward still reads no parameter again: a unit given
    way is kept as a copy."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6))
    reference = copy.deepcopy(model)
    batches = make_batches(GPTConfig(layers=6), 4, 4)
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2)  # fp32 shards homed in the master
    config["zero_optimization"]["offload_param"]["buffer_count"] = 2
    engine, _, _, _ = zero.initialize(model=model, config=config)
    coordinator, found = engine.parts.coordinator, []
    fetch = coordinator.fetch

    def watched(u, by=None):
        if not any(x.in_backward for x in coordinator.units):
            found.append(u.state.name)
        return fetch(u, by)

    coordinator.fetch = watched
    try:
        losses, after_backward = [], 0
        swapper = engine.parts.param_store.swapper
        for x, y in batches:
            found.clear()
            loss = engine(x, y)
            before = swapper.io_bytes.read
            engine.backward(loss)
            engine.step()
            after_backward = swapper.io_bytes.read - before
            losses.append(loss.item())
        ahead = found.count("INFLIGHT")
    finally:
        engine.destroy()
    assert ahead >= len(found) // 2, f"forward's fetches found {found}"
    assert after_backward == 0  # backward's parameters: kept copies and the optimizer's master
    assert losses == train_reference(reference, batches, 4, lr=1e-2)
