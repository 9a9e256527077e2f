"""zero.lightning.ZeroStrategy: Lightning's strategy= on the ZeRO engine, stages 0-3.

3 steps with params and optimizer on NVMe match Lightning's own run without ZeRO (losses
and weights); every rung (stages 0, 1, 2, 2 + optimizer offload, 3) on two ranks matches
Lightning's DDP on two ranks; configure_model builds under zero.Init straight to NVMe at
stage 3 and whole below it; each registered name gives its config; save and resume continue
exactly; convert_zero_checkpoint_to_fp32_state_dict gives a file load_from_checkpoint reads;
unknown arguments and unsupported combinations are refused with their message. Precision is
test_lightning_precision.py's; the DeepSpeedStrategy arguments refused before (activation checkpointing,
full-weights files, frozen parameters) are test_lightning_strategy_arguments.py's.
"""
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from torch.utils.data import DataLoader, TensorDataset

from zero.examples import GPT, GPTConfig, make_batches
from zero.partitioning.full_state_dict import full_state_dict
from zero.lightning import ZeroStrategy, convert_zero_checkpoint_to_fp32_state_dict
from helpers import run_ranks

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


def assert_same_weights(expected: dict, got: dict, exact: bool = False, atol: float = 1e-7):
    assert expected.keys() == got.keys()
    for name in expected:
        if exact:
            assert torch.equal(got[name], expected[name]), name
        else:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=atol, msg=name)


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


# -- two ranks: every rung of the ladder against Lightning's DDP ---------------------------------------------

WORLD = 2
RUNGS = {  # ZeroStrategy's arguments, DeepSpeedStrategy's meaning
    "stage_0": dict(zero_optimization=False),
    "stage_1": dict(stage=1),
    "stage_2": dict(stage=2),
    "stage_2_offload": dict(stage=2, offload_optimizer=True),
    "stage_3": dict(stage=3),
}


def scenario_fit(rank, world_size, scratch, strategy_options=None):
    """2 steps of 2 accumulated micro-batches on this rank's half of the data, clipped: Lightning's
    DDP (``strategy_options`` None) or ZeroStrategy(**strategy_options). Returns this rank's losses
    and the file its final weights went to."""
    module = GPTModule()
    strategy = "ddp" if strategy_options is None else ZeroStrategy(**strategy_options)
    t = trainer(strategy, scratch, devices=world_size, use_distributed_sampler=True, max_steps=2,
                accumulate_grad_batches=2)
    t.fit(module, loader(4 * world_size))
    weights = full_state_dict(module) if strategy_options is not None else module.state_dict()
    path = os.path.join(scratch, f"weights{rank}.pt")
    torch.save(dict(weights), path)
    stage = t.strategy.engine.zero_optimization_stage() if strategy_options is not None else None
    return {"losses": module.losses, "weights": path, "stage": stage}


@pytest.fixture(scope="module")
def ladder_on_two_ranks(tmp_path_factory):
    scenarios = [("ddp", scenario_fit, {})]
    scenarios += [(name, scenario_fit, {"strategy_options": options}) for name, options in RUNGS.items()]
    return run_ranks(WORLD, scenarios, tmp_path_factory.mktemp("lightning_ranks"))


@pytest.mark.parametrize("rung", list(RUNGS))
def test_each_stage_on_two_ranks_matches_lightning_ddp(ladder_on_two_ranks, rung):
    for rank in range(WORLD):
        ddp, ours = ladder_on_two_ranks[rank]["ddp"], ladder_on_two_ranks[rank][rung]
        assert "error" not in ddp, ddp["error"]
        assert "error" not in ours, ours["error"]
        assert ours["stage"] == int(rung.split("_")[1])
        assert len(ours["losses"]) == 4
        torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=1e-6, atol=0)
        # DDP sums each rank's accumulated gradient, the engine each micro-batch's as backward makes it: the
        # last bits differ. Where the true gradient is 0 (the attention keys' bias: softmax ignores a shift of
        # all scores) those bits are all there is, and Adam scales them to the size of a step (lr = 1e-3):
        # 1% of one step still tells a rank that steps alone or skips the average.
        assert_same_weights(torch.load(ddp["weights"]), torch.load(ours["weights"]), atol=1e-5)
    # the ranks trained different halves of the data, so a rank-local step would show
    assert ladder_on_two_ranks[0]["ddp"]["losses"] != ladder_on_two_ranks[1]["ddp"]["losses"]


def test_configure_model_builds_under_zero_init_straight_to_nvme(tmp_path):
    plain = GPTModule(build_in_configure_model=True)
    trainer("auto", tmp_path).fit(plain, loader())
    ours = GPTModule(build_in_configure_model=True)
    seen = {}

    class Check(pl.Callback):
        def on_fit_start(self, trainer, module):  # after configure_model, before any step
            seen["partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in module.parameters())

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}  # every partition on NVMe, however small:
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": nvme,  # the config form takes ours
                                    "offload_param": dict(nvme, max_in_cpu=0, min_swap_bytes=0)}}
    trainer(ZeroStrategy(config=config), tmp_path, callbacks=[Check()]).fit(ours, loader())
    assert seen["partitioned"]
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(ours))


NAMES = {  # registered name -> (stage, offload_optimizer device, offload_param device, remote_device)
    "zero": (2, "none", "none", None),
    "zero_stage_1": (1, "none", "none", None),
    "zero_stage_2": (2, "none", "none", None),
    "zero_stage_2_offload": (2, "cpu", "none", None),
    "zero_stage_2_offload_nvme": (2, "nvme", "none", None),
    "zero_stage_3": (3, "none", "none", None),
    "zero_stage_3_offload": (3, "cpu", "cpu", None),
    "zero_stage_3_offload_nvme": (3, "nvme", "nvme", "nvme"),
}


