"""ZeroStrategy under Lightning's precision= (zero/integrations/lightning_precision.py).

On two ranks, 32-true equals Lightning's DDP and 16-mixed / bf16-mixed equal the mixed-precision recipe
(zero.examples.train_reference_mixed: a 16-bit compute copy, fp32 master weights stepped by fused AdamW)
written out for two ranks (each rank's 16-bit gradient summed over the ranks in 16 bits, halved in fp32,
unscaled), bit for bit, with ZeroStrategy's loss-scale arguments in the fp16 section; bf16-true starts the
master weights from the bf16 values; the plugin Lightning makes from precision= becomes a ZeroPrecision,
and configs that contradict the precision are refused, arguments without effect warned about by name.
"""
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from zero.config import IgnoredSettingWarning
from zero.examples import train_reference_mixed
from zero.integrations.lightning_precision import apply_precision
from zero.integrations.lightning_options import OPTIONS
from zero.lightning import ZeroPrecision, ZeroStrategy
from zero.partitioning.full_state_dict import full_state_dict
from helpers import run_ranks
from test_lightning_strategy import GPTModule, loader, trainer

WORLD = 2
STEPS = 3
DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
FP16_ARGS = dict(loss_scale=0, initial_scale_power=8, loss_scale_window=2, hysteresis=3, min_loss_scale=0.5)


def precision_kwargs(precision):
    """On the CPU Lightning itself turns precision='16-mixed' into 'bf16-mixed' (the note of
    zero/integrations/lightning_precision.py): fp16 there is the plugin, passed as Lightning takes any."""
    return {"plugins": [ZeroPrecision(precision)]} if precision == "16-mixed" else {"precision": precision}


class RecordScale(pl.Callback):
    def __init__(self):
        self.scales = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.scales.append(trainer.strategy.engine.get_loss_scale())


def scenario_fit(rank, world_size, scratch, precision, strategy_options=None):
    """STEPS steps, one micro-batch each, no clipping, on this rank's share of the data (Lightning's
    DistributedSampler): DDP (``strategy_options`` None) or ZeroStrategy(**strategy_options)."""
    module = GPTModule()
    record = RecordScale()
    strategy = "ddp" if strategy_options is None else ZeroStrategy(**strategy_options)
    t = trainer(strategy, scratch, devices=world_size, use_distributed_sampler=True, max_steps=STEPS,
                gradient_clip_val=0.0, callbacks=[record] if strategy_options is not None else [],
                **precision_kwargs(precision))
    t.fit(module, loader(STEPS * world_size))
    weights = full_state_dict(module) if strategy_options is not None else module.state_dict()
    path = os.path.join(scratch, f"weights{rank}.pt")
    torch.save(dict(weights), path)
    out = {"losses": module.losses, "weights": path, "plugin": type(t.precision_plugin).__name__}
    if strategy_options is not None:
        engine = t.strategy.engine
        out.update(scales=record.scales, final_scale=engine.get_loss_scale(), skipped=engine.skipped_steps,
                   compute=engine.config.precision, fp16=engine.config.fp16.model_dump(),
                   dtypes=sorted({str(p.dtype) for p in module.parameters()}))
    return out


def scenario_reference(rank, world_size, scratch, precision, scales):
    """The mixed-precision recipe on two ranks, in plain PyTorch on the same process group: the module's
    GPT as a 16-bit copy, fp32 masters stepped by its fused AdamW and LambdaLR; each rank's 16-bit gradient
    of its share summed over the ranks in 16 bits (as the engine's reduce-scatter in the compute dtype),
    then in fp32 halved and unscaled (``scales``: the loss scale of each step)."""
    import torch.distributed as dist

    dtype = DTYPES[precision]
    module = GPTModule()
    model = module.gpt
    master = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(dtype)
    opt = torch.optim.AdamW(master, lr=module.hparams.lr, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    data = loader(STEPS * world_size).dataset
    sampler = DistributedSampler(data, world_size, rank, shuffle=True, seed=0)  # as Lightning makes it for training
    batches = DataLoader(data, batch_size=4, sampler=sampler)
    losses = []
    for scale, (x, y) in zip(scales, batches):
        loss = model(x, y)
        losses.append(loss.item())
        (loss * scale if scale != 1.0 else loss).backward()
        for m, p in zip(master, model.parameters()):
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            m.grad = g.float().div_(world_size)
        if scale != 1.0:
            torch._foreach_mul_([m.grad for m in master], torch.tensor(1.0 / scale))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)
                p.grad = None
    path = os.path.join(scratch, f"weights{rank}.pt")
    torch.save({n: p.detach() for n, p in module.state_dict().items()}, path)
    return {"losses": losses, "weights": path}


