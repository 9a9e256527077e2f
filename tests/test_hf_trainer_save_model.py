"""zero.hf.ZeroTrainer with ``TrainingArguments(bf16=True)`` (and ``fp16=True``), and what
``save_model`` writes.

The flags fill the config's ``bf16.enabled`` / ``fp16.enabled: "auto"``: the engine trains in
16-bit (fp32 masters), its losses within 16-bit rounding of the plain Trainer's. ``save_model``
writes what the Trainer writes under DeepSpeed: at stage 3 with
``stage3_gather_16bit_weights_on_model_save`` the 16-bit parameters (DeepSpeed's
``save_16bit_model``); without it fp32 weights from the master weights (here on NVMe), equal to
what ``zero_to_fp32`` consolidates from a checkpoint (where DeepSpeed writes a checkpoint and no
weights); below stage 3 the bf16 parameters every rank holds, as DeepSpeed does. Each loads with
``from_pretrained``.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel, Trainer

import zero
from zero.hf import ZeroTrainer
from zero.partitioning.full_state_dict import full_state_dict
from test_hf_trainer import DATA_DIR, dataset, losses, tiny_gpt2, training_args

STEPS = 2


def stage_3(gather: bool, precision: str = "bf16", nvme_path=None) -> dict:
    config = {precision: {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": gather}}
    if nvme_path is not None:  # the masters are read from their swap files
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path)}
    return config


def stage_2(_) -> dict:
    with open(os.path.join(DATA_DIR, "ds_config_zero2_auto.json")) as f:
        config = json.load(f)
    config.pop("fp16")
    config["bf16"] = {"enabled": "auto"}
    return config


CONFIGS = {  # name: (the TrainingArguments flag, the config)
    "stage 3, gather 16-bit": ("bf16", lambda path: stage_3(True)),
    "stage 3, fp16, gather 16-bit": ("fp16", lambda path: stage_3(True, "fp16")),
    "stage 3, no gather": ("bf16", lambda path: stage_3(False, nvme_path=path)),
    "stage 2": ("bf16", stage_2),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path_factory.mktemp("plain"), max_steps=STEPS),
                      train_dataset=dataset())
    trainer.train()
    return losses(trainer)


@pytest.fixture(scope="module", params=list(CONFIGS))
def trained(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("half")
    flag, config = CONFIGS[request.param]
    trainer = ZeroTrainer(model=tiny_gpt2(), args=training_args(out, max_steps=STEPS, **{flag: True}),
                          train_dataset=dataset(), zero_config=config(out))
    trainer.train()
    trainer.save_model(str(out / "model"))
    return request.param, flag, trainer, out


def test_16bit_arguments_train_in_16bit(trained, plain_losses):
    _, flag, trainer, _ = trained
    config = trainer.zero_engine.config
    assert getattr(config, flag).enabled and config.precision == flag
    assert {p.dtype for p in trainer.model.parameters()} == {DTYPES[flag]}
    assert len(losses(trainer)) == STEPS
    torch.testing.assert_close(losses(trainer), plain_losses, rtol=1e-2, atol=0)


def test_save_model_writes_what_the_trainer_writes_under_deepspeed(trained):
    name, flag, trainer, out = trained
    saved = load_file(out / "model" / "model.safetensors")
    if name == "stage 3, no gather":
        trainer.zero_engine.save_checkpoint(out / "checkpoint")
        expected = zero.get_fp32_state_dict_from_zero_checkpoint(out / "checkpoint")
        params = full_state_dict(trainer.model)
        assert any(not torch.equal(params[n].float(), saved[n]) for n in saved)  # the masters, not 16-bit upcast
    else:
        expected = full_state_dict(trainer.model)
    want = torch.float32 if name == "stage 3, no gather" else DTYPES[flag]
    assert {t.dtype for t in saved.values()} == {want}
    for key, value in saved.items():
        assert torch.equal(value, expected[key]), key
    loaded = GPT2LMHeadModel.from_pretrained(out / "model", dtype=want).state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in saved.items())
