"""zero/runtime/hooks.py ``refresh`` and ``gather_persistent``: after a step, only the units the step
changed (those with a trainable parameter) stop being gathered, and every persistent unit is
gathered again at once, its reads from NVMe all in flight together, so no forward fetches a
persistent unit one at a time. A LoRA model shows both: its frozen layer norms and its adapters
are under the persistence threshold, its frozen base weights above it."""
import copy
import dataclasses

import torch

import zero
from helpers import base_config, run_ranks, train_engine
from zero.examples import GPT, GPTConfig, add_lora, make_batches, train_reference
from zero.runtime.hooks import Coordinator

CFG = GPTConfig(vocab=64, d_model=32, heads=2, layers=3, seq=16)
THRESHOLD = 400  # layer norms (64) and rank-2 adapters (64-192 elements) persistent; base weights not


def _lora_model():
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(1)
    add_lora(model, rank=2)
    with torch.no_grad():  # adapters start at zero in B: make them matter from the first step
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


def _engine(tmp_path, model, stage=3, offload_param="nvme", **extra):
    config = base_config(offload_param, "cpu", tmp_path, lr=1e-2, stage=stage,
                         stage3_param_persistence_threshold=THRESHOLD, **extra)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine


class _Fetches:
    """Each unit the parameter store fetches: (unit index, read ahead before the fetch, fetched
    by a refresh's gather of the persistent units rather than by a forward or backward)."""

    def __init__(self, engine, monkeypatch):
        store = engine.parts.param_store
        self.log = []
        self.in_refresh = False
        real_fetch, real_gather = store.fetch, Coordinator.gather_persistent

        def fetch(layout, *args, **kwargs):
            self.log.append((layout.index, layout.index in getattr(store, "_prefetched", {}), self.in_refresh))
            return real_fetch(layout, *args, **kwargs)

        def gather_persistent(coordinator, *args):
            self.in_refresh = True
            try:
                real_gather(coordinator, *args)
            finally:
                self.in_refresh = False

        monkeypatch.setattr(store, "fetch", fetch)
        monkeypatch.setattr(Coordinator, "gather_persistent", gather_persistent)


def _train_and_compare(tmp_path, monkeypatch, stage, offload_param):
    model = _lora_model()
    reference = copy.deepcopy(model)
    batches = make_batches(dataclasses.replace(CFG), 4, 2)
    engine = _engine(tmp_path, model, stage=stage, offload_param=offload_param)
    try:
        units = engine.parts.units
        persistent = {u.index for u in units if u.persistent}
        trainable = {u.index for u in units if u.grad_count}
        assert persistent - trainable and persistent & trainable  # frozen and trainable persistent units
        losses = train_engine(engine, batches[:1], 1)  # (stage 3 gathers a persistent unit at its first use)
        assert all(units[i].state.name == "AVAILABLE" for i in persistent - trainable)  # kept by the step
        assert all(units[i].state.name == "NOT_AVAILABLE" for i in persistent & trainable)  # till a forward
        kept = {i: units[i].full for i in persistent - trainable}
        fetches = _Fetches(engine, monkeypatch)
        losses += train_engine(engine, batches[1:], 3)
        log = list(fetches.log)  # (the gathers below fetch what the last step released)
        # frozen persistent units were never gathered again: the same tensors, never fetched
        assert all(units[i].full is kept[i] for i in kept)
        assert not {i for i, _, _ in log} & set(kept)
        expected = train_reference(reference, batches, 4, lr=1e-2)
        assert losses == expected  # (fp32, one rank: bit for bit)
        with zero.GatheredParameters(list(model.parameters())):
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(p, q), name
        return engine, log, persistent, trainable
    except BaseException:
        engine.destroy()
        raise


