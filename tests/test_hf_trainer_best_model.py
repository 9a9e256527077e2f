"""zero.hf.ZeroTrainer with ``load_best_model_at_end``: evaluating and saving every step, the Trainer
picks the best checkpoint as the plain Trainer does and ends with its weights, loaded from that
folder's engine checkpoint (as the Trainer loads DeepSpeed's).

The metric is chosen so that the best checkpoint is not the last: the eval loss falls step by step, and
``greater_is_better=True`` makes the first step's the best.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")
from safetensors.torch import load_file
from transformers import Trainer

from zero.hf import ZeroTrainer
from zero.partitioning.full_state_dict import full_state_dict
from test_hf_trainer import assert_same_weights, dataset, nvme_config, tiny_gpt2, training_args

STEPS = 3


def best_at_end(out):
    return training_args(out, max_steps=STEPS, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                         save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                         greater_is_better=True)


def eval_losses(trainer):
    return [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


def test_load_best_model_at_end_ends_with_the_best_checkpoints_weights(tmp_path):
    plain = Trainer(model=tiny_gpt2(), args=best_at_end(tmp_path / "plain"), train_dataset=dataset(),
                    eval_dataset=dataset(8))
    plain.train()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ours = ZeroTrainer(model=tiny_gpt2(), args=best_at_end(tmp_path / "ours"), train_dataset=dataset(),
                       eval_dataset=dataset(8), zero_config=nvme_config(nvme))
    ours.train()

    losses = eval_losses(ours)
    assert len(losses) == STEPS and losses == sorted(losses, reverse=True)  # falling: the first is the "best"
    torch.testing.assert_close(losses, eval_losses(plain), rtol=1e-5, atol=0)
    best = ours.state.best_model_checkpoint
    assert best == str(tmp_path / "ours" / "checkpoint-1")
    assert plain.state.best_model_checkpoint == str(tmp_path / "plain" / "checkpoint-1")

    at_best = load_file(f"{best}/model.safetensors")  # what save_model wrote at step 1
    now = full_state_dict(ours.model)
    assert_same_weights(at_best, {k: v for k, v in now.items() if k in at_best})
    assert_same_weights(plain.model.state_dict(), now, atol=1e-6)
    assert ours.zero_engine.global_steps == 1  # the engine's state is step 1's
    torch.testing.assert_close(ours.evaluate()["eval_loss"], losses[0], rtol=1e-6, atol=0)
