"""Parameters read outside the module that owns them, and shared between modules.

The head here is ``F.linear(x, self.wte.weight)`` in the root's forward: the
embedding's weight is used by a module that does not own it, without calling
the embedding. With parameters swapped to NVMe (so released between uses) the
engine gathers that unit on access, keeps it for the root's backward, and
trains exactly like plain PyTorch. An engine without an optimizer serves
forward passes only.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero.examples import Block, Embedding, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig()


class ExternalHead(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = Embedding(c.vocab, c.d_model)
        self.block = Block(c)
        self.mix = nn.Linear(c.d_model, c.d_model)

    def forward(self, idx, targets=None):
        x = self.block(self.wte(idx))
        x = x + F.linear(x, self.mix.weight) * 0.5  # another module's weight, without its forward
        logits = F.linear(x, self.wte.weight)  # the embedding's weight as the head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_parameters_used_outside_their_module_train_exactly(tmp_path, offload):
    torch.manual_seed(0)
    model = ExternalHead(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 6, 4)
    config = base_config(offload, "cpu", tmp_path, lr=1e-2, clip=1.0)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        losses = train_engine(engine, batches, 6)
        if offload == "nvme":  # really released between uses, so gathered on access
            assert not any(u.free for u in engine.parts.units)
            externals = engine.parts.coordinator.externals
            assert {u.layout.module_name for units in externals.values() for u in units} == {"wte", "mix"}
    finally:
        engine.destroy()
    assert losses == train_reference(reference, batches, 6, lr=1e-2, clip=1.0)


def test_an_engine_without_optimizer_serves_forward_passes(tmp_path):
    torch.manual_seed(0)
    model = ExternalHead(CFG)
    reference = copy.deepcopy(model)
    config = base_config("nvme", "none", tmp_path)
    del config["optimizer"]
    engine, optimizer, _, _ = zero.initialize(model=model, config=config)
    assert optimizer is None
    x, y = make_batches(CFG, 1, 4)[0]
    with torch.no_grad():
        assert engine(x, y).item() == reference(x, y).item()
    with pytest.raises(RuntimeError, match="this engine has no optimizer"):
        engine.backward(engine(x, y))
    engine.destroy()
