"""A DeepSpeed ZeRO checkpoint loads into this engine by ``engine.load_checkpoint(dir)`` and the
run continues as DeepSpeed continued it.

The fixtures under tests/data/deepspeed_ckpt/ were made by DeepSpeed 0.19.8 itself
(tools/make_deepspeed_checkpoints.py: the tiny GPT of zero.examples, 2 gloo ranks on the CPU,
ZeRO stages 1, 2 and 3 in fp32 and stage 2 in bf16, AdamW with torch_adam, a WarmupDecayLR
schedule, gradient clipping; ``pos`` frozen at stages 1 and 3, and left out of the files by
``exclude_frozen_parameters=True`` in the ``*_exclude_frozen`` ones), each next to a JSON file with
the config, the data and the losses and learning rates DeepSpeed got in the steps after the
checkpoint. Here each is loaded at its own stage and at others, on 1 and 2 ranks, and the next
steps are compared with DeepSpeed's.

Tolerance: DeepSpeed's torch_adam steps with torch.optim.AdamW, this engine with torch's fused
AdamW kernel, and a rank's gradient is reduced in another order, so the losses agree to float
rounding: measured within 1.1e-7 relative in fp32 and 2e-5 in bf16 (the forward in bf16); the
tests allow 1e-5 (fp32) and 5e-4 (bf16) relative. Learning rates and counters are exact.
"""
import copy
import hashlib
import json
import logging
import os
import pickletools
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import zero
from zero.checkpoint.deepspeed_files import STAND_INS, load_file
from zero.examples import GPT, GPTConfig, make_batches
from helpers import make_engine, run_ranks, same_weights, weights

FIXTURES = Path(__file__).resolve().parent / "data" / "deepspeed_ckpt"
NAMES = ("stage1", "stage2", "stage3", "stage2_bf16")
RTOL = {"fp32": 1e-5, "bf16": 5e-4}


def record(name: str) -> dict:
    with open(FIXTURES / f"{name}.json") as f:
        return json.load(f)


def precision(rec: dict) -> str:
    return "bf16" if rec["ds_config"].get("bf16", {}).get("enabled") else "fp32"


def engine_config(rec: dict, stage: int, world_size: int, offload: str = "none", nvme_path=None) -> dict:
    """DeepSpeed's config of the fixture, at ``stage`` on ``world_size`` ranks (the same global batch)."""
    config = copy.deepcopy(rec["ds_config"])
    accumulation = config["gradient_accumulation_steps"]
    micro = rec["data"]["batch"] // world_size
    config.update(train_micro_batch_size_per_gpu=micro, train_batch_size=micro * accumulation * world_size)
    zc = {"stage": stage, "sub_group_size": 700}
    if stage == 3:
        zc["stage3_param_persistence_threshold"] = 0
    if offload != "none":
        zc["offload_optimizer"] = {"device": offload, "nvme_path": str(nvme_path)}
    config["zero_optimization"] = zc
    return config


def fixture_model(rec: dict):
    def build():
        model = GPT(GPTConfig(**rec["model"]))
        for name in rec["frozen"]:
            model.get_parameter(name).requires_grad_(False)
        return model
    return build


