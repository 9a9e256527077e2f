"""Hugging Face's Trainer and Lightning on CUDA (issue 30): the engine under each framework on the
GPU trains as the framework's own run without ZeRO on the same GPU does.

The CPU suite runs the frameworks on the CPU only (``use_cpu=True``, ``accelerator="cpu"``). On a
GPU they take paths the CPU never does: the Trainer's device is ``cuda:0`` and it moves each batch
there, Lightning's accelerator is the GPU and its precision plugin is its CUDA one (``16-mixed``
stays fp16, where on the CPU Lightning makes it bf16), and both keep CUDA's random state in their
checkpoints. Each test checks where the engine computed and compares losses and weights.

Every test is marked ``cuda`` (bench/gpu_check.py's tests stage runs them) and skips without a
GPU; ``pytest --cuda-suite-on-cpu tests/test_cuda_frameworks.py`` runs them with the CPU as their
device, where every comparison is exact: a dry check of the references.

[Note: the keys' bias on CUDA]
The tolerances are tests/test_cuda_engine.py's [Note: the tolerances on CUDA]. On CUDA one slice
is left out of the weights compared: the keys' third of each attention's input bias (GPT-2's
``c_attn.bias``, the example GPT's ``qkv.bias``). Softmax ignores a shift shared by all keys, so
that bias never changes an output or a loss; its gradient is rounding, and any last-bit difference
between the two runs (the host's AdamW against the GPU's, a gradient norm summed in another order)
turns it into a different Adam step of up to the learning rate (tests/test_cuda_engine.py [Note:
the optimizer steps where the engine's does]). The losses, which it cannot move, are compared whole.
"""
import os

import pytest
import torch

from test_cuda_engine import LR, assert_matches, tolerance
from zero.examples import GPT, GPTConfig, make_batches, train_reference_mixed
from zero.partitioning.full_state_dict import full_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_algorithms")]

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
STEPS = 3
KEY_BIASES = ("attn.c_attn.bias", "attn.qkv.bias")  # [query | key | value] biases, keys in the middle third


@pytest.fixture
def device(cuda_suite_device):
    return cuda_suite_device


def nvme(tmp_path, name="nvme"):
    (tmp_path / name).mkdir()
    return tmp_path / name


def comparable(weights: dict, device) -> dict:
    """``weights`` on the CPU, the keys' biases cut out on CUDA (see the note)."""
    out = {}
    for name, w in weights.items():
        w = w.detach().cpu()
        if device.type == "cuda" and name.endswith(KEY_BIASES):
            third = w.shape[0] // 3
            w = torch.cat([w[:third], w[2 * third:]])
        out[name] = w
    return out


def assert_trained_alike(losses, expected_losses, weights, expected_weights, initial, device, precision="fp32",
                         moved_at_least=LR / 2):
    """test_cuda_engine.py's comparison, the keys' biases left out on CUDA (see the note)."""
    assert_matches(losses, (expected_losses, expected_weights, initial), weights, device, precision, moved_at_least,
                   leave_out=lambda w: comparable(w, device))


# -- Hugging Face's Trainer -----------------------------------------------------------------------------------

@pytest.fixture
def hf():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")
    import transformers

    return transformers


def tiny_gpt2(hf):
    torch.manual_seed(0)
    config = hf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                           eos_token_id=0, attn_implementation="eager")  # (deterministic on CUDA)
    return hf.GPT2LMHeadModel(config)


def gpt2_data(n=24):
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def hf_args(hf, out, device, **overrides):
    """The Trainer on ``device``: cuda:0 as a GPU user runs it (no ``use_cpu``), the CPU for the dry check."""
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        pytest.skip("the plain Trainer would split each batch over all GPUs (DataParallel): run with one visible")
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=LR,
              weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[], use_cpu=device.type == "cpu",
              seed=0, disable_tqdm=True)
    kw.update(overrides)
    args = hf.TrainingArguments(**kw)
    assert args.device.type == device.type
    return args


def hf_losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def nvme_params_config(path):
    """ZeRO-3, parameters on NVMe, the optimizer on the compute device, "auto" from the Trainer."""
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path),
                                                                "max_in_cpu": 0, "min_swap_bytes": 0},
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 4096},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto"}


def hf_guide_stage_2():
    """Hugging Face's guide's ZeRO-Offload config (stage 2, the optimizer on the host) as users paste it,
    but the scheduler: without it the Trainer's own schedule runs, as it does for the plain Trainer."""
    import json

    with open(os.path.join(DATA_DIR, "ds_config_zero2_auto.json")) as f:
        config = json.load(f)
    del config["scheduler"]
    return config


