"""zero.hf.ZeroTrainer: the Hugging Face Trainer on the ZeRO engine.

3 steps with params and optimizer on NVMe (stage 3) match the plain Trainer's (losses and
weights); HF's integration guide's stage-2 config (ZeRO-Offload), "auto" and written out,
runs unchanged on two ranks and matches the plain Trainer on two ranks; an HF-style
template full of "auto" runs unchanged; save and resume through the Trainer continue
exactly; values that disagree with the TrainingArguments and "auto" buckets without a
hidden size are refused.
"""
import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from zero.config import ConfigError
from zero.partitioning.full_state_dict import full_state_dict
from zero.hf import ZeroTrainer, resolve_for_trainer
from helpers import run_ranks

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
HIDDEN = 32


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def dataset(n=24):
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def training_args(out, **overrides):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
              weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
              disable_tqdm=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def nvme_config(path, **extra):
    offload = {"device": "nvme", "nvme_path": str(path)}
    config = {"zero_optimization": {"stage": 3, "offload_param": dict(offload, max_in_cpu=0, min_swap_bytes=0),
                                    "offload_optimizer": offload, "stage3_param_persistence_threshold": 0,
                                    "sub_group_size": 4096},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto"}
    config.update(extra)
    return config


def template(path):
    """tests/data's HF-style ZeRO-3 NVMe template, its nvme_path pointed at ``path``."""
    with open(os.path.join(DATA_DIR, "ds_config_zero3_nvme_auto.json")) as f:
        config = json.load(f)
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = str(path)
    return config


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class SwapBytes(TrainerCallback):
    """Bytes under the NVMe folder at the end of each step."""

    def __init__(self, path):
        self.path, self.seen = path, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.path) for f in fs))


def assert_same_weights(expected: dict, got: dict, atol: float = 1e-7):
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=atol, msg=name)


def test_three_steps_match_the_plain_trainer_with_params_and_optimizer_on_nvme(tmp_path):
    # No optimizer section: the Trainer's own AdamW with its weight-decay groups, and its linear schedule.
    plain = Trainer(model=tiny_gpt2(), args=training_args(tmp_path / "plain", gradient_accumulation_steps=2),
                    train_dataset=dataset(), eval_dataset=dataset(8))
    plain.train()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    swap = SwapBytes(nvme)
    ours = ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "ours", gradient_accumulation_steps=2),
                       train_dataset=dataset(), eval_dataset=dataset(8), zero_config=nvme_config(nvme),
                       callbacks=[swap])
    ours.train()
    assert len(losses(ours)) == 3
    torch.testing.assert_close(losses(ours), losses(plain), rtol=1e-6, atol=0)
    assert [h["learning_rate"] for h in ours.state.log_history if "loss" in h] == \
        [h["learning_rate"] for h in plain.state.log_history if "loss" in h]
    assert_same_weights(plain.model.state_dict(), full_state_dict(ours.model))
    torch.testing.assert_close(ours.evaluate()["eval_loss"], plain.evaluate()["eval_loss"], rtol=1e-6, atol=0)
    n_params = sum(p.numel() for p in plain.model.parameters())
    assert min(swap.seen) >= 16 * n_params  # fp32 params + master + two moments, on NVMe throughout
    zc = ours.zero_engine.config.zero_optimization
    assert zc.offload_param.device == zc.offload_optimizer.device == "nvme"


# -- two ranks: HF's stage-2 config against the plain Trainer ----------------------------------------------

WORLD = 2
STAGE_2 = ("ds_config_zero2_auto.json", "ds_config_zero2_manual.json")  # HF's guide; its autos written out
WARMUP = 3
STEPS = 4  # the lr of each: 0, 0 (DeepSpeed's log warmup starts there), 0.63e-3, 1e-3


def warmup_log(step: int) -> float:
    """The lr factor of optimizer step ``step`` (from 0) under WarmupLR with warmup_min_lr 0 and the
    default warmup_type "log", as DeepSpeed steps it: the first step runs at iteration -1 (the min lr),
    step s at iteration s - 1, whose factor is log(iteration + 1) / log(warmup_num_steps)."""
    iteration = step - 1
    if iteration < 0:
        return 0.0
    return math.log(iteration + 1) / math.log(WARMUP) if iteration < WARMUP else 1.0