def continue_run(rank: int, world_size: int, scratch, name: str, stage: int, offload: str = "none",
                 seed: int = 7, strict: bool = True) -> dict:
    """Load fixture ``name`` into an engine at ``stage`` (its model built after ``seed``) and train
    the steps DeepSpeed took after the checkpoint; what the engine said at the load and after each step."""
    rec = record(name)
    engine = make_engine(scratch, config=engine_config(rec, stage, world_size, offload, scratch), seed=seed,
                         model=fixture_model(rec))
    try:
        path, client = engine.load_checkpoint(FIXTURES / name, load_module_strict=strict)
        out = {"path": path, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
               "micro_steps": engine.micro_steps, "adam_step": engine.optimizer.adam_step,
               "lr": engine.get_lr(), "client_keys": sorted(client), "ds_version": client.get("ds_version")}
        accumulation = engine.gradient_accumulation_steps()
        c = GPTConfig(**rec["model"])
        batches = make_batches(c, rec["data"]["micro_batches"], rec["data"]["batch"], seed=rec["data"]["seed"])
        losses, lrs = [], []
        for i, (x, y) in enumerate(batches[rec["global_steps"] * accumulation:]):
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            loss = engine(x, y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
            if (i + 1) % accumulation == 0:
                lrs.append(engine.get_lr()[0])
        out.update(losses=losses, lrs=lrs, steps_after=engine.global_steps, samples_after=engine.global_samples)
        return out
    finally:
        engine.destroy()


def check_continuation(out: dict, rec: dict, rank: int, world_size: int) -> None:
    accumulation = rec["ds_config"]["gradient_accumulation_steps"]
    steps = rec["global_steps"]
    assert out["global_steps"] == steps and out["global_samples"] == rec["global_samples"]
    assert out["micro_steps"] == steps * accumulation and out["adam_step"] == steps
    assert out["lr"] == [rec["lrs_before"][-1]]  # the schedule at the checkpoint
    assert out["lrs"] == rec["lrs_after"]  # and as it went on
    assert out["steps_after"] == steps + len(rec["lrs_after"])
    assert out["samples_after"] == rec["global_samples"] + len(rec["lrs_after"]) * rec["data"]["batch"] * accumulation
    assert out["ds_version"] == "0.19.8" and "ds_config" in out["client_keys"]
    if world_size == 1:  # the whole batch: the mean of the two ranks' equal halves
        expected = [sum(v) / len(v) for v in zip(*rec["losses_after"])]
    else:
        expected = rec["losses_after"][rank]
    assert out["losses"] == pytest.approx(expected, rel=RTOL[precision(rec)], abs=0)


# -- one rank ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, stage", [("stage1", 1), ("stage1", 3), ("stage2", 2), ("stage2", 0),
                                         ("stage3", 3), ("stage3", 1), ("stage2_bf16", 2), ("stage2_bf16", 3)])
def test_a_deepspeed_checkpoint_continues_as_deepspeed_did_on_one_rank(tmp_path, name, stage):
    check_continuation(continue_run(0, 1, tmp_path, name, stage), record(name), 0, 1)


def test_a_deepspeed_checkpoint_continues_with_the_optimizer_on_nvme(tmp_path):
    check_continuation(continue_run(0, 1, tmp_path, "stage3", 3, offload="nvme"), record("stage3"), 0, 1)


# -- saved with exclude_frozen_parameters=True -----------------------------------------------------

@pytest.mark.parametrize("name, stage", [("stage1_exclude_frozen", 1), ("stage1_exclude_frozen", 3),
                                         ("stage3_exclude_frozen", 3), ("stage3_exclude_frozen", 2)])
def test_a_deepspeed_checkpoint_without_its_frozen_parameters_continues_with_the_models_own(tmp_path, name, stage):
    """The frozen ``pos`` is not in the files: the model built as DeepSpeed's was (its seed) keeps
    its own, and the run goes on as DeepSpeed's did."""
    rec = record(name)
    assert rec["exclude_frozen_parameters"] and "pos" not in rec["zero_to_fp32_sha256"]
    check_continuation(continue_run(0, 1, tmp_path, name, stage, seed=rec["model_seed"], strict=False), rec, 0, 1)


def test_a_strict_load_of_it_is_refused_saying_why(tmp_path):
    rec = record("stage3_exclude_frozen")
    engine = make_engine(tmp_path, config=engine_config(rec, 3, 1), model=fixture_model(rec))
    try:
        before = weights(engine.module)
        with pytest.raises(ValueError, match=r"parameters missing from it: pos \(saved with "
                                             r"exclude_frozen_parameters=True\? load_module_strict=False keeps"):
            engine.load_checkpoint(FIXTURES / "stage3_exclude_frozen")
        assert same_weights(before, weights(engine.module)) and engine.global_steps == 0
    finally:
        engine.destroy()


def test_a_parameter_it_lacks_that_this_engine_trains_is_named(tmp_path, caplog):
    """Non-strict, it keeps its value (and zero states), said in a warning; strict, the error does not
    blame exclude_frozen_parameters (what the checkpoint lacks is trained here)."""
    rec = record("stage3_exclude_frozen")
    trained = {**rec, "frozen": []}  # pos trains here
    engine = make_engine(tmp_path, config=engine_config(rec, 3, 1), model=fixture_model(trained))
    try:
        with pytest.raises(ValueError, match=r"parameters missing from it: pos\)"):
            engine.load_checkpoint(FIXTURES / "stage3_exclude_frozen")
        with caplog.at_level(logging.WARNING, logger="zero"):
            engine.load_checkpoint(FIXTURES / "stage3_exclude_frozen", load_module_strict=False)
        assert "lacks 1 parameter(s) this engine trains (pos): they keep this model's values" in caplog.text
    finally:
        engine.destroy()