@pytest.mark.parametrize("setup", ["zero3-params-on-nvme", "hf-guide-zero-offload"])
def test_the_trainer_on_the_gpu_matches_the_plain_trainer_there(tmp_path, device, hf, setup):
    from zero.hf import ZeroTrainer

    args = dict(gradient_accumulation_steps=2)
    model = tiny_gpt2(hf)
    optimizers = (None, None)
    if setup == "hf-guide-zero-offload":  # a config's optimizer takes every parameter (HF's rule), decayed alike
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
        optimizers = (opt, hf.get_linear_schedule_with_warmup(opt, 0, STEPS))
    plain = hf.Trainer(model=model, args=hf_args(hf, tmp_path / "plain", device, **args), train_dataset=gpt2_data(),
                       optimizers=optimizers)
    initial = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    plain.train()
    assert next(plain.model.parameters()).device.type == device.type
    config = nvme_params_config(nvme(tmp_path)) if setup == "zero3-params-on-nvme" else hf_guide_stage_2()
    model = tiny_gpt2(hf)
    ours = ZeroTrainer(model=model, args=hf_args(hf, tmp_path / "ours", device, **args), train_dataset=gpt2_data(),
                       zero_config=config)
    ours.train()
    engine = ours.zero_engine
    assert engine.device.type == device.type and engine.config.precision == "fp32"
    if setup == "hf-guide-zero-offload":
        assert engine.zero_optimization_stage() == 2
        assert engine.config.zero_optimization.offload_optimizer.device == "cpu"
    weights = full_state_dict(model)
    expected = dict(plain.model.named_parameters())
    assert_trained_alike(hf_losses(ours), hf_losses(plain), {n: weights[n] for n in expected}, expected, initial,
                         device, moved_at_least=LR / 4)  # (the Trainer's linear schedule: LR, 2/3 LR, 1/3 LR)
    engine.destroy()


def test_the_trainers_bf16_on_the_gpu_computes_in_bf16_and_tracks_the_plain_trainers(tmp_path, device, hf):
    """``TrainingArguments(bf16=True)`` with the config's ``"bf16": {"enabled": "auto"}``: the engine computes in
    bf16 on the GPU from fp32 masters, where the plain Trainer autocasts fp32 weights. The recipes differ
    (an Adam step of a near-zero gradient may flip its sign between them: weights are not compared), so
    the losses are held to 1% of each other (0.03% seen on the CPU); bf16's numerics against their own
    recipe are test_cuda_engine.py's and the Lightning test's below."""
    from zero.hf import ZeroTrainer

    plain = hf.Trainer(model=tiny_gpt2(hf), args=hf_args(hf, tmp_path / "plain", device, bf16=True),
                       train_dataset=gpt2_data())
    plain.train()
    model = tiny_gpt2(hf)
    ours = ZeroTrainer(model=model, args=hf_args(hf, tmp_path / "ours", device, bf16=True), train_dataset=gpt2_data(),
                       zero_config=dict(nvme_params_config(nvme(tmp_path)), bf16={"enabled": "auto"}))
    ours.train()
    engine = ours.zero_engine
    assert engine.device.type == device.type and engine.config.precision == "bf16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(hf_losses(ours)) == STEPS
    torch.testing.assert_close(hf_losses(ours), hf_losses(plain), rtol=1e-2, atol=0)
    engine.destroy()


def test_the_trainer_saves_and_resumes_on_the_gpu_as_it_ran(tmp_path, device, hf):
    """CUDA's random state, the engine's NVMe checkpoint and the Trainer's state, saved at step 2 of 4 and
    resumed: steps 3 and 4 as the run that went on (dropout draws on CUDA's generator there)."""
    from zero.hf import ZeroTrainer

    args = dict(max_steps=4, save_strategy="steps", save_steps=2, weight_decay=0.0)
    whole = ZeroTrainer(model=tiny_gpt2(hf), args=hf_args(hf, tmp_path / "whole", device, **args),
                        train_dataset=gpt2_data(), zero_config=nvme_params_config(nvme(tmp_path, "whole")))
    whole.train()
    final = full_state_dict(whole.model)
    whole.zero_engine.destroy()
    resumed = ZeroTrainer(model=tiny_gpt2(hf), args=hf_args(hf, tmp_path / "resumed", device, **args),
                          train_dataset=gpt2_data(), zero_config=nvme_params_config(nvme(tmp_path, "resumed")))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.state.global_step == 4 and resumed.zero_engine.device.type == device.type
    tol = tolerance(device, "fp32")
    torch.testing.assert_close(hf_losses(resumed), hf_losses(whole), rtol=tol.loss_rtol, atol=0)
    final, got = comparable(final, device), comparable(full_state_dict(resumed.model), device)
    for name, value in final.items():
        torch.testing.assert_close(got[name], value, rtol=tol.weight_rtol, atol=tol.weight_atol, msg=name)
    resumed.zero_engine.destroy()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
