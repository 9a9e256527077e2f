"""zero.Init and zero.GatheredParameters.

A model built inside ``zero.Init`` never holds its full parameters (each is
an empty tensor with ``ds_shape`` once its module is built), gathers to the
same values a plain construction gives, and trains exactly like it.
``GatheredParameters(..., modifier_rank=0)`` writes changes back, before an
engine exists and during training (master weights included).
"""
import copy

import pytest
import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, train_engine

CFG = GPTConfig()


def build(init: bool, seed: int = 0, config=None):
    torch.manual_seed(seed)
    if not init:
        return GPT(CFG)
    with zero.Init(config_dict_or_path=config):
        return GPT(CFG)


def test_parameters_are_partitioned_as_modules_are_built():
    model = build(True)
    plain = build(False)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.numel() == 0 and p.ds_shape == q.shape and p.ds_numel == q.numel(), name
    with zero.GatheredParameters(list(model.parameters())):
        for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(p, q), name
    assert all(p.numel() == 0 for p in model.parameters())  # released again
    assert model.head.weight is model.wte.weight  # tying after construction still works


def test_classes_are_restored_after_the_context():
    init_before = torch.nn.Linear.__init__
    build(True)
    assert torch.nn.Linear.__init__ is init_before
    assert torch.nn.Linear(2, 3).weight.shape == (3, 2)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_model_built_in_init_trains_like_the_plain_one(tmp_path, offload):
    config = base_config(offload, offload, tmp_path, lr=1e-2, clip=1.0)
    model = build(True, config=config)
    batches = make_batches(CFG, 5, 4)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    losses = train_engine(engine, batches, 5)
    engine.destroy()
    assert losses == train_reference(build(False), batches, 5, lr=1e-2, clip=1.0)


def test_modifier_rank_writes_back_before_initialize():
    model = build(True)
    with zero.GatheredParameters([model.ln_f.weight, model.pos], modifier_rank=0):
        with torch.no_grad():
            model.ln_f.weight.fill_(0.5)
            model.pos.zero_()
    with zero.GatheredParameters([model.ln_f.weight, model.pos]):
        assert torch.equal(model.ln_f.weight, torch.full((CFG.d_model,), 0.5))
        assert not model.pos.any()


@pytest.mark.parametrize("offload,precision", [("none", "fp32"), ("nvme", "fp32"), ("cpu", "bf16")])
def test_modifier_rank_during_training_reaches_the_master_weights(tmp_path, offload, precision):
    model = build(False)
    reference = copy.deepcopy(model)
    batches = make_batches(CFG, 4, 4)
    config = base_config(offload, offload, tmp_path, lr=1e-2, precision=precision)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    train_engine(engine, batches[:2], 2)
    with zero.GatheredParameters(model.head.weight, modifier_rank=0):
        with torch.no_grad():
            model.head.weight.mul_(0.5)
    with zero.GatheredParameters(model.head.weight):
        modified = model.head.weight.detach().float().clone()
    unit = model.head.weight._zero_unit
    layout = engine.parts.rank_layout
    sg = layout.sub_group_of(unit.index)
    master, _ = engine.parts.optimizer_store.read(sg)
    start = layout.offsets[unit.index] - sg.start
    assert torch.equal(master[start:start + modified.numel()].view_as(modified), modified)
    train_engine(engine, batches[2:3], 1)
    with zero.GatheredParameters(model.head.weight):
        after = model.head.weight.detach().float().clone()
    engine.destroy()
    assert not torch.equal(after, modified)
    if precision == "fp32":
        # The step started from the halved fp32 master: compare with plain PyTorch doing the same.
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        for i, (x, y) in enumerate(batches[:3]):
            if i == 2:
                with torch.no_grad():
                    reference.head.weight.mul_(0.5)
                assert torch.equal(reference.head.weight, modified)
            reference(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(after, reference.head.weight)


def test_init_of_an_existing_module():
    torch.manual_seed(0)
    model = GPT(CFG)
    values = [p.detach().clone() for p in model.parameters()]
    zero.Init(module=model)
    assert all(p.numel() == 0 for p in model.parameters())
    with zero.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
