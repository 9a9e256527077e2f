"""zero.lightning.ZeroStrategy: Lightning's strategy= on the ZeRO-3 engine, params and optimizer on NVMe.

3 steps match Lightning's own run without ZeRO (losses and weights); configure_model builds
under zero.Init straight to NVMe; the registered names work; save and resume continue
exactly; convert_zero_checkpoint_to_fp32_state_dict gives a file load_from_checkpoint reads;
unknown or unsupported arguments are refused with their message.
"""
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from torch.utils.data import DataLoader, TensorDataset

from zero.examples import GPT, GPTConfig, make_batches
from zero.partitioning.full_state_dict import full_state_dict
from zero.lightning import ZeroStrategy, convert_zero_checkpoint_to_fp32_state_dict

CFG = GPTConfig()


class GPTModule(pl.LightningModule):
    """The example GPT with a fused AdamW (the engine's kernel) and a per-step schedule."""

    def __init__(self, lr: float = 1e-3, build_in_configure_model: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.losses = []
        self.gpt = None
        if not build_in_configure_model:
            torch.manual_seed(0)
            self.gpt = GPT(CFG)

    def configure_model(self):
        if self.gpt is None:
            torch.manual_seed(0)
            self.gpt = GPT(CFG)

    def training_step(self, batch, batch_idx):
        loss = self.gpt(*batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.gpt(*batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batches=6):
    b = make_batches(CFG, batches, 4)
    return DataLoader(TensorDataset(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b])), batch_size=4)


def trainer(strategy, root, **kw):
    args = dict(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
                use_distributed_sampler=False, gradient_clip_val=1.0)
    args.update(kw)
    return pl.Trainer(strategy=strategy, **args)


def nvme_strategy(path, **kw):
    return ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True, remote_device="nvme",
                        offload_params_device="nvme", offload_optimizer_device="nvme", nvme_path=str(path),
                        max_in_cpu=0, **kw)


def assert_same_weights(expected: dict, got: dict, exact: bool = False):
    assert expected.keys() == got.keys()
    for name in expected:
        if exact:
            assert torch.equal(got[name], expected[name]), name
        else:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_three_steps_match_lightning_without_zero_with_nvme_offload(tmp_path, accumulate):
    plain = GPTModule()
    plain_trainer = trainer("auto", tmp_path, accumulate_grad_batches=accumulate)
    plain_trainer.fit(plain, loader())
    ours = GPTModule()
    strategy = nvme_strategy(tmp_path)
    our_trainer = trainer(strategy, tmp_path, accumulate_grad_batches=accumulate)
    our_trainer.fit(ours, loader())
    assert len(ours.losses) == 3 * accumulate
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(ours))
    zc = strategy.engine.config.zero_optimization
    assert zc.offload_param.device == zc.offload_optimizer.device == "nvme"
    assert strategy.engine.config.gradient_clipping == 1.0
    assert strategy.engine.config.gradient_accumulation_steps == accumulate
    # validation runs through the engine too
    assert our_trainer.validate(ours, loader(2), verbose=False) == \
        plain_trainer.validate(plain, loader(2), verbose=False)


def test_configure_model_builds_under_zero_init_straight_to_nvme(tmp_path):
    plain = GPTModule(build_in_configure_model=True)
    trainer("auto", tmp_path).fit(plain, loader())
    ours = GPTModule(build_in_configure_model=True)
    seen = {}

    class Check(pl.Callback):
        def on_fit_start(self, trainer, module):  # after configure_model, before any step
            seen["partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in module.parameters())

    trainer(nvme_strategy(tmp_path), tmp_path, callbacks=[Check()]).fit(ours, loader())
    assert seen["partitioned"]
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(ours))


def test_registered_names_take_their_offload(tmp_path):
    ours = GPTModule()
    t = trainer("zero_stage_3_offload", tmp_path)
    assert isinstance(t.strategy, ZeroStrategy)
    t.fit(ours, loader())
    zc = t.strategy.engine.config.zero_optimization
    assert zc.offload_param.device == zc.offload_optimizer.device == "cpu"
    plain = GPTModule()
    trainer("auto", tmp_path).fit(plain, loader())
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    nvme = pl.Trainer(strategy="zero_stage_3_offload_nvme", accelerator="cpu", devices=1, logger=False)
    assert nvme.strategy.config["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert nvme.strategy.remote_device == "nvme"


def test_save_and_resume_continue_exactly_and_convert_to_one_file(tmp_path):
    # 2 batches per epoch: the whole run is 2 epochs, the interrupted one stops after the first.
    whole = GPTModule()
    trainer(nvme_strategy(tmp_path), tmp_path, max_steps=-1, max_epochs=2).fit(whole, loader(2))

    first = GPTModule()
    t = trainer(nvme_strategy(tmp_path), tmp_path, max_steps=-1, max_epochs=1)
    t.fit(first, loader(2))
    checkpoint = tmp_path / "epoch0.ckpt"
    t.save_checkpoint(checkpoint)
    assert sorted(os.listdir(checkpoint)) == ["checkpoint", "latest"]

    resumed = GPTModule()
    t2 = trainer(nvme_strategy(tmp_path), tmp_path, max_steps=-1, max_epochs=2)
    t2.fit(resumed, loader(2), ckpt_path=str(checkpoint))
    assert t2.global_step == 4 and first.losses + resumed.losses == whole.losses
    final = full_state_dict(whole)
    assert_same_weights(final, full_state_dict(resumed), exact=True)

    out = tmp_path / "model.ckpt"
    written = convert_zero_checkpoint_to_fp32_state_dict(checkpoint, out)
    assert written["global_step"] == 2 and written["hyper_parameters"]["lr"] == 1e-3
    loaded = GPTModule.load_from_checkpoint(out)
    assert_same_weights(full_state_dict(first), loaded.state_dict(), exact=True)


def test_unknown_argument_is_refused_with_the_closest_name():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) 'offload_optimiser' \(did you mean "
                                        r"'offload_optimizer'\?\); it takes DeepSpeedStrategy's arguments"):
        ZeroStrategy(stage=3, offload_optimiser=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 2}, r"ZeroStrategy\(stage=2\): this engine is ZeRO stage 3"),
    ({"stage": 3, "cpu_checkpointing": True}, r"ZeroStrategy\(cpu_checkpointing=True\) is not supported: "
                                               r"activation checkpointing is the module's own"),
    ({"stage": 3, "load_full_weights": True}, r"ZeroStrategy\(load_full_weights=True\) is not supported"),
])
def test_unsupported_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


def test_accumulation_in_the_config_and_mixed_precision_are_refused(tmp_path):
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError, match="do not set gradient_accumulation_steps in the DeepSpeed config"):
        trainer(ZeroStrategy(config=config), tmp_path).fit(GPTModule(), loader())
    with pytest.raises(ValueError, match=r"ZeroStrategy trains with precision='32-true' \(got 'bf16-mixed'\)"):
        trainer(ZeroStrategy(stage=3), tmp_path, precision="bf16-mixed").fit(GPTModule(), loader())
