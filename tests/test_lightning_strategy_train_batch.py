"""ZeroStrategy(use_train_batch=True): each accumulation window through engine.train_batch.

Losses (with the batch_idx each training_step got) and weights are the batch loop's bit for
bit with accumulate_grad_batches 2 and 4, an epoch's last window cut short included (which
the loop now steps, as Lightning does: both equal Lightning without ZeRO); save and resume
continue exactly; the parameter bytes read from NVMe per window do not grow with k (they do
in the loop); a log line says which path runs; an accumulation schedule is refused.
"""
import logging

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from test_lightning_strategy import GPTModule, assert_same_weights, loader, nvme_strategy, trainer

from zero.partitioning.full_state_dict import full_state_dict
from zero.lightning import ZeroStrategy

EPOCHS = dict(max_steps=-1, max_epochs=2)  # 5 batches an epoch: its last window is cut short


class IndexedGPTModule(GPTModule):
    """Also records the batch_idx each training_step got."""

    def __init__(self):
        super().__init__()
        self.indices = []

    def training_step(self, batch, batch_idx):
        self.indices.append(batch_idx)
        return super().training_step(batch, batch_idx)


def fit(tmp_path, name, k, use_train_batch, batches=5, strategy=None, ckpt_path=None, **kw):
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    module = IndexedGPTModule()
    strategy = strategy or nvme_strategy(folder, use_train_batch=use_train_batch, logging_level=logging.INFO)
    t = trainer(strategy, folder, accumulate_grad_batches=k, **kw)
    t.fit(module, loader(batches), ckpt_path=ckpt_path)
    return module, t


@pytest.mark.parametrize("k", [2, 4])
def test_windows_through_train_batch_equal_the_loop_and_lightning_without_zero(tmp_path, k, caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        window, t = fit(tmp_path, "window", k, True, **EPOCHS)
    said = [r.getMessage() for r in caplog.records if "ZeroStrategy runs" in r.getMessage()]
    assert said == [f"[zero] ZeroStrategy runs each accumulation window of {k} batches through engine.train_batch, "
                    "unit-major (each unit's parameters read once per window)"]
    loop, t_loop = fit(tmp_path, "loop", k, False, **EPOCHS)
    assert len(window.losses) == 10 and window.losses == loop.losses and window.indices == loop.indices
    assert t.global_step == t_loop.global_step == 2 * -(-5 // k)
    assert t.accumulate_grad_batches == k  # as the script set it, once fit is over
    assert_same_weights(full_state_dict(loop), full_state_dict(window), exact=True)
    plain = GPTModule()
    trainer("auto", tmp_path, accumulate_grad_batches=k, **EPOCHS).fit(plain, loader(5))
    torch.testing.assert_close(window.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(window))


def test_save_and_resume_with_windows_continue_exactly(tmp_path):
    whole, _ = fit(tmp_path, "whole", 2, True, batches=4, **EPOCHS)
    first, t = fit(tmp_path, "first", 2, True, batches=4, max_steps=-1, max_epochs=1)
    t.save_checkpoint(tmp_path / "epoch0.ckpt")
    resumed, t2 = fit(tmp_path, "resumed", 2, True, batches=4, ckpt_path=str(tmp_path / "epoch0.ckpt"), **EPOCHS)
    assert t2.global_step == 4 and first.losses + resumed.losses == whole.losses
    assert_same_weights(full_state_dict(whole), full_state_dict(resumed), exact=True)


class ParamBytesRead(pl.Callback):
    """Bytes the engine read for parameters from NVMe, at the end of each batch the loop saw."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(trainer.strategy.engine.parts.param_store.swapper.io_bytes.read)


def test_parameter_bytes_read_per_window_do_not_grow_with_k(tmp_path):
    """Windows after the first (which records the prefetch trace): train_batch reads each
    parameter once for the forwards and once for the backwards, whatever k is; the loop k times."""
    per_window = {}
    for k in (2, 4):
        for use in (True, False):
            nvme = {"device": "nvme", "nvme_path": str(tmp_path / f"{k}-{use}")}
            config = {"zero_optimization": {"stage": 3, "offload_param": dict(nvme, max_in_cpu=0, min_swap_bytes=0),
                                            "offload_optimizer": nvme, "stage3_param_persistence_threshold": 0,
                                            "sub_group_size": 4096}}
            counted = ParamBytesRead()
            fit(tmp_path, f"{k}-{use}", k, use, batches=3 * k, callbacks=[counted],
                strategy=ZeroStrategy(config=config, use_train_batch=use))
            ends = counted.seen if use else counted.seen[k - 1::k]  # the loop: each window's last batch
            per_window[k, use] = [b - a for a, b in zip(ends, ends[1:])]
    assert per_window[2, True] == per_window[4, True] and min(per_window[2, True]) > 0
    assert all(loop > 3 * window for loop, window in zip(per_window[4, False], per_window[4, True]))


def test_the_loop_is_said_without_use_train_batch(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        fit(tmp_path, "loop", 2, False, batches=2, max_steps=1)
    said = [r.getMessage() for r in caplog.records if "ZeroStrategy runs" in r.getMessage()]
    assert said == ["[zero] ZeroStrategy runs each accumulation window of 2 batches as Lightning's batch loop "
                    "(ZeroStrategy(use_train_batch=True) runs them unit-major)"]


def test_an_accumulation_schedule_is_refused(tmp_path):
    schedule = pl.callbacks.GradientAccumulationScheduler({0: 2, 1: 4})
    t = trainer(ZeroStrategy(stage=3, use_train_batch=True), tmp_path, callbacks=[schedule])
    with pytest.raises(ValueError, match=r"ZeroStrategy\(use_train_batch=True\) takes one accumulate_grad_batches "
                                         r"for the whole fit; remove the GradientAccumulationScheduler callback"):
        t.fit(GPTModule(), loader(2))