def test_a_peft_lora_on_the_gpu_matches_the_plain_trainer_there(tmp_path, device, hf, checkpointing):
    """peft's LoRA on GPT-2 (base frozen on NVMe, adapters trained on the GPU) through ZeroTrainer, as the
    plain Trainer trains it on the same GPU; the base is never changed. With ``gradient_checkpointing``
    (non-reentrant) each layer's forward runs again in backward, CUDA's random state restored for its
    dropout."""
    peft = pytest.importorskip("peft", reason="needs peft: pip install peft")
    from zero.hf import ZeroTrainer

    def lora():
        model = tiny_gpt2(hf)
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                                                           fan_in_fan_out=True))
        with torch.no_grad():  # B starts at zero: make the adapters matter from the first step
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return model

    args = dict(gradient_accumulation_steps=2)
    if checkpointing:
        args.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = hf.Trainer(model=lora(), args=hf_args(hf, tmp_path / "plain", device, **args), train_dataset=gpt2_data())
    initial = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    plain.train()
    model = lora()
    ours = ZeroTrainer(model=model, args=hf_args(hf, tmp_path / "ours", device, **args), train_dataset=gpt2_data(),
                       zero_config=nvme_params_config(nvme(tmp_path)))
    ours.train()
    engine = ours.zero_engine
    assert engine.device.type == device.type and engine.rank_layout.frozen
    weights = full_state_dict(model)
    trained = {n: p for n, p in plain.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert_trained_alike(hf_losses(ours), hf_losses(plain), {n: weights[n] for n in trained}, trained, initial,
                         device, moved_at_least=LR / 4)
    for name, p in plain.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(weights[name], initial[name].cpu()), name
    engine.destroy()


# -- Lightning ------------------------------------------------------------------------------------------------

CFG = GPTConfig()


@pytest.fixture
def pl():
    return pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")


def gpt_module(pl):
    """The example GPT with fused AdamW at a constant LR (the reference recipe's), losses recorded."""

    class GPTModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(CFG)
            self.losses = []
            self.computed_on = set()  # where the losses were: at the end of fit Lightning moves the module to the CPU

        def training_step(self, batch, batch_idx):
            loss = self.gpt(*batch)
            self.losses.append(loss.item())
            self.computed_on.add(loss.device.type)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01, fused=True)

    return GPTModule()


def lightning_data(n):
    from torch.utils.data import DataLoader, TensorDataset

    b = make_batches(CFG, n, 4)
    return DataLoader(TensorDataset(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b])), batch_size=4)


def lightning_trainer(pl, device, strategy, root, **kw):
    """Lightning on ``device``: the GPU as a GPU user runs it (accelerator="gpu"), the CPU for the dry check."""
    args = dict(max_steps=STEPS, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                default_root_dir=str(root), use_distributed_sampler=False)
    args.update(kw)
    return pl.Trainer(strategy=strategy, **args)


def nvme_strategy(path):
    from zero.lightning import ZeroStrategy

    return ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True, remote_device="nvme",
                        offload_params_device="nvme", offload_optimizer_device="nvme", nvme_path=str(path),
                        max_in_cpu=0)