# -- two ranks --------------------------------------------------------------------------------------

def test_deepspeed_checkpoints_continue_as_deepspeed_did_on_two_ranks(tmp_path):
    cases = [("stage1", 2), ("stage2", 3), ("stage3", 3), ("stage2_bf16", 1)]
    scenarios = [(f"{name}_at_{stage}", continue_run, {"name": name, "stage": stage}) for name, stage in cases]
    results = run_ranks(2, scenarios, tmp_path)
    for rank, result in enumerate(results):
        for (name, stage), (key, _, _) in zip(cases, scenarios):
            assert "error" not in result[key], result[key].get("error")
            check_continuation(result[key], record(name), rank, 2)


# -- what the files hold ----------------------------------------------------------------------------

def _globals(path: Path) -> set:
    """Every global a torch.save file's pickle names ("module.name")."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        elif "UNICODE" in op.name:
            strings.append(arg)
    return found


def test_the_deepspeed_types_in_the_files_are_exactly_those_mapped_onto_stand_ins():
    files = sorted(FIXTURES.glob("*/global_step*/*.pt"))
    named = set().union(*(_globals(p) for p in files))
    deepspeed = {g for g in named if g.startswith("deepspeed.")}
    # DynamicLossScaler only in fp16 runs (test_an_fp16_dynamic_loss_scale_carries_over)
    assert deepspeed == set(STAND_INS) - {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
    assert not {g for g in named - deepspeed if not g.startswith(("torch.", "collections.OrderedDict"))}
    # torch alone refuses them: that is why the stand-ins exist
    optim = next(p for p in files if p.name.endswith("optim_states.pt"))
    with pytest.raises(Exception, match="deepspeed"):
        torch.load(optim, weights_only=True)


# -- refused, naming what and why; the engine untouched --------------------------------------------

class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def trained(tmp_path):
    """An engine (stage 2, one rank) trained one step, and a copy of the stage-2 fixture to damage."""
    rec = record("stage2")
    engine = make_engine(tmp_path / "swap", config=engine_config(rec, 2, 1), model=fixture_model(rec))
    c = GPTConfig(**rec["model"])
    x, y = make_batches(c, 1, rec["data"]["batch"], seed=5)[0]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    copy_dir = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2", copy_dir)
    yield engine, copy_dir, copy_dir / rec["tag"]
    engine.destroy()


def _untouched(engine, before):
    assert same_weights(weights(engine.module), before[0])
    assert (engine.global_steps, engine.optimizer.adam_step, engine.get_lr()) == before[1:]


def _state(engine):
    return weights(engine.module), engine.global_steps, engine.optimizer.adam_step, engine.get_lr()


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_a_planted_pickle_in_a_deepspeed_checkpoint_is_refused_and_runs_nothing(trained, tmp_path, victim):
    engine, ds_dir, tag_dir = trained
    marker = tmp_path / "pwned"
    target = tag_dir / victim
    target.unlink()
    torch.save({"optimizer_state_dict": {"x": RunsCode(marker)}, "module": RunsCode(marker)}, target)
    before = _state(engine)
    with pytest.raises(zero.UnsafeCheckpointError) as info:
        engine.load_checkpoint(ds_dir)
    message = str(info.value)
    assert f"refused to load {target}" in message and "system" in message and "nothing in it was run" in message
    assert not marker.exists()
    _untouched(engine, before)


def test_a_truncated_deepspeed_file_is_refused_naming_it(trained):
    engine, ds_dir, tag_dir = trained
    target = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = target.read_bytes()
    target.write_bytes(data[:len(data) * 2 // 3])
    before = _state(engine)
    with pytest.raises(zero.CheckpointCorruptionError, match=f"{target}.*damaged"):
        engine.load_checkpoint(ds_dir)
    _untouched(engine, before)


def test_a_flipped_byte_in_a_deepspeed_tensor_is_refused_naming_the_file(trained):
    engine, ds_dir, tag_dir = trained
    target = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(target) as archive:  # the first tensor record's data, where torch.load would not look
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
    data = bytearray(target.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + 40] ^= 0x55
    target.write_bytes(bytes(data))
    before = _state(engine)
    with pytest.raises(zero.CheckpointCorruptionError, match=f"{target}.*damaged.*CRC"):
        engine.load_checkpoint(ds_dir)
    _untouched(engine, before)


def test_a_missing_rank_file_is_refused_naming_the_rank(trained):
    engine, ds_dir, tag_dir = trained
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    before = _state(engine)
    with pytest.raises(ValueError, match="saved by 2 ranks but holds 1 optimizer files"):
        engine.load_checkpoint(ds_dir)
    _untouched(engine, before)


def test_a_deepspeed_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path):
    rec = record("stage2")
    wider = dict(rec["model"], d_model=24)
    engine = make_engine(tmp_path, config=engine_config(rec, 2, 1), model=lambda: GPT(GPTConfig(**wider)))
    try:
        with pytest.raises(ValueError, match=r"different model .*wte\.weight: \[32, 16\] in the checkpoint, "
                                             r"\[32, 24\] here"):
            engine.load_checkpoint(FIXTURES / "stage2")
    finally:
        engine.destroy()


def test_an_fp16_dynamic_loss_scale_carries_over(tmp_path, monkeypatch):
    """DeepSpeed refuses fp16 on the CPU, so the checkpoint is the stage-2 fixture with the
    DynamicLossScaler an fp16 run pickles (a class of that qualified name, pickled by reference)."""
    ds_dir = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2", ds_dir)
    scaler_state = {"cur_scale": 512.0, "cur_iter": 7, "last_overflow_iter": 4, "cur_hysteresis": 1,
                    "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
                    "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dynamic": True,
                    "dtype": torch.float16}
    with monkeypatch.context() as patch:
        names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler"]
        for name in names:
            patch.setitem(sys.modules, name, types.ModuleType(name))
        scaler_type = type("DynamicLossScaler", (), {"__module__": names[-1]})
        sys.modules[names[-1]].DynamicLossScaler = scaler_type
        for path in sorted(ds_dir.glob("*/zero_pp_rank_*_optim_states.pt")):
            state = load_file(str(path))
            scaler = scaler_type()
            scaler.__dict__.update(scaler_state)
            osd = state["optimizer_state_dict"]
            osd.update(loss_scaler=scaler, dynamic_loss_scale=True, zero_stage=int(osd["zero_stage"]))
            del osd["param_slice_mappings"]  # stand-ins pickle under their own names: leave them out
            path.unlink()
            torch.save(state, path)
    assert "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" in _globals(path)
    config = engine_config(record("stage2"), 2, 1)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    engine = make_engine(tmp_path / "swap", config=config, model=fixture_model(record("stage2")))
    try:
        engine.load_checkpoint(ds_dir)
        scaler = engine.optimizer.scaler
        assert engine.get_loss_scale() == 512.0
        assert (scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis) == (7, 4, 1)
    finally:
        engine.destroy()


def _digests(tensors: dict) -> dict:
    return {n: hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


@pytest.mark.parametrize("name, stage, load_optimizer_states", [
    ("stage1", 2, True), ("stage2", 3, True), ("stage3", 3, True), ("stage3", 1, False)])
def test_the_loaded_weights_are_those_deepspeeds_zero_to_fp32_rebuilds(tmp_path, name, stage,
                                                                       load_optimizer_states):
    rec = record(name)
    engine = make_engine(tmp_path, config=engine_config(rec, stage, 1), model=fixture_model(rec))
    try:
        engine.load_checkpoint(FIXTURES / name, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_optimizer_states)
        ours = _digests(weights(engine.module))
        assert engine.global_steps == rec["global_steps"]
        assert engine.optimizer.adam_step == (rec["global_steps"] if load_optimizer_states else 0)
    finally:
        engine.destroy()
    theirs = rec["zero_to_fp32_sha256"]
    # DeepSpeed's stage 1 keeps no frozen parameter with the optimizer's files (its zero_to_fp32 leaves
    # them out); every parameter it does rebuild, and every one at the other stages, is bit-identical.
    assert set(theirs) - set(ours) == {"head.weight"}  # tied to wte.weight: one parameter here
    assert set(ours) - set(theirs) == (set(rec["frozen"]) if rec["ds_config"]["zero_optimization"]["stage"] == 1
                                       else set())
    assert {n: ours[n] for n in theirs if n in ours} == {n: theirs[n] for n in theirs if n in ours}