def scenario_precision(rank, world_size, scratch):
    """Each ZeroStrategy run, then the reference for it with the loss scales it used."""
    def s(*parts):
        os.makedirs(os.path.join(*parts), exist_ok=True)
        return os.path.join(*parts)

    runs = {"ddp": scenario_fit(rank, world_size, s(scratch, "ddp"), "32-true"),
            "32-true": scenario_fit(rank, world_size, s(scratch, "32"), "32-true", {"stage": 2}),
            "16-mixed": scenario_fit(rank, world_size, s(scratch, "16"), "16-mixed", {"stage": 3, **FP16_ARGS}),
            "bf16-mixed": scenario_fit(rank, world_size, s(scratch, "bf16"), "bf16-mixed", {"stage": 2})}
    for precision in DTYPES:
        runs[f"reference {precision}"] = scenario_reference(rank, world_size, s(scratch, f"ref{precision}"),
                                                            precision, runs[precision]["scales"])
    return runs


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("lightning_precision")
    got = run_ranks(WORLD, [("precision", scenario_precision, {})], scratch)
    for rank in range(WORLD):
        assert "error" not in got[rank]["precision"], got[rank]["precision"]["error"]
    return [got[rank]["precision"] for rank in range(WORLD)]


def assert_same(expected, got):
    assert got["losses"] == expected["losses"]
    want, have = torch.load(expected["weights"]), torch.load(got["weights"])
    assert want.keys() == have.keys()
    for name in want:
        assert have[name].dtype == want[name].dtype and torch.equal(have[name], want[name]), name


def test_32_true_on_two_ranks_equals_lightning_ddp(on_two_ranks):
    for runs in on_two_ranks:
        assert runs["32-true"]["plugin"] == "ZeroPrecision" and runs["32-true"]["compute"] == "fp32"
        assert_same(runs["ddp"], runs["32-true"])
    assert on_two_ranks[0]["ddp"]["losses"] != on_two_ranks[1]["ddp"]["losses"]  # each rank its own share


def test_16_mixed_on_two_ranks_equals_the_recipe_with_the_strategys_loss_scale(on_two_ranks):
    for runs in on_two_ranks:
        run = runs["16-mixed"]
        assert run["compute"] == "fp16" and run["dtypes"] == ["torch.float16"]
        assert {k: run["fp16"][k] for k in FP16_ARGS} == FP16_ARGS and run["fp16"]["enabled"] is True
        # dynamic (loss_scale 0) from 2**8, doubled after loss_scale_window=2 steps past the first
        assert run["scales"] == [2.0 ** 8] * STEPS and run["final_scale"] == 2.0 ** 9 and run["skipped"] == 0
        assert_same(runs["reference 16-mixed"], run)


def test_bf16_mixed_on_two_ranks_equals_the_recipe(on_two_ranks):
    for runs in on_two_ranks:
        run = runs["bf16-mixed"]
        assert run["compute"] == "bf16" and run["dtypes"] == ["torch.bfloat16"] and run["scales"] == [1.0] * STEPS
        assert run["fp16"]["enabled"] is False
        assert_same(runs["reference bf16-mixed"], run)
        assert run["losses"] != runs["32-true"]["losses"]  # really 16-bit


def test_bf16_true_starts_the_master_weights_from_the_bf16_values(tmp_path):
    torch.manual_seed(0)
    reference = GPTModule().gpt.to(torch.bfloat16).float()  # what convert_module leaves of the fp32 values
    batches = [(x, y) for x, y in loader(STEPS)]
    expected = train_reference_mixed(reference, batches, STEPS, torch.bfloat16, lr=1e-3, weight_decay=0.01)
    module = GPTModule()
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01,
                                                            fused=True)  # no schedule, as the recipe
    t = trainer(ZeroStrategy(stage=3), tmp_path, precision="bf16-true", gradient_clip_val=0.0, max_steps=STEPS)
    t.fit(module, loader(STEPS))
    assert module.losses == expected
    got = full_state_dict(module.gpt)
    for name, p in reference.named_parameters():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], p.detach()), name


# -- the plugin Lightning makes from precision= -----------------------------------------------------------------

@pytest.mark.parametrize("precision, becomes", [("32-true", "32-true"), (32, "32-true"), ("bf16-mixed", "bf16-mixed"),
                                                ("bf16-true", "bf16-true"), ("16-true", "16-true"),
                                                ("16-mixed", "bf16-mixed")])
def test_the_plugin_lightning_chose_becomes_a_zero_precision(precision, becomes):
    t = pl.Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=1, precision=precision, logger=False)
    assert isinstance(t.precision_plugin, ZeroPrecision) and t.precision == becomes  # 16-mixed: Lightning's CPU rule