@pytest.mark.parametrize("rung", ["stage-2", "stage-3-all-on-nvme"])
def test_lightning_on_the_gpu_matches_lightning_without_zero_there(tmp_path, device, pl, rung):
    from zero.lightning import ZeroStrategy

    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    plain = gpt_module(pl)
    initial = {n: p.detach().clone() for n, p in plain.gpt.named_parameters()}
    lightning_trainer(pl, device, "auto", tmp_path / "plain", **kw).fit(plain, lightning_data(2 * STEPS))
    assert plain.computed_on == {device.type}
    ours = gpt_module(pl)
    strategy = ZeroStrategy(stage=2) if rung == "stage-2" else nvme_strategy(nvme(tmp_path))
    lightning_trainer(pl, device, strategy, tmp_path / "ours", **kw).fit(ours, lightning_data(2 * STEPS))
    engine = strategy.engine
    assert engine.device.type == device.type
    assert engine.zero_optimization_stage() == (2 if rung == "stage-2" else 3)
    weights = full_state_dict(ours.gpt)
    expected = dict(plain.gpt.named_parameters())
    assert_trained_alike(ours.losses, plain.losses, {n: weights[n] for n in expected}, expected, initial, device)
    engine.destroy()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_mixed_precision_on_the_gpu_equals_the_recipe_there(tmp_path, device, pl, precision):
    """Lightning's CUDA plugin for ``precision`` becomes ZeroPrecision: the engine computes in that
    dtype from fp32 masters (fp16 at ZeroStrategy's static loss scale), as train_reference_mixed does
    on the same device. (On the CPU Lightning makes 16-mixed bf16: the dry check passes the plugin.)"""
    from zero.lightning import ZeroPrecision, ZeroStrategy

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    scale = 256.0 if dtype is torch.float16 else 1.0
    batches = [(x.to(device), y.to(device)) for x, y in lightning_data(STEPS)]
    reference = gpt_module(pl).gpt.to(device)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    expected = train_reference_mixed(reference, batches, STEPS, dtype, lr=LR, weight_decay=0.01, loss_scale=scale)
    ours = gpt_module(pl)
    strategy = ZeroStrategy(stage=3, **({"loss_scale": scale} if scale != 1.0 else {}))
    how = {"plugins": [ZeroPrecision(precision)]} if device.type == "cpu" else {"precision": precision}
    trainer = lightning_trainer(pl, device, strategy, tmp_path, **how)
    trainer.fit(ours, lightning_data(STEPS))
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    engine = strategy.engine
    assert engine.device.type == device.type
    assert engine.config.precision == {"bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
    assert engine.get_loss_scale() == scale and engine.skipped_steps == 0
    weights, reference_weights = full_state_dict(ours.gpt), dict(reference.named_parameters())
    assert_trained_alike(ours.losses, expected, {n: weights[n] for n in reference_weights}, reference_weights, initial,
                         device,
                         precision={"bf16-mixed": "bf16", "16-mixed": "fp16"}[precision])
    engine.destroy()


def test_lightning_on_the_gpu_saves_and_resumes_as_it_ran(tmp_path, device, pl):
    """ZeroStrategy with everything on NVMe: one epoch, ``save_checkpoint``, then ``fit(ckpt_path=...)`` to
    the second epoch's end, as the run that went on; the checkpoint converts to a file Lightning loads."""
    from zero.lightning import convert_zero_checkpoint_to_fp32_state_dict

    kw = dict(max_steps=-1)
    whole = gpt_module(pl)
    lightning_trainer(pl, device, nvme_strategy(nvme(tmp_path, "whole")), tmp_path, max_epochs=2, **kw).fit(
        whole, lightning_data(2))
    first = gpt_module(pl)
    t = lightning_trainer(pl, device, nvme_strategy(nvme(tmp_path, "first")), tmp_path, max_epochs=1, **kw)
    t.fit(first, lightning_data(2))
    checkpoint = tmp_path / "epoch0.ckpt"
    t.save_checkpoint(checkpoint)
    resumed = gpt_module(pl)
    strategy = nvme_strategy(nvme(tmp_path, "resumed"))
    t2 = lightning_trainer(pl, device, strategy, tmp_path, max_epochs=2, **kw)
    t2.fit(resumed, lightning_data(2), ckpt_path=str(checkpoint))
    assert t2.global_step == 4 and strategy.engine.device.type == device.type
    tol = tolerance(device, "fp32")
    torch.testing.assert_close(first.losses + resumed.losses, whole.losses, rtol=tol.loss_rtol, atol=0)
    final, got = comparable(full_state_dict(whole.gpt), device), comparable(full_state_dict(resumed.gpt), device)
    for name, value in final.items():
        torch.testing.assert_close(got[name], value, rtol=tol.weight_rtol, atol=tol.weight_atol, msg=name)
    written = convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "model.ckpt")
    assert written["global_step"] == 2
    saved = full_state_dict(first.gpt)
    assert {name.removeprefix("gpt.") for name in written["state_dict"]} == set(saved)
    for name, value in written["state_dict"].items():
        assert torch.equal(value.cpu(), saved[name.removeprefix("gpt.")]), name