def test_stage3_after_a_step_the_trainable_persistent_units_are_read_together_and_no_forward_fetches_one(
        tmp_path, monkeypatch):
    engine, log, persistent, trainable = _train_and_compare(tmp_path, monkeypatch, 3, "nvme")
    try:
        by_forward = [i for i, _, refresh in log if not refresh]
        by_refresh = [(i, ahead) for i, ahead, refresh in log if refresh]
        assert by_forward and not set(by_forward) & persistent
        assert sorted(i for i, _ in by_refresh) == sorted(list(persistent & trainable) * 3)  # after each step
        assert all(ahead for _, ahead in by_refresh)  # every read started before the first gather
    finally:
        engine.destroy()


def scenario_stage2_lora(rank, world_size, scratch):
    """Stage 2, two ranks (gloo): every unit persistent, gathered by an all-gather. A step gathers
    again the units it changed, the adapters; the frozen base stays as it was gathered at the
    build. Against DDP on the same process group, each rank its half of every batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _lora_model()
    reference = copy.deepcopy(model)
    batches = make_batches(dataclasses.replace(CFG), 4, 2 * world_size)
    config = base_config("none", "cpu", scratch, lr=1e-2, stage=2, world_size=world_size, micro=2)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    fetched = []
    real_gather = Coordinator.gather_persistent

    def gather_persistent(coordinator, *args):
        fetched.append(sorted(u.index for u in coordinator.units if u.state.name != "AVAILABLE"))
        real_gather(coordinator, *args)

    Coordinator.gather_persistent = gather_persistent
    try:
        units = engine.parts.units
        kept = {u.index: u.full for u in units if not u.grad_count}
        losses = train_engine(engine, batches, 4, rank=rank, shards=world_size)
        same = all(units[i].full is t for i, t in kept.items())
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        Coordinator.gather_persistent = real_gather
        engine.destroy()
    ddp = DDP(reference)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01,
                            fused=True)
    expected = []
    for x, y in batches:
        loss = ddp(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        expected.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "expected": expected, "kept_same": same, "frozen": sorted(kept),
            "trainable": sorted(u.index for u in units if u.grad_count), "gathered_after_steps": fetched,
            "unequal": [n for n, p in reference.named_parameters() if not torch.equal(final[n], p.detach())]}


def test_stage2_two_ranks_a_step_gathers_again_only_the_units_it_changed(tmp_path):
    results = run_ranks(2, [("lora", scenario_stage2_lora, {})], tmp_path)
    for rank, got in enumerate(results):
        got = got["lora"]
        assert "error" not in got, got.get("error")
        assert got["frozen"] and got["trainable"]
        assert got["gathered_after_steps"] == [got["trainable"]] * 4, rank  # (the build gathered all)
        assert got["kept_same"]
        assert got["losses"] == got["expected"] and got["unequal"] == []  # (accumulation 1: bit for bit)
    assert results[0]["lora"]["losses"] != results[1]["lora"]["losses"]  # each rank its own half


def test_a_load_gathers_every_persistent_unit_again_frozen_ones_included(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    saved = _engine(tmp_path / "a", _lora_model())
    try:
        batches = make_batches(dataclasses.replace(CFG), 1, 2)
        train_engine(saved, batches, 1)
        saved.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        with zero.GatheredParameters(list(saved.module.parameters())):
            want = {n: p.detach().clone() for n, p in saved.module.named_parameters()}
    finally:
        saved.destroy()
    other = _lora_model()
    with torch.no_grad():
        for p in other.parameters():  # every value differs from the saved one, frozen ones too
            p.add_(1.0)
    engine = _engine(tmp_path / "b", other)
    try:
        frozen = [u for u in engine.parts.units if u.persistent and not u.grad_count]
        assert frozen
        train_engine(engine, batches, 1)  # gathered at their first use, kept since
        assert all(u.state.name == "AVAILABLE" for u in frozen)
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        assert all(u.state.name == "NOT_AVAILABLE" for u in frozen)  # released by the load,
        with torch.no_grad():
            engine(*batches[0])  # gathered again together when the next forward starts
        for u in frozen:
            assert u.state.name == "AVAILABLE"
            for p in u.params:
                name = next(n for n, q in other.named_parameters() if q is p)
                assert torch.equal(p.detach(), want[name]), name
    finally:
        engine.destroy()
