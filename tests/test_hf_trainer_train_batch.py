"""ZeroTrainer with gradient accumulation runs each window through engine.train_batch.

Logged losses, grad norms, learning rates and final weights are the micro-batch loop's bit for
bit (gas 2 and 4, a last window cut short at each epoch's end, a save and resume in the middle
of an epoch), and equal to the plain Trainer's; the parameter bytes read from NVMe per window
do not grow with gas (they do in the loop); dropout and use_train_batch=False get the loop,
each with its log line.
"""
import logging

import pytest
import torch

from test_hf_trainer import HIDDEN, dataset, losses, nvme_config, training_args

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

from zero.hf import ZeroTrainer
from zero.partitioning.full_state_dict import full_state_dict

EPOCHS = dict(max_steps=-1, num_train_epochs=2)  # 5 batches an epoch: its last window is cut short


def gpt2(dropout=0.0):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout))


class ParamBytesRead(TrainerCallback):
    """Bytes the engine read for parameters from NVMe during each optimizer step."""

    def __init__(self):
        self.per_step, self._before, self.trainer = [], 0, None

    def _read(self):
        return self.trainer.zero_engine.parts.param_store.swapper.io_bytes.read

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = self._read()

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self._read() - self._before)


def train(tmp_path, name, use_train_batch=True, dropout=0.0, n=20, resume=None, loss_kwargs=True, **args):
    folder = tmp_path / name
    (folder / "nvme").mkdir(parents=True, exist_ok=True)
    counted = ParamBytesRead()
    trainer = ZeroTrainer(model=gpt2(dropout), args=training_args(folder / "out", **args), train_dataset=dataset(n),
                          zero_config=nvme_config(folder / "nvme"), use_train_batch=use_train_batch,
                          callbacks=[counted])
    counted.trainer = trainer
    trainer.model_accepts_loss_kwargs = loss_kwargs  # False: no num_items_in_batch, each loss divided by gas
    trainer.train(resume_from_checkpoint=resume)
    return trainer, counted.per_step


def history(trainer):
    """What the Trainer logged at each step (losses, grad norms, learning rates)."""
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(a, b):
    assert history(a) == history(b) and a.state.global_step == b.state.global_step
    wa, wb = full_state_dict(a.model), full_state_dict(b.model)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[name], wb[name]) for name in wa)


@pytest.mark.parametrize("gas", [2, 4])
def test_windows_through_train_batch_equal_the_loop_and_the_plain_trainer(tmp_path, gas, caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        window, _ = train(tmp_path, "window", gradient_accumulation_steps=gas, **EPOCHS)
    said = [r.getMessage() for r in caplog.records if "ZeroTrainer runs" in r.getMessage()]
    loop, _ = train(tmp_path, "loop", use_train_batch=False, gradient_accumulation_steps=gas, **EPOCHS)
    assert window.state.global_step == 2 * -(-5 // gas)  # whole windows and the cut-short last, each epoch
    assert_same_run(window, loop)
    plain = Trainer(model=gpt2(), args=training_args(tmp_path / "plain", gradient_accumulation_steps=gas, **EPOCHS),
                    train_dataset=dataset(20))
    plain.train()
    torch.testing.assert_close(losses(window), losses(plain), rtol=1e-6, atol=0)
    final = full_state_dict(window.model)
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert said == [f"[zero] ZeroTrainer runs each accumulation window of {gas} micro-batches through "
                    "engine.train_batch, unit-major (each unit's parameters read once per window)"]


def test_losses_divided_by_gas_equal_the_loop(tmp_path):
    """A model without loss kwargs: the Trainer divides each micro-batch's mean loss by gas."""
    args = dict(gradient_accumulation_steps=4, loss_kwargs=False, **EPOCHS)
    assert_same_run(train(tmp_path, "window", **args)[0], train(tmp_path, "loop", use_train_batch=False, **args)[0])


def test_parameter_bytes_read_per_window_do_not_grow_with_accumulation(tmp_path):
    """Whole windows after the first (which records the prefetch trace): train_batch reads each
    parameter once for the forwards and once for the backwards, whatever gas is; the loop gas times."""
    read = {}
    for gas in (2, 4):
        for use in (True, False):
            _, per_step = train(tmp_path, f"{gas}-{use}", use_train_batch=use, n=48, max_steps=3,
                                gradient_accumulation_steps=gas)
            read[gas, use] = per_step[1:]
    assert read[2, True] == read[4, True] and min(read[2, True]) > 0
    assert all(loop > 3 * window for loop, window in zip(read[4, False], read[4, True]))


def test_save_and_resume_mid_epoch_continue_exactly(tmp_path):
    # 6 batches an epoch, gas 2: checkpoint-2 is 2 windows into the first epoch's 3
    args = dict(gradient_accumulation_steps=2, max_steps=5, save_strategy="steps", save_steps=2, weight_decay=0.0)
    whole, _ = train(tmp_path, "whole", n=24, **args)
    assert_same_run(whole, train(tmp_path, "loop", use_train_batch=False, n=24, **args)[0])
    resumed, _ = train(tmp_path, "resumed", n=24, resume=str(tmp_path / "whole" / "out" / "checkpoint-2"), **args)
    assert resumed.state.global_step == 5 and losses(resumed) == losses(whole)
    final = full_state_dict(whole.model)
    assert all(torch.equal(value, final[name]) for name, value in full_state_dict(resumed.model).items())


def test_dropout_gets_the_loop_with_one_log_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("zero.engine.train_batch._TOLD", set())  # said once per process: maybe already
    with caplog.at_level(logging.INFO, logger="zero"):
        window, _ = train(tmp_path, "window", dropout=0.1, gradient_accumulation_steps=2, **EPOCHS)
    said = [r.getMessage() for r in caplog.records if "runs the micro-batch loop" in r.getMessage()]
    assert_same_run(window, train(tmp_path, "loop", use_train_batch=False, dropout=0.1,
                                  gradient_accumulation_steps=2, **EPOCHS)[0])
    assert said == ["[zero] train_batch runs the micro-batch loop: its forward draws random numbers (dropout?), "
                    "which unit-major would draw in another order than the loop; it runs the loop from now on"]


def test_use_train_batch_false_runs_the_loop_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        _, per_step = train(tmp_path, "loop", use_train_batch=False, n=48, max_steps=2, gradient_accumulation_steps=4)
    said = [r.getMessage() for r in caplog.records if "ZeroTrainer runs" in r.getMessage()]
    assert said == ["[zero] ZeroTrainer runs each accumulation window of 4 micro-batches as a micro-batch loop "
                    "(use_train_batch=False)"]