def scenario_trainer(rank, world_size, scratch, config=None):
    """4 steps of 2 accumulated micro-batches per rank, clipped, WarmupLR: ZeroTrainer with tests/data's
    ``config``, or (None) the plain Trainer given what that config asks for: AdamW decaying every
    parameter (HF hands DeepSpeed all of them when the config has an optimizer) and WarmupLR's factor.
    Returns the logged losses and learning rates, the file the final weights went to and, for ZeroTrainer,
    the folder save_model wrote and what the engine was built with."""
    args = training_args(scratch, max_steps=STEPS, gradient_accumulation_steps=2, warmup_steps=WARMUP,
                         max_grad_norm=1.0)
    model, data = tiny_gpt2(), dataset(STEPS * 2 * 4 * world_size)
    if config is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_log)
        t = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, schedule))
    else:
        t = ZeroTrainer(model=model, args=args, train_dataset=data, zero_config=os.path.join(DATA_DIR, config))
    t.train()
    weights = t.model.state_dict() if config is None else full_state_dict(t.model)
    path = os.path.join(scratch, f"weights{rank}.pt")
    torch.save(dict(weights), path)
    result = {"losses": losses(t), "lrs": [h["learning_rate"] for h in t.state.log_history if "loss" in h],
              "weights": path}
    if config is not None:
        result["model"] = os.path.join(scratch, "model")
        t.save_model(result["model"])  # every rank takes part; rank 0 writes
        config = t.zero_engine.config
        result.update(stage=t.zero_engine.zero_optimization_stage(),
                      offload=config.zero_optimization.offload_optimizer.device,
                      batch=[config.train_batch_size, config.gradient_accumulation_steps, config.gradient_clipping],
                      hf_zero3=transformers.integrations.is_deepspeed_zero3_enabled())
    return result


@pytest.fixture(scope="module")
def stage_2_on_two_ranks(tmp_path_factory):
    scenarios = [("plain", scenario_trainer, {})] + [(name, scenario_trainer, {"config": name}) for name in STAGE_2]
    return run_ranks(WORLD, scenarios, tmp_path_factory.mktemp("hf_ranks"))


@pytest.mark.parametrize("config", STAGE_2)
def test_hf_guide_stage_2_config_on_two_ranks_matches_the_plain_trainer(stage_2_on_two_ranks, config):
    expected_lrs = [1e-3 * warmup_log(step) for step in range(STEPS)]
    for rank in range(WORLD):
        plain, ours = stage_2_on_two_ranks[rank]["plain"], stage_2_on_two_ranks[rank][config]
        assert "error" not in plain, plain["error"]
        assert "error" not in ours, ours["error"]
        assert (ours["stage"], ours["offload"], ours["batch"]) == (2, "cpu", [4 * 2 * WORLD, 2, 1.0])
        assert ours["hf_zero3"] is False  # transformers takes none of its ZeRO-3 branches
        assert len(ours["losses"]) == STEPS
        torch.testing.assert_close(ours["losses"], plain["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(ours["lrs"], plain["lrs"], rtol=1e-12, atol=0)
        torch.testing.assert_close(plain["lrs"], expected_lrs, rtol=1e-12, atol=0)
        # As in test_lightning_strategy: where the true gradient is 0 (the attention keys' bias: softmax ignores a
        # shift of all scores) the reductions' rounding, which differs, is all there is, and Adam scales it up to
        # a step (lr 1e-3); 1e-5 is 1% of one, still far below what a rank stepping alone would show.
        assert_same_weights(torch.load(plain["weights"]), torch.load(ours["weights"]), atol=1e-5)
    # save_model below stage 3 (the config has no gather flag): from_pretrained reads the trained weights
    ours = stage_2_on_two_ranks[0][config]
    trained = torch.load(ours["weights"])
    for name, value in GPT2LMHeadModel.from_pretrained(ours["model"]).state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_hf_template_full_of_auto_runs_unchanged_through_the_trainer(tmp_path):
    args = training_args(tmp_path / "out", max_grad_norm=0.5, adam_beta2=0.98, adam_epsilon=1e-7,
                         warmup_steps=2)
    trainer = ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), zero_config=template(tmp_path))
    trainer.train()
    assert trainer.state.global_step == 3 and all(torch.isfinite(torch.tensor(losses(trainer))))
    config = trainer.zero_engine.config
    assert config.unresolved_autos() == []
    params = config.optimizer.params
    assert (params.lr, tuple(params.betas), params.eps, params.weight_decay) == (1e-3, (0.9, 0.98), 1e-7, 0.01)
    assert config.gradient_clipping == 0.5 and config.precision == "fp32"
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.train_batch_size) == (4, 1, 4)
    zc = config.zero_optimization
    assert (zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size, zc.stage3_param_persistence_threshold) == (
        HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN)
    schedule = trainer.zero_engine.lr_scheduler
    assert type(schedule).__name__ == "WarmupLR"
    assert schedule.max_lrs == [1e-3] and schedule.min_lrs == [0] and schedule.warmup_num_steps == 2


