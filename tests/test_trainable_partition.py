"""The optimizer covers the trainable units only (zero/stores/layouts.py [Note: the optimizer covers
the trainable units only]): a unit with no parameter that requires grad has no fp32 master, no
optimizer states and no gradient; its shard comes after the trainable ones' in the rank space, in
sub-groups of its own, saved in checkpoints as its parameters' values."""
import contextlib
import copy
import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open

import zero
from helpers import base_config, lora_gpt, frozen_gathered_at_end_of_backward, ladder_config, run_ranks, train_engine, weights
from zero.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from zero.checkpoint.format import META, CheckpointCorruptionError, sub_group_file, units_from_meta
from zero.examples import GPT, GPTConfig, add_lora, make_batches, train_reference, train_reference_mixed
from zero.stores.layouts import build_rank_layout, build_unit_layout
from zero.stores.optimizer_store import FlatOptimizerStore, NvmeOptimizerStore
from zero.stores.rank_memory import RankSizes, rank_memory_parts
from swapper import InsufficientSwapSpaceError

CFG = GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16)
STATES = 2  # AdamW's exp_avg and exp_avg_sq


def lora_model(seed: int = 0) -> torch.nn.Module:
    return lora_gpt(CFG, seed)


def batches(n: int = 4):
    return make_batches(dataclasses.replace(CFG), n, 2)


def trainable_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def swap_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    return str(path)


def engine_of(model, config):
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine


@contextlib.contextmanager
def built(model, config):
    """An engine destroyed when the block ends."""
    engine = engine_of(model, config)
    try:
        yield engine
    finally:
        engine.destroy()


# -- the layout ----------------------------------------------------------------------------------------

def _units(sizes, world_size=1):
    return [build_unit_layout(i, f"m{i}", [((f"p{i}",), (n,))], world_size) for i, n in enumerate(sizes)]


def test_frozen_shards_come_after_the_trainable_ones_in_sub_groups_of_their_own():
    units = _units([100, 50, 30, 70, 20, 40])
    layout = build_rank_layout(units, 0, sub_group_size=120, frozen={0, 3, 4})
    # trainable 1, 2, 5 first (their order kept), then frozen 0, 3, 4
    assert [layout.offsets[i] for i in (1, 2, 5)] == [0, 50, 80]
    assert [layout.offsets[i] for i in (0, 3, 4)] == [120, 220, 290]
    assert [(sg.units, sg.start, sg.stop, sg.frozen) for sg in layout.sub_groups] == [
        ((1, 2, 5), 0, 120, False), ((0,), 120, 220, True), ((3, 4), 220, 310, True)]
    assert layout.trainable_numel == 120 and layout.numel == 310
    assert [sg.index for sg in layout.trainable_sub_groups] == [0]
    assert [u.index for u in layout.trainable_units()] == [1, 2, 5]


def test_without_frozen_units_the_layout_is_the_one_before():
    units = _units([100, 50, 30, 70, 20, 40], world_size=2)
    layout = build_rank_layout(units, 1, sub_group_size=60)
    assert layout.offsets == (0, 50, 75, 90, 125, 135)
    assert [(sg.units, sg.start, sg.stop) for sg in layout.sub_groups] == [
        ((0,), 0, 50), ((1, 2), 50, 90), ((3, 4), 90, 135), ((5,), 135, 155)]
    assert not any(sg.frozen for sg in layout.sub_groups) and layout.trainable_numel == layout.numel


# -- training ------------------------------------------------------------------------------------------