def test_every_deepspeed_name_has_its_zero_name_with_the_same_arguments():
    from lightning.pytorch.strategies import StrategyRegistry

    deepspeed = {name for name in StrategyRegistry if name.startswith("deepspeed")}
    assert deepspeed  # Lightning registers them without the deepspeed package
    for name in deepspeed:
        ours = "zero" + name[len("deepspeed"):]
        assert StrategyRegistry[ours]["strategy"] is ZeroStrategy, ours
        assert StrategyRegistry[ours]["init_params"] == StrategyRegistry[name]["init_params"], ours
    assert set(NAMES) == {name for name in StrategyRegistry if name.split("_")[0] == "zero"}


@pytest.mark.parametrize("name", list(NAMES))
def test_registered_names_resolve_to_their_config(tmp_path, name):
    from zero.config import load_config

    stage, optimizer_device, param_device, remote_device = NAMES[name]
    strategy = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy
    assert isinstance(strategy, ZeroStrategy)
    config = strategy.config
    for key in ("offload_optimizer", "offload_param"):
        section = config["zero_optimization"].get(key, {})
        if section.get("device") == "nvme":
            assert section["nvme_path"] == "/local_nvme"  # DeepSpeedStrategy's default nvme_path
            section["nvme_path"] = str(tmp_path)  # which the engine's check wants to exist
    zc = load_config(config).zero_optimization
    assert (zc.stage, zc.offload_optimizer.device, zc.offload_param.device) == (stage, optimizer_device, param_device)
    assert strategy.remote_device == remote_device and strategy.zero_stage_3 == (stage == 3)


@pytest.mark.parametrize("name, whole", [("zero_stage_3_offload", False), ("zero_stage_2_offload", True)])
def test_registered_names_train_as_lightning_does_and_build_under_zero_init_at_stage_3_only(tmp_path, name, whole):
    plain = GPTModule(build_in_configure_model=True)
    trainer("auto", tmp_path).fit(plain, loader())
    seen = {}

    class Built(GPTModule):
        def configure_model(self):
            super().configure_model()
            seen["whole"] = [p.numel() > 0 for p in self.parameters()]  # inside the strategy's context

    ours = Built(build_in_configure_model=True)
    t = trainer(name, tmp_path)
    t.fit(ours, loader())
    assert seen["whole"] == [whole] * len(list(plain.parameters()))
    zc = t.strategy.engine.config.zero_optimization
    assert (zc.stage, zc.offload_optimizer.device) == (NAMES[name][0], "cpu")
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(ours))


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
    ({"stage": 4}, r"ZeroStrategy\(stage=4\): ZeRO stages are 0, 1, 2 and 3"),
    ({"stage": 2, "offload_parameters": True},
     r"ZeroStrategy\(stage=2, offload_parameters=True\): parameters are partitioned, and so offloaded, only at "
     r"ZeRO stage 3 \(below it every rank keeps them whole\); pass stage=3, or drop offload_parameters "
     r"\(offload_optimizer=True alone is ZeRO-Offload at stage 2\)"),
    ({"stage": 1, "offload_optimizer": True, "offload_parameters": True},
     r"ZeroStrategy\(stage=1, offload_parameters=True\): .* pass stage=3"),
    ({"stage": 0, "offload_optimizer": True},
     r"ZeroStrategy\(stage=0, offload_optimizer=True\): optimizer states are partitioned, and so offloaded, "
     r"from ZeRO stage 1 on; pass stage=1, 2 or 3"),
    ({"stage": 2, "remote_device": "nvme"},
     r"ZeroStrategy\(stage=2, remote_device='nvme'\): remote_device places the parameters configure_model builds "
     r"under zero.Init, which runs at ZeRO stage 3 only; pass stage=3, or drop remote_device"),
    ({"zero_optimization": False, "offload_optimizer": True},
     r"ZeroStrategy\(zero_optimization=False, offload_optimizer=True\): offload needs ZeRO \(zero_optimization="
     r"False is stage 0\); drop zero_optimization=False and pass stage=1"),
    ({"zero_optimization": False, "stage": 2},
     r"ZeroStrategy\(zero_optimization=False, stage=2\): zero_optimization=False is ZeRO stage 0 \(a config "
     r"without a zero_optimization section\); pass one of the two"),
])
def test_unsupported_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


def test_remote_device_with_a_config_below_stage_3_is_refused():
    with pytest.raises(ValueError, match=r"ZeroStrategy\(remote_device='cpu'\) with a config at ZeRO stage 2: "
                                         r"remote_device places .* set zero_optimization.stage to 3, or drop "
                                         r"remote_device"):
        ZeroStrategy(config={"zero_optimization": {"stage": 2}}, remote_device="cpu")
    assert ZeroStrategy(config={"zero_optimization": {"stage": 3}}, remote_device="cpu").zero_stage_3


def test_zero_optimization_false_is_a_config_without_a_zero_section_which_is_stage_0():
    from zero.config import load_config

    strategy = ZeroStrategy(zero_optimization=False)
    assert "zero_optimization" not in strategy.config and not strategy.zero_stage_3
    assert load_config(strategy.config).zero_optimization.stage == 0
    assert ZeroStrategy(stage=0).config["zero_optimization"] == {"stage": 0}


def test_accumulation_in_the_config_is_refused(tmp_path):
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError, match="do not set gradient_accumulation_steps in the DeepSpeed config"):
        trainer(ZeroStrategy(config=config), tmp_path).fit(GPTModule(), loader())
