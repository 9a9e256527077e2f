"""A peft LoRA model through zero.hf.ZeroTrainer with parameters and optimizer on NVMe: the
plain Trainer's losses and weights, optimizer state for the adapters only (zero/stores/layouts.py
[Note: the optimizer covers the trainable units only]), and a Trainer checkpoint that resumes
exactly, holding the adapters without the frozen base (as the Trainer saves a peft model under
DeepSpeed: exclude_frozen_parameters=True)."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")
peft = pytest.importorskip("peft", reason="needs peft: pip install peft")

from transformers import Trainer

from test_hf_trainer import dataset, losses, nvme_config, tiny_gpt2, training_args
from zero.hf import ZeroTrainer
from zero.partitioning.full_state_dict import full_state_dict


def lora_gpt2(bias: str = "none"):
    """``bias="all"``: every bias trains beside the adapters, the base weights stay frozen (their
    modules split in two units: zero/runtime/unit.py [Note: a module's frozen and trainable parameters])."""
    model = tiny_gpt2()
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                                                       fan_in_fan_out=True, bias=bias))
    with torch.no_grad():  # B starts at zero: make the adapters matter from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def swap_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    return str(path)


@pytest.mark.parametrize("accumulation,bias", [(1, "none"), (2, "none"), (1, "all")])  # 2: accumulation windows
def test_a_peft_model_trains_as_the_plain_trainer_with_optimizer_state_for_the_adapters_only(tmp_path, accumulation,
                                                                                             bias):
    args = dict(gradient_accumulation_steps=accumulation)
    plain = Trainer(model=lora_gpt2(bias), args=training_args(tmp_path / "plain", **args), train_dataset=dataset())
    plain.train()
    ours = ZeroTrainer(model=lora_gpt2(bias), args=training_args(tmp_path / "ours", **args), train_dataset=dataset(),
                       zero_config=nvme_config(swap_dir(tmp_path / "nvme")))
    ours.train()
    torch.testing.assert_close(losses(ours), losses(plain), rtol=1e-6, atol=0)
    expected = plain.model.state_dict()
    for name, value in full_state_dict(ours.model).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    engine = ours.zero_engine
    trainable = sum(p.ds_numel for p in ours.model.parameters() if p.requires_grad)  # (partitioned)
    assert engine.rank_layout.frozen and engine.rank_layout.trainable_numel == trainable
    assert engine.parts.optimizer_store.swapper.nvme_bytes < 16 * trainable + 4096 * 16 * len(
        engine.rank_layout.trainable_sub_groups)


@pytest.mark.parametrize("bias", ["none", "all"])
def test_a_peft_trainer_checkpoint_resumes_exactly(tmp_path, bias):
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, weight_decay=0.0)
    whole = ZeroTrainer(model=lora_gpt2(bias), args=training_args(tmp_path / "whole", **args), train_dataset=dataset(),
                        zero_config=nvme_config(swap_dir(tmp_path / "nvme1")))
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert {"latest", "global_step2"} <= set(os.listdir(checkpoint))
    meta = json.load(open(checkpoint / "global_step2" / "zero_meta.json"))
    assert meta["excluded_units"] and meta["excluded_units"] == meta["frozen_units"]
    shards = [f for f in os.listdir(checkpoint / "global_step2" / "rank00000") if f.startswith("subgroup")]
    assert len(shards) == len(whole.zero_engine.rank_layout.trainable_sub_groups)
    resumed = ZeroTrainer(model=lora_gpt2(bias), args=training_args(tmp_path / "resumed", **args),
                          train_dataset=dataset(), zero_config=nvme_config(swap_dir(tmp_path / "nvme2")))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert losses(resumed) == losses(whole)
    final = full_state_dict(whole.model)
    for name, value in full_state_dict(resumed.model).items():
        assert torch.equal(value, final[name]), name


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_peft_model_with_gradient_checkpointing_trains_as_the_plain_trainer(tmp_path, reentrant):
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plain = Trainer(model=lora_gpt2(), args=training_args(tmp_path / "plain", **checkpointing),
                    train_dataset=dataset())
    plain.train()
    ours = ZeroTrainer(model=lora_gpt2(), args=training_args(tmp_path / "ours", **checkpointing),
                       train_dataset=dataset(), zero_config=nvme_config(swap_dir(tmp_path / "nvme")))
    ours.train()
    torch.testing.assert_close(losses(ours), losses(plain), rtol=1e-6, atol=0)


@pytest.mark.parametrize("gather_16bit", [False, True])
def test_save_model_writes_the_plain_trainers_adapters_without_gathering_the_base(tmp_path, gather_16bit):
    from safetensors.torch import load_file

    plain = Trainer(model=lora_gpt2(), args=training_args(tmp_path / "plain"), train_dataset=dataset())
    plain.train()
    plain.save_model(str(tmp_path / "plain_model"))
    config = nvme_config(swap_dir(tmp_path / "nvme"))
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_16bit
    ours = ZeroTrainer(model=lora_gpt2(), args=training_args(tmp_path / "ours"), train_dataset=dataset(),
                       zero_config=config)
    ours.train()
    swapper = ours.zero_engine.parts.param_store.swapper
    read = swapper.io_bytes.read
    ours.save_model(str(tmp_path / "ours_model"))
    base_bytes = 4 * sum(p.ds_numel for p in ours.model.parameters() if not p.requires_grad)
    assert swapper.io_bytes.read - read < base_bytes / 10  # the adapters' partitions at most
    expected = load_file(str(tmp_path / "plain_model" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "ours_model" / "adapter_model.safetensors"))
    assert set(got) == set(expected) and expected
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_a_peft_models_accumulation_windows_run_unit_major_and_release_the_base_as_they_go(tmp_path, monkeypatch):
    """Without dropout the Trainer's windows run through engine.train_batch: equal to the loop, and a
    frozen unit goes once the window's last backward is done with its module (zero/runtime/hooks.py
    [Note: frozen units in backward]), not at the end of backward."""
    from helpers import frozen_gathered_at_end_of_backward
    from test_hf_trainer_train_batch import assert_same_run, gpt2
    from zero.engine.train_batch import TrainBatch

    def lora():
        torch.manual_seed(1)
        model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                            target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return model

    runs, at_end = {}, []
    for use in (True, False):
        trainer = ZeroTrainer(model=lora(), args=training_args(tmp_path / str(use), gradient_accumulation_steps=2),
                              train_dataset=dataset(), zero_config=nvme_config(swap_dir(tmp_path / f"nvme{use}")),
                              use_train_batch=use)
        if use:
            at_end = frozen_gathered_at_end_of_backward(monkeypatch)
            monkeypatch.setattr(TrainBatch, "_loop", lambda *a, **k: pytest.fail("the window ran the loop"))
        trainer.train()
        monkeypatch.undo()
        runs[use] = trainer
    assert_same_run(runs[True], runs[False])
    frozen = [u for u in runs[True].zero_engine.parts.units if u.index in runs[True].zero_engine.rank_layout.frozen]
    assert len(frozen) > 8 and at_end and max(at_end) <= 1, at_end