@pytest.mark.parametrize("stage", [3, 2])
def test_save_and_resume_through_the_trainer_continue_exactly(tmp_path, stage):
    def config():  # stage 3: the NVMe template; stage 2: HF's guide's config (ZeRO-Offload)
        return template(tmp_path) if stage == 3 else os.path.join(DATA_DIR, "ds_config_zero2_auto.json")

    args = dict(max_steps=4, save_strategy="steps", save_steps=2, weight_decay=0.0)
    whole = ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "whole", **args), train_dataset=dataset(),
                        zero_config=config())
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert {"latest", "global_step2", "model.safetensors", "trainer_state.json"} <= set(os.listdir(checkpoint))

    resumed = ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "resumed", **args),
                          train_dataset=dataset(), zero_config=config())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.zero_engine.zero_optimization_stage() == stage
    assert resumed.state.global_step == 4
    assert losses(resumed) == losses(whole)  # steps 1-2 from the checkpoint's state, 3-4 trained again
    final = full_state_dict(whole.model)
    for name, value in full_state_dict(resumed.model).items():
        assert torch.equal(value, final[name]), name
    # the weights save_model wrote load with from_pretrained
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "whole" / "checkpoint-4").state_dict()
    for name, value in loaded.items():
        assert torch.equal(value, final[name]), name


def test_resuming_from_a_folder_without_an_engine_checkpoint_is_refused(tmp_path):
    trainer = ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "out"), train_dataset=dataset(),
                          zero_config=nvme_config(tmp_path))
    (tmp_path / "plain-checkpoint").mkdir()
    with pytest.raises(ValueError, match="holds no engine checkpoint .no 'latest' file."):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain-checkpoint"))


def test_values_disagreeing_with_the_training_arguments_are_refused(tmp_path):
    config = nvme_config(tmp_path, optimizer={"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.999]}},
                         train_micro_batch_size_per_gpu=8)
    with pytest.raises(ConfigError) as info:
        resolve_for_trainer(config, training_args(tmp_path / "out"), tiny_gpt2())
    problems = {p.path: p.message for p in info.value.problems}
    assert set(problems) == {"optimizer.params.lr", "train_micro_batch_size_per_gpu"}
    assert problems["optimizer.params.lr"] == (
        "is 0.1 in the DeepSpeed config but the TrainingArguments give 0.001 (learning_rate); "
        "set it to \"auto\" or make them equal")
    assert "give 4 (per_device_train_batch_size)" in problems["train_micro_batch_size_per_gpu"]


def test_hidden_size_autos_on_a_model_without_hidden_size_are_refused(tmp_path):
    config = template(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_for_trainer(config, training_args(tmp_path / "out"), torch.nn.Linear(4, 4))
    assert [p.path for p in info.value.problems] == [
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold"]
    assert "Linear has no config.hidden_size nor config.hidden_sizes; write an integer" in str(info.value)


def test_zero_trainer_needs_its_config(tmp_path):
    with pytest.raises(TypeError, match="ZeroTrainer needs zero_config="):
        ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "out"), train_dataset=dataset())


def test_save_on_each_node_says_what_it_does_not_change(tmp_path):
    from zero.config import IgnoredSettingWarning

    with pytest.warns(IgnoredSettingWarning) as caught:
        ZeroTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "out", save_on_each_node=True),
                    train_dataset=dataset(), zero_config=nvme_config(tmp_path))
    assert [str(w.message) for w in caught] == [
        "TrainingArguments(save_on_each_node=True) has no effect on the engine's checkpoint: the model files and "
        "the Trainer's state are written on each node, but the optimizer states and parameter shards form one "
        "checkpoint across the nodes (each rank writes its own, rank 0 publishes it), in an output_dir every "
        "node must see"]