OFFLOADS = [("none", "none"), ("cpu", "cpu"), ("none", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")]


@pytest.mark.parametrize("offload_param,offload_optimizer", OFFLOADS)
def test_stage3_lora_trains_bit_equal_to_plain_pytorch_with_states_for_the_adapters_only(
        tmp_path, offload_param, offload_optimizer):
    model = lora_model()
    reference = copy.deepcopy(model)
    with built(model, base_config(offload_param, offload_optimizer, tmp_path, lr=1e-2, sub_group_size=2000)) as engine:
        layout = engine.rank_layout
        assert layout.frozen == {u.index for u in engine.parts.units if not u.grad_count} != set()
        assert layout.trainable_numel == trainable_numel(reference) < layout.numel // 4
        store = engine.parts.optimizer_store
        if isinstance(store, FlatOptimizerStore):
            assert all(s.numel() == layout.trainable_numel for s in store.states.values())
            assert store.grads.numel() == layout.trainable_numel
            # fp32 shards beside the master (computing on the CPU: host memory) are the master itself
            holds_params = offload_param != "nvme"
            assert store.master.numel() == (layout.numel if holds_params else layout.trainable_numel)
        else:
            assert isinstance(store, NvmeOptimizerStore)
            assert sorted(store.swapper.sub_group_ids) == [sg.index for sg in layout.trainable_sub_groups]
        losses = train_engine(engine, batches(), 4)
        assert losses == train_reference(reference, batches(), 4, lr=1e-2)
        got = weights(model)
        for name, p in reference.named_parameters():
            assert torch.equal(got[name], p.detach()), name


@pytest.mark.parametrize("stage", [1, 2])
def test_below_stage_3_lora_trains_bit_equal_to_plain_pytorch(tmp_path, stage):
    model = lora_model()
    reference = copy.deepcopy(model)
    with built(model, ladder_config(stage, "nvme", tmp_path)) as engine:
        assert engine.rank_layout.trainable_numel == trainable_numel(reference)
        assert train_engine(engine, batches(), 4) == train_reference(reference, batches(), 4, lr=1e-2)


def test_a_bf16_lora_step_equals_the_mixed_precision_recipe_and_the_frozen_base_stays_bf16_rounded(tmp_path):
    model = lora_model()
    reference = copy.deepcopy(model)
    with built(model, base_config("nvme", "nvme", tmp_path, lr=1e-2, precision="bf16")) as engine:
        losses = train_engine(engine, batches(), 3)
        expected = train_reference_mixed(reference, batches(), 3, torch.bfloat16, lr=1e-2)
        assert losses == expected


def test_with_the_optimizer_on_nvme_a_lora_step_moves_the_adapters_state_only(tmp_path):
    model = lora_model()
    with built(model, base_config("nvme", "nvme", tmp_path, lr=1e-2)) as engine:
        swapper = engine.parts.optimizer_store.swapper
        train_engine(engine, batches(), 1)
        engine.parts.param_store.flush()
        before = (swapper.io_bytes.read, swapper.io_bytes.written)
        train_engine(engine, batches()[1:], 2)
        engine.parts.param_store.flush()
        swapper.synchronize()
        trainable = engine.rank_layout.trainable_numel
        per_step = [(swapper.io_bytes.read - before[0]) / 2, (swapper.io_bytes.written - before[1]) / 2]
        # master, 2 states and the gradient, each padded to a 4 KiB page per sub-group at most
        bound = (2 + STATES) * (4 * trainable + 4096 * len(engine.rank_layout.trainable_sub_groups))
        assert 0 < per_step[0] <= bound and 0 < per_step[1] <= bound
        files = os.listdir(engine.parts.optimizer_store.swap_dir)
        assert len([f for f in files if "grad" not in f]) == len(engine.rank_layout.trainable_sub_groups)


def test_the_memory_model_counts_sixteen_bytes_per_trainable_element_only(tmp_path):
    model = lora_model()
    with built(model, base_config("cpu", "cpu", tmp_path, lr=1e-2)) as engine:
        sizes = RankSizes.of_layout(engine.rank_layout)
        assert sizes.optimized == engine.rank_layout.trainable_numel < sizes.shard
        zc = engine.config.zero_optimization
        parts = rank_memory_parts(sizes, stage=3, offload_param=zc.offload_param, offload_optimizer=zc.offload_optimizer,
                                  itemsize=4, compute_device="cpu", state_count=STATES)
        optimizer = [p for p in parts if "optimizer states" in p.what]
        # the master holds every fp32 shard (the parameters' home), states and gradient the trainable ones
        assert [p.nbytes for p in optimizer] == [4 * sizes.shard + (1 + STATES) * 4 * sizes.optimized]


def test_gathered_parameters_modifying_a_frozen_weight_changes_what_training_computes_with(tmp_path):
    for offload in ("none", "nvme"):
        model = lora_model()
        reference = copy.deepcopy(model)
        with built(model, base_config(offload, offload, swap_dir(tmp_path / offload), lr=1e-2)) as engine:
            with torch.no_grad():
                reference.ln_f.weight.mul_(0.5)
            with zero.GatheredParameters([model.ln_f.weight], modifier_rank=0):
                with torch.no_grad():
                    model.ln_f.weight.mul_(0.5)
            assert train_engine(engine, batches(), 2) == train_reference(reference, batches(), 2, lr=1e-2)
            assert torch.equal(weights(model)["ln_f.weight"], reference.ln_f.weight.detach())


# -- checkpoints ---------------------------------------------------------------------------------------

def _trained(tmp_path, offload="nvme", steps=2, model=None, **config):
    model = model or lora_model()
    engine = engine_of(model, base_config(offload, offload, swap_dir(tmp_path / "swap"), lr=1e-2, **config))
    train_engine(engine, batches(), steps)
    return engine, model


def test_a_lora_checkpoint_saves_frozen_sub_groups_as_their_values_and_resumes_exactly(tmp_path):
    engine, model = _trained(tmp_path)
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        saved = weights(model)
        after = train_engine(engine, batches()[2:], 2)
    finally:
        engine.destroy()
    meta = json.load(open(tmp_path / "ckpt" / "t" / META))
    layout = build_rank_layout(units_from_meta(meta), 0, meta["sub_group_size"], set(meta["frozen_units"]))
    assert layout.frozen and layout.sub_groups[-1].frozen
    for sg in layout.sub_groups:
        with safe_open(sub_group_file(str(tmp_path / "ckpt" / "t"), 0, sg.index), "pt") as f:
            tensors = {k for k in f.keys() if not k.startswith("__pad__")}  # (page padding of the format)
            assert tensors == ({"master"} if sg.frozen else {"master", "exp_avg", "exp_avg_sq"})
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
    for name, value in saved.items():
        assert torch.equal(consolidated[name], value), name
    for offload in ("nvme", "cpu"):
        with built(lora_model(seed=5), base_config(offload, offload, swap_dir(tmp_path / f"swap-{offload}"), lr=1e-2)) as engine2:
            engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
            assert all(torch.equal(v, saved[n]) for n, v in weights(engine2.module).items())
            assert train_engine(engine2, batches()[2:], 2) == after


def test_a_lora_checkpoint_loads_into_an_engine_that_trains_everything_with_fresh_states_for_the_base(tmp_path):
    engine, model = _trained(tmp_path)
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        saved = weights(model)
    finally:
        engine.destroy()
    unfrozen = lora_model(seed=5)
    unfrozen.requires_grad_(True)
    with built(unfrozen, base_config("nvme", "nvme", swap_dir(tmp_path / "swap2"), lr=1e-2)) as engine2:
        assert not engine2.rank_layout.frozen
        engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        assert all(torch.equal(v, saved[n]) for n, v in weights(engine2.module).items())
        for sg in engine2.rank_layout.sub_groups:
            master, states = engine2.parts.optimizer_store.read(sg)
            for index in sg.units:
                start, stop = engine2.rank_layout.unit_range(index)
                if not engine.parts.units[index].grad_count:  # frozen when saved: Adam starts again
                    assert all(not v[start - sg.start:stop - sg.start].any() for v in states.values())
        train_engine(engine2, batches(), 1)


def test_a_checkpoint_of_an_all_trainable_engine_loads_into_a_lora_engine(tmp_path):
    model = lora_model()
    model.requires_grad_(True)
    engine, _ = _trained(tmp_path, model=model)
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        saved = weights(model)
    finally:
        engine.destroy()
    with built(lora_model(seed=5), base_config("nvme", "nvme", swap_dir(tmp_path / "swap2"), lr=1e-2)) as engine2:
        assert engine2.rank_layout.frozen
        engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        assert all(torch.equal(v, saved[n]) for n, v in weights(engine2.module).items())


def test_a_damaged_frozen_units_record_is_refused(tmp_path):
    engine, _ = _trained(tmp_path, steps=1)
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        path = tmp_path / "ckpt" / "t" / META
        meta = json.load(open(path))
        for bad in ([0, 0], [-1], [10 ** 6], "0", [1.5]):
            json.dump(dict(meta, frozen_units=bad), open(path, "w"))
            with pytest.raises(CheckpointCorruptionError, match="frozen_units"):
                get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
            with pytest.raises(CheckpointCorruptionError, match="frozen_units"):
                engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    finally:
        engine.destroy()


def scenario_save_lora_on_two_ranks(rank, world_size, scratch):
    model = lora_model()
    config = base_config("nvme", "nvme", swap_dir(os.path.join(scratch, f"swap{rank}")), lr=1e-2, world_size=world_size,
                         micro=2, sub_group_size=2000)
    with built(model, config) as engine:
        train_engine(engine, batches(), 2, rank=rank, shards=world_size)
        engine.save_checkpoint(os.path.join(scratch, "ckpt"), tag="t")
        losses = train_engine(engine, batches()[2:], 2, rank=rank, shards=world_size)
        return {"losses": losses, "frozen": sorted(engine.rank_layout.frozen)}


def test_a_lora_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    results = run_ranks(2, [("save", scenario_save_lora_on_two_ranks, {})], tmp_path)
    assert results[0]["save"]["frozen"]
    ckpt = str(tmp_path / "save" / "ckpt")
    consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    with built(lora_model(seed=5), base_config("nvme", "nvme", swap_dir(tmp_path / "swap"), lr=1e-2, micro=4)) as engine:
        engine.load_checkpoint(ckpt, tag="t")
        got = weights(engine.module)
        assert all(torch.equal(got[n], consolidated[n]) for n in got)
        losses = train_engine(engine, batches()[2:], 2)
        two_ranks = [sum(results[r]["save"]["losses"][i] for r in range(2)) / 2 for i in range(2)]
        assert losses == pytest.approx(two_ranks, rel=1e-5)


def test_the_estimate_gives_optimizer_state_to_the_modules_that_train_only():
    from zero.stores.estimator import estimate_rank_bytes

    model = lora_model()
    total = sum(p.numel() for p in model.parameters())
    trainable = trainable_numel(model)

    def optimizer_bytes(**kw):
        rank = estimate_rank_bytes(model, stage=3, offload_param="nvme", offload_optimizer="cpu", dtype="fp32",
                                   compute_device="cpu", **kw)
        return sum(p.nbytes for p in rank.parts if "optimizer states" in p.what)

    assert optimizer_bytes() == 16 * trainable < 16 * total // 4
    assert optimizer_bytes(trainable_params=total) == 16 * total  # a count: everything unless told
    model.ln_f.bias.requires_grad_(True)  # its module's frozen weight is a unit of its own: no master
    assert optimizer_bytes() == 16 * (trainable + model.ln_f.bias.numel())
    with pytest.raises(ValueError, match="trainable_params must be between 0 and the model's"):
        optimizer_bytes(trainable_params=total + 1)


@pytest.mark.parametrize("stage,offload_param", [(3, "nvme"), (2, "none")])
def test_a_checkpoint_saved_while_frozen_units_stay_gathered_resumes_exactly(tmp_path, stage, offload_param):
    # the layer norms and adapters persistent (gathered between steps): stage 3 with a threshold, or stage 2
    config = base_config(offload_param, "nvme", swap_dir(tmp_path / "swap"), lr=1e-2, stage=stage,
                         stage3_param_persistence_threshold=400 if stage == 3 else 0)
    if stage < 3:
        config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                       if not k.startswith("stage3_") and k != "offload_param"}
    model = lora_model()
    with built(model, config) as engine:
        assert any(u.persistent and not u.grad_count for u in engine.parts.units)
        train_engine(engine, batches(), 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        saved = weights(model)
        after = train_engine(engine, batches()[2:], 2)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = swap_dir(tmp_path / "swap2")
    if stage == 3:
        config["zero_optimization"]["offload_param"]["nvme_path"] = swap_dir(tmp_path / "swap2")
    with built(lora_model(seed=5), config) as engine2:
        engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        assert all(torch.equal(v, saved[n]) for n, v in weights(engine2.module).items())
        assert train_engine(engine2, batches()[2:], 2) == after


def test_parameter_swap_space_is_asked_for_the_frozen_units_files_only_where_the_rest_is_homed(tmp_path, monkeypatch):
    # fp32 parameters and optimizer on NVMe: a trainable unit's shard lives in the optimizer's master
    # (zero/stores/param_store.py), a frozen one's in a swap file of its own; the drive needs room for those only.
    model = lora_model()
    frozen_bytes = 4 * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    params, states = swap_dir(tmp_path / "params"), swap_dir(tmp_path / "states")
    room = {params: frozen_bytes, states: 1 << 40}  # less than every parameter's 4 bytes
    monkeypatch.setattr("swapper._swap_dir.disk_free_bytes", lambda path: room[os.fspath(path)])
    config = base_config("nvme", "nvme", params, lr=1e-2)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = states
    with built(model, config) as engine:
        train_engine(engine, batches(), 2)
    room[params] = frozen_bytes - 1
    with pytest.raises(InsufficientSwapSpaceError, match="parameter partitions in files of their own need"):
        engine_of(lora_model(), config)


# -- frozen units in backward (zero/runtime/hooks.py [Note: frozen units in backward]) -------------------

def _lora_checkpointed(seed: int = 0):
    from helpers import CheckpointedGPT

    torch.manual_seed(seed)
    model = CheckpointedGPT(CFG)
    torch.manual_seed(seed + 1)
    add_lora(model, rank=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


def test_a_frozen_unit_goes_once_its_modules_backward_is_over_not_at_the_end_of_backward(tmp_path, monkeypatch):
    model = lora_model()
    reference = copy.deepcopy(model)
    with built(model, base_config("nvme", "nvme", tmp_path, lr=1e-2)) as engine:
        frozen = [u for u in engine.parts.units if u.index in engine.rank_layout.frozen and not u.persistent]
        assert len(frozen) > 8
        at_end = frozen_gathered_at_end_of_backward(monkeypatch)
        assert train_engine(engine, batches(), 3) == train_reference(reference, batches(), 3, lr=1e-2)
        # the embedding alone (its input, token ids, takes no gradient): before, every frozen unit
        # the backward had gathered (13 of 15 here) stayed until its end
        assert at_end == [1, 1, 1]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_in_a_train_batch_window_a_frozen_unit_goes_once_the_last_micro_batch_is_done_with_it(
        tmp_path, monkeypatch, checkpointed):
    """A window's unit serves k backwards: it went at the end of backward (13 of 15 frozen units
    gathered then, as in the loop before), now after the k-th backward through its module."""
    from zero.engine.train_batch import TrainBatch
    from zero.runtime.unit import ParamState, ParamUnit

    make = _lora_checkpointed if checkpointed else lora_model
    micro = batches(6)
    windows = [micro[i:i + 2] for i in range(0, 6, 2)]  # 3 windows of 2 micro-batches
    config = base_config("nvme", "nvme", swap_dir(tmp_path / "loop"), lr=1e-2, accumulation=2, micro=2)
    with built(make(), config) as loop:  # the reference: the micro-batch loop
        for window in windows:
            train_engine(loop, window, 1, accumulation=2)
        expected = weights(loop.module)
    config = base_config("nvme", "nvme", swap_dir(tmp_path / "window"), lr=1e-2, accumulation=2, micro=2)
    with built(make(), config) as engine:
        frozen = [u for u in engine.parts.units if u.index in engine.rank_layout.frozen and not u.persistent]
        at_end = frozen_gathered_at_end_of_backward(monkeypatch)
        monkeypatch.setattr(TrainBatch, "_loop", lambda *a, **k: pytest.fail("train_batch ran the loop"))
        gathers = {u.index: 0 for u in frozen}
        gather = ParamUnit.gather

        def gathering(unit, *a, **k):
            gathers[unit.index] = gathers.get(unit.index, 0) + (unit.state is not ParamState.AVAILABLE)
            return gather(unit, *a, **k)
        monkeypatch.setattr(ParamUnit, "gather", gathering)
        for window in windows:
            engine.train_batch(window)
        assert at_end == [1, 1, 1]  # the embedding's (its input takes no gradient)
        # at most once for the window's forwards and once for its backwards: released after the last
        # micro-batch, not sooner (a checkpointed segment's recompute hooks its first input twice);
        # a tied weight (the embedding, read by the head too) is gathered for each of its modules
        tied = {u for u in frozen if any(len(slot.names) > 1 for slot in u.layout.slots)}
        assert tied and all(gathers[u.index] <= 2 * len(windows) for u in frozen if u not in tied), gathers
        got = weights(engine.module)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


@pytest.mark.parametrize("offload", ["nvme", "none"])
def test_non_reentrant_activation_checkpointing_with_a_frozen_base_trains_as_plain_pytorch(tmp_path, offload):
    # torch.utils.checkpoint(use_reentrant=False) saves a frozen weight itself: a recomputed forward
    # that released it emptied the tensor backward reads ("Recomputed values ... different metadata")
    model = _lora_checkpointed()
    reference = copy.deepcopy(model)
    with built(model, base_config(offload, offload, tmp_path, lr=1e-2)) as engine:
        assert train_engine(engine, batches(), 3) == train_reference(reference, batches(), 3, lr=1e-2)
        got = weights(model)
        for name, p in reference.named_parameters():
            assert torch.equal(got[name], p.detach()), name


# -- a module's frozen and trainable parameters (zero/runtime/unit.py [Note: a module's frozen and ...]) --

def lora_with_biases(seed: int = 0) -> torch.nn.Module:
    """peft's bias="all": the adapters and every bias train, the base weights stay frozen."""
    model = lora_model(seed)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.requires_grad_(True)
    return model


@pytest.mark.parametrize("offload_param,offload_optimizer", [("nvme", "nvme"), ("none", "cpu")])
def test_frozen_weights_beside_trained_biases_get_no_optimizer_state_and_train_as_plain_pytorch(
        tmp_path, offload_param, offload_optimizer):
    model = lora_with_biases()
    reference = copy.deepcopy(model)
    mixed = [m for m in model.modules() if len({p.requires_grad for p in m.parameters(recurse=False)}) == 2]
    assert mixed  # the case: modules owning a frozen weight and a trained bias
    with built(model, base_config(offload_param, offload_optimizer, tmp_path, lr=1e-2, sub_group_size=2000)) as engine:
        layout = engine.rank_layout
        assert layout.trainable_numel == trainable_numel(reference)  # was the mixed modules' weights too
        for unit in engine.parts.units:
            kinds = {p.requires_grad for p in unit.params}
            assert len(kinds) == 1 and (unit.index in layout.frozen) == (kinds == {False})
        if offload_param == "nvme":  # a split Linear's weight unit still lends its pool buffer to the Linear
            assert any(u.owner is not None and len(u.params) < len([p for p in u.owner._parameters.values() if p is not None])
                       for u in engine.parts.units)
        losses = train_engine(engine, batches(), 4)
        assert losses == train_reference(reference, batches(), 4, lr=1e-2)
        got = weights(model)
        for name, p in reference.named_parameters():
            assert torch.equal(got[name], p.detach()), name


@pytest.mark.parametrize("saved_split,loaded_split", [(False, True), (True, False)],
                         ids=["one unit a module, loaded split", "split, loaded as one unit a module"])
def test_a_checkpoint_grouping_a_modules_parameters_otherwise_resumes_exactly(tmp_path, monkeypatch, saved_split,
                                                                             loaded_split):
    """zero/checkpoint/regroup.py [Note: a checkpoint grouped otherwise]: a checkpoint saved before
    modules were split (or after, loaded by an engine that does not split) loads by parameter name,
    masters and Adam states, and training goes on as it would have."""
    from zero.engine import build

    plan = build.plan_units

    def grouping(split):
        monkeypatch.setattr(build, "plan_units", lambda m, w, split_frozen=False: plan(m, w, split and split_frozen))

    grouping(saved_split)
    engine, model = _trained(tmp_path, model=lora_with_biases())
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        saved = weights(model)
        units_saved = len(engine.parts.units)
        after = train_engine(engine, batches()[2:], 2)
    finally:
        engine.destroy()
    grouping(loaded_split)
    for offload in ("nvme", "cpu"):
        config = base_config(offload, offload, swap_dir(tmp_path / f"swap-{offload}"), lr=1e-2)
        with built(lora_with_biases(seed=5), config) as engine2:
            assert len(engine2.parts.units) != units_saved  # grouped otherwise
            engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
            assert all(torch.equal(v, saved[n]) for n, v in weights(engine2.module).items())
            assert train_engine(engine2, batches()[2:], 2) == after


def test_a_checkpoint_of_other_parameters_is_still_refused_by_name(tmp_path):
    engine, _ = _trained(tmp_path, model=lora_with_biases())
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    finally:
        engine.destroy()
    other = GPT(dataclasses.replace(CFG, layers=3))
    with built(other, base_config("nvme", "nvme", swap_dir(tmp_path / "swap2"), lr=1e-2)) as engine2:
        with pytest.raises(ValueError, match=r"saved from a different model \(parameters differ: \[\(.blocks\.0\.attn\.proj\.base"):
            engine2.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
