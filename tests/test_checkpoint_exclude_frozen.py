"""``save_checkpoint(exclude_frozen_parameters=True)`` (zero/checkpoint/save.py [Note: checkpoints
without the frozen units]): a LoRA checkpoint holds the adapters and their optimizer states, not
the frozen base; it loads with ``load_module_strict=False`` (the base keeps the model's values)
and resumes exactly; ``zero_to_fp32`` writes what is there and, with
``--exclude_frozen_parameters``, leaves out every frozen parameter of a full checkpoint."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import base_config, ladder_config, train_engine, weights
from test_trainable_partition import batches, built, lora_model, swap_dir
from zero.checkpoint.consolidate import convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint
from zero.checkpoint.format import META, CheckpointCorruptionError
from zero.zero_to_fp32 import main as zero_to_fp32

LR = 1e-2


def _config(path, offload="nvme", stage=3, precision="fp32", **zero_extra):
    if stage < 3:
        return ladder_config(stage, offload, swap_dir(path), lr=LR)
    return base_config(offload, offload, swap_dir(path), lr=LR, precision=precision, **zero_extra)


def _saved(tmp_path, exclude: bool, offload="nvme", stage=3, **zero_extra):
    """A LoRA engine trained 2 steps and saved (tag "t"); its weights then, and the losses of 2 more steps."""
    model = lora_model()
    with built(model, _config(tmp_path / "swap", offload, stage, **zero_extra)) as engine:
        train_engine(engine, batches(), 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t", exclude_frozen_parameters=exclude)
        saved = weights(model)
        after = train_engine(engine, batches()[2:], 2)
        frozen_sgs = [sg.index for sg in engine.rank_layout.sub_groups if sg.frozen]
    return saved, after, frozen_sgs


def _fresh_adapters():
    """The same pretrained base, other adapter values (a load must replace them)."""
    model = lora_model()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    return model


def _frozen_names(model) -> set:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def _size(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_a_checkpoint_without_the_frozen_units_holds_no_frozen_shard_and_resumes_exactly(tmp_path, offload):
    saved, after, frozen_sgs = _saved(tmp_path, exclude=True, offload=offload)
    tag = tmp_path / "ckpt" / "t"
    files = sorted(os.listdir(tag / "rank00000"))
    assert frozen_sgs and not any(f"subgroup{i:05d}.safetensors" in files for i in frozen_sgs)
    meta = json.load(open(tag / META))
    assert meta["excluded_units"] == meta["frozen_units"]
    assert set(meta["frozen_parameters"]) >= _frozen_names(lora_model())
    for target in ("nvme", "cpu"):
        with built(_fresh_adapters(), _config(tmp_path / f"swap-{target}", target)) as engine:
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)
            assert all(torch.equal(v, saved[n]) for n, v in weights(engine.module).items())
            assert train_engine(engine, batches()[2:], 2) == after


def test_it_is_a_fraction_of_the_full_checkpoint(tmp_path):
    _saved(tmp_path / "full", exclude=False)
    _saved(tmp_path / "lean", exclude=True)
    full, lean = _size(tmp_path / "full" / "ckpt" / "t"), _size(tmp_path / "lean" / "ckpt" / "t")
    model = lora_model()
    frozen_bytes = 4 * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert full - lean >= 0.9 * frozen_bytes  # the base's fp32 values are gone (less page padding)
    assert lean < full / 2


def test_a_strict_load_is_refused_naming_the_missing_parameters_and_changes_nothing(tmp_path):
    _saved(tmp_path, exclude=True)
    model = _fresh_adapters()
    with built(model, _config(tmp_path / "swap2")) as engine:
        before = weights(engine.module)
        with pytest.raises(ValueError, match=r"saved with exclude_frozen_parameters=True and holds no values for "
                                             r"\d+ frozen parameter\(s\) \(pos, wte.weight.*load_module_strict=False"):
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        assert all(torch.equal(v, before[n]) for n, v in weights(engine.module).items())
        assert engine.global_steps == 0


def test_a_resharded_load_keeps_the_base_and_reads_the_adapters(tmp_path):
    """Another sub_group_size: each unit is gathered from the shards, the left-out ones skipped."""
    saved, after, _ = _saved(tmp_path, exclude=True, sub_group_size=700)
    with built(_fresh_adapters(), _config(tmp_path / "swap2", sub_group_size=3000)) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)
        assert all(torch.equal(v, saved[n]) for n, v in weights(engine.module).items())
        assert train_engine(engine, batches()[2:], 2) == pytest.approx(after, rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_into_an_engine_that_trains_the_base_it_keeps_its_values_with_fresh_adam_states(tmp_path, caplog, precision):
    saved, _, _ = _saved(tmp_path, exclude=True)
    model = _fresh_adapters()
    model.requires_grad_(True)
    base = {n: v.clone() for n, v in model.named_parameters() if n in _frozen_names(lora_model())}
    with built(model, _config(tmp_path / "swap2", precision=precision)) as engine:
        train_engine(engine, batches(), 1)  # Adam states of the base become non-zero
        trained = {n: v.clone() for n, v in weights(engine.module).items() if n in base}
        layout, store = engine.rank_layout, engine.parts.optimizer_store
        kept = [i for i in range(len(layout.units)) if layout.units[i].slots[0].name in base]
        masters = {}  # the base's fp32 master (bf16: finer than its parameters)
        for sg in layout.sub_groups:
            master, _ = store.read(sg)
            for i in set(kept) & set(sg.units):
                start, stop = layout.unit_range(i)
                masters[i] = master[start - sg.start:stop - sg.start].clone()
        with caplog.at_level(logging.WARNING, logger="zero"):
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)
        assert f"was saved without its frozen parameters, {sum(len(layout.units[i].slots) for i in kept)} of which " \
               f"this engine trains" in caplog.text
        got = weights(engine.module)
        for n, v in got.items():
            if n in base:
                assert torch.equal(v, trained[n]), n
            elif precision == "fp32":
                assert torch.equal(v, saved[n]), n
        for sg in layout.sub_groups:
            master, states = store.read(sg)
            for index in set(kept) & set(sg.units):
                start, stop = layout.unit_range(index)
                assert torch.equal(master[start - sg.start:stop - sg.start], masters[index])
                assert all(not s[start - sg.start:stop - sg.start].any() for s in states.values())


@pytest.mark.parametrize("stage", [1, 2])
def test_below_stage_3_the_same(tmp_path, stage):
    saved, after, frozen_sgs = _saved(tmp_path, exclude=True, stage=stage)
    assert frozen_sgs
    with built(_fresh_adapters(), _config(tmp_path / "swap2", stage=stage)) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)
        assert train_engine(engine, batches()[2:], 2) == after


def test_quantized_frozen_weights_are_left_out_and_kept(tmp_path):
    saved, after, _ = _saved(tmp_path, exclude=True, zero_quantized_nontrainable_weights=True)
    meta = json.load(open(tmp_path / "ckpt" / "t" / META))
    assert "quantized_nontrainable_weights" not in meta
    config = _config(tmp_path / "swap2", zero_quantized_nontrainable_weights=True)
    with built(_fresh_adapters(), config) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)
        assert all(torch.equal(v, saved[n]) for n, v in weights(engine.module).items())
        assert train_engine(engine, batches()[2:], 2) == after


def test_zero_to_fp32_writes_what_is_there_and_names_what_is_not(tmp_path, caplog):
    saved, _, _ = _saved(tmp_path, exclude=True)
    frozen = _frozen_names(lora_model())
    with caplog.at_level(logging.WARNING, logger="zero"):
        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert "saved with exclude_frozen_parameters=True: the state dict lacks" in caplog.text
    params = {n for n in saved}
    assert set(state) & params == params - frozen
    assert all(torch.equal(state[n], saved[n]) for n in params - frozen)


def test_zero_to_fp32_exclude_frozen_parameters_leaves_them_out_of_a_full_checkpoint(tmp_path, caplog):
    saved, _, _ = _saved(tmp_path, exclude=False)
    frozen = _frozen_names(lora_model())
    ckpt = str(tmp_path / "ckpt")
    full = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    assert frozen <= set(full)
    with caplog.at_level(logging.WARNING, logger="zero"):
        lean = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t", exclude_frozen_parameters=True)
    assert "lacks" not in caplog.text
    assert not frozen & set(lean) and set(saved) - frozen <= set(lean)
    assert all(torch.equal(lean[n], saved[n]) for n in set(saved) - frozen)
    # The command line, both formats, equal to the function's.
    assert zero_to_fp32([ckpt, str(tmp_path / "lean.safetensors"), "-t", "t", "--safe_serialization",
                         "--exclude_frozen_parameters"]) == 0
    written = load_file(str(tmp_path / "lean.safetensors"))
    assert set(written) == set(lean) and all(torch.equal(written[n], lean[n]) for n in lean)
    path = convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(tmp_path / "lean.bin"), "t",
                                                      exclude_frozen_parameters=True)
    loaded = torch.load(path, weights_only=True)
    assert set(loaded) == set(lean)


def test_a_record_naming_units_that_are_not_frozen_is_refused(tmp_path):
    _saved(tmp_path, exclude=True)
    path = tmp_path / "ckpt" / "t" / META
    meta = json.load(open(path))
    trainable = next(i for i in range(len(meta["units"])) if i not in meta["frozen_units"])
    for bad in (meta["excluded_units"] + [trainable], [-1], "0"):
        json.dump(dict(meta, excluded_units=bad), open(path, "w"))
        with pytest.raises(CheckpointCorruptionError, match="excluded_units"):
            get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
        with built(_fresh_adapters(), _config(tmp_path / "swap2")) as engine:
            with pytest.raises(CheckpointCorruptionError, match="excluded_units"):
                engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_module_strict=False)


def test_save_16bit_model_without_the_frozen_parameters_never_gathers_them(tmp_path):
    model = lora_model()
    config = _config(tmp_path / "swap", stage3_gather_16bit_weights_on_model_save=True)
    with built(model, config) as engine:
        train_engine(engine, batches(), 1)
        swapper = engine.parts.param_store.swapper
        read = swapper.io_bytes.read
        assert engine.save_16bit_model(str(tmp_path / "out"), "model.safetensors", exclude_frozen_parameters=True)
        base_bytes = 4 * sum(p.ds_numel for p in model.parameters() if not p.requires_grad)
        assert swapper.io_bytes.read - read < base_bytes / 10  # only the adapters' partitions were read
        saved = weights(model)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    trainable = set(saved) - _frozen_names(lora_model())
    assert set(written) == trainable
    assert all(torch.equal(written[n], saved[n]) for n in trainable)