def test_a_gpus_mixed_precision_plugin_becomes_zero_precision_and_others_are_refused():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ZeroStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", enabled=False))
    assert isinstance(strategy.precision_plugin, ZeroPrecision) and strategy.precision_plugin.precision == "16-mixed"
    with pytest.raises(ValueError, match=r"ZeroStrategy trains with precision '32-true', '16-mixed', 'bf16-mixed', "
                                         r"'16-true' or 'bf16-true' \(the engine computes in fp32, fp16 or bf16 from "
                                         r"fp32 master weights\); got '64-true' \(DoublePrecision\)"):
        pl.Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=1, precision="64-true", logger=False)
    with pytest.raises(ValueError, match=r"ZeroPrecision\('8-mixed'\): the engine computes in fp32, fp16 or bf16"):
        ZeroPrecision("8-mixed")


def test_16_bit_inputs_and_modules_as_deepspeed_precision_converts_them():
    x = {"ids": torch.arange(3), "features": torch.ones(2)}
    got = ZeroPrecision("bf16-mixed").convert_input(x)
    assert got["ids"].dtype == torch.int64 and got["features"].dtype == torch.bfloat16
    assert ZeroPrecision("32-true").convert_input(x) is x
    assert ZeroPrecision("16-true").convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float16
    assert ZeroPrecision("16-mixed").convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float32
    with ZeroPrecision("bf16-true").module_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


# -- the config sections -----------------------------------------------------------------------------------------

def sections(config, precision, **options):
    config = dict(config)
    apply_precision(config, precision, dict(OPTIONS, **options))
    return config


def test_the_sections_deepspeedstrategy_adds():
    assert sections({}, "16-mixed", **FP16_ARGS)["fp16"] == {"enabled": True, **FP16_ARGS}
    assert sections({}, "16-true")["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                               "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    assert sections({}, "bf16-mixed") == {"bf16": {"enabled": True}} == sections({}, "bf16-true")
    assert sections({}, "32-true") == {}
    assert sections({"fp16": {"enabled": "auto"}}, "32-true") == {"fp16": {"enabled": False}}
    # the config's own section rules; "auto" is decided by the precision
    assert sections({"fp16": {"enabled": True, "loss_scale": 128}}, "16-mixed")["fp16"] == {
        "enabled": True, "loss_scale": 128}
    assert sections({"fp16": {"enabled": "auto"}, "bfloat16": {"enabled": "auto"}}, "bf16-mixed") == {
        "fp16": {"enabled": False}, "bf16": {"enabled": True}}


@pytest.mark.parametrize("config, precision, message", [
    ({"bf16": {"enabled": True}}, "16-mixed", r"Trainer\(precision='16-mixed'\) computes in fp16, but the DeepSpeed "
                                              r"config enables bf16; drop the config's bf16 section, or pass the "
                                              r"precision that matches it"),
    ({"fp16": {"enabled": False}}, "16-true", r"Trainer\(precision='16-true'\) computes in fp16, but the DeepSpeed "
                                              r"config's fp16 section has enabled false; set it true, drop the "
                                              r"section, or pass precision='32-true'"),
])
def test_a_config_that_contradicts_the_precision_is_refused(config, precision, message):
    with pytest.raises(ValueError, match=message):
        sections(config, precision)


@pytest.mark.parametrize("config, precision, message", [
    ({}, "32-true", "ZeroStrategy(loss_scale_window=2) has no effect: the loss-scale arguments configure fp16, which "
                    "Trainer(precision='32-true') does not compute in (use precision='16-mixed')"),
    ({"fp16": {"enabled": True}}, "32-true", "ZeroStrategy(loss_scale_window=2) has no effect: the config's own fp16 "
                                             "section sets the loss scaling (as with DeepSpeedStrategy); set these "
                                             "keys there"),
    ({"fp16": {"enabled": True}}, "16-mixed", "ZeroStrategy(loss_scale_window=2) has no effect: the config's own "
                                              "fp16 section sets the loss scaling (as with DeepSpeedStrategy); set "
                                              "these keys there"),
    ({}, "bf16-mixed", "ZeroStrategy(loss_scale_window=2) has no effect: loss scaling is fp16's, and "
                       "Trainer(precision='bf16-mixed') computes in bf16, which needs none"),
])
def test_loss_scale_arguments_without_effect_warn_naming_them(config, precision, message):
    with pytest.warns(IgnoredSettingWarning) as caught:
        sections(config, precision, loss_scale_window=2)
    assert [str(w.message) for w in caught] == [message]
