"""The CUDA suite: a training step of the engine computing on CUDA equals plain PyTorch on the same
GPU, for a covering set of stages, offloads, precisions and drivers (issue 30's goal), and the
paths that hand the engine CUDA tensors (zero.initialize of a model already on the GPU,
GatheredParameters(modifier_rank=0) in training, zero.load_pretrained into a built engine) keep
their swap checksums and train on exactly.

Every test is marked ``cuda`` (bench/gpu_check.py's tests stage runs them on a GPU machine) and
skips without a GPU. ``pytest --cuda-suite-on-cpu tests/test_cuda_engine.py`` runs the same tests
with the CPU as their device: a dry check of the references, where they must match bit for bit.

How they compare: the engine computes where the config's ``compute_device`` says (the suite pins
the CPU otherwise, tests/conftest.py); the reference is plain PyTorch on the same device, from
the same initial weights (built on the CPU after ``torch.manual_seed``) and micro-batches:
zero/examples.py's ``train_reference`` (fused AdamW) for fp32, ``train_reference_mixed`` (a
16-bit compute copy, an fp32 master stepped by fused AdamW, gradients widened and summed in
fp32, clipping and the loss scale in one coefficient) for bf16 and fp16, the recipe the CPU
suite matches bit for bit (tests/test_zero_ladder.py, tests/test_zero_equivalence.py). Plain
torch's own bf16 training keeps no fp32 master, so it is not a reference for the engine's. Both
sides run under ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a
deterministic kernel warns, naming itself, rather than failing the comparison for it) with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts (tests/conftest.py).

[Note: the tolerances on CUDA]
On the CPU every comparison is exact. On CUDA the engine runs the same kernels on the same
values, except where it cannot: (1) an optimizer offloaded to the host (``cpu``/``nvme``) steps
with the CPU's fused AdamW while the reference steps with CUDA's, whose arithmetic (fused
multiply-adds, the bias correction in fp32) may round the last bit differently, and a clipping
norm summed on the host is summed in another order than on the GPU; (2) parameters gathered
into flat buffers could sit at other alignments than the reference's own tensors, and cuBLAS
choose another kernel (another summation order) for them (this model's offsets are multiples
of 32 elements, so it should not). Each is a few fp32 ulps per element per step, about 1e-9
absolute after 3 steps of lr 1e-2, far below a wrong step (a stale or missing update is about
lr = 1e-2 on every element). So fp32: losses rtol 1e-5; weights rtol 1e-5, atol 1e-6. In bf16
and fp16 a master that differs at all may round to the neighbouring 16-bit value (one ulp of
that weight), which changes the next gradients slightly, and Adam's normalised step magnifies a
relative gradient difference where the moments nearly cancel: weights rtol 2 16-bit ulps (bf16
2**-6, fp16 2**-9) plus atol lr / 10; losses (fp32 of a 16-bit forward) rtol 2e-3 (bf16), 1e-3
(fp16). Each test also checks that the reference's steps moved the median weight by more than
lr / 2, 5 times the widest atol: the comparison is not vacuous.

[Note: the optimizer steps where the engine's does]
The first GPU run of this suite (an H200, 2026-11-27) found the engine's weights off by up to
2e-4 (lr 1e-2) against a reference that stepped AdamW on the GPU, wherever the engine's
optimizer was offloaded, always in a third of ``qkv.bias``: the keys' bias, whose gradient is
zero but for rounding (softmax ignores a shift shared by all keys). The host's fused AdamW and
the GPU's round a last bit differently, the next forward differs by that bit, the residue that
is the keys' bias gradient changes wholly, and Adam's normalised step turns it into a step of up
to lr * |g| / (|g| + eps). So the reference of an offloaded engine steps on the host too
(zero/examples.py ``OffloadedAdamW``, ``train_reference_mixed(optimizer_device=...)``): the same
kernels on the same values as the engine, on either side.

[Note: the covering set]
Not the full cross product: each row adds what the others lack. Stages 0-3; offload_optimizer
none / cpu / nvme at stages 1-3; offload_param none / cpu / nvme at stage 3; fp32, bf16, fp16
with a static and a dynamic loss scale; accumulation through the micro-batch loop and through
``train_batch`` (unit-major window); clipping; the optimizer stepped during backward (stage 3,
nvme optimizer, no clipping, no dynamic scale) in fp32, bf16 and fp16, in the loop and in a
window. Checkpoints round trip at stage 3 (fp32, all on NVMe) and stage 2 (bf16, optimizer on
the host); activation checkpointing (Hugging Face's checkpoint function, which a window on
CUDA binds to each micro-batch) with cpu_checkpointing in a train_batch window, activations
spilled to NVMe and kept in host memory. All of it is single-process: no multi-rank test is
marked cuda.
"""
import copy
from dataclasses import dataclass

import pytest
import torch

import zero
from helpers import (CheckpointedGPT, HFCheckpointedGPT, base_config, ladder_config, make_engine, train_engine,
                     train_windows, weights)
from zero.examples import GPT, GPTConfig, OffloadedAdamW, make_batches, train_reference, train_reference_mixed

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_algorithms")]

CFG = GPTConfig()
STEPS = 3
LR = 1e-2
MICRO = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 256.0  # static, or a dynamic scale's start (initial_scale_power 8): no overflow in 3 steps


@dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    weight_rtol: float
    weight_atol: float


EXACT = Tolerance(0.0, 0.0, 0.0)
ON_CUDA = {"fp32": Tolerance(1e-5, 1e-5, 1e-6),  # see [Note: the tolerances on CUDA]
           "bf16": Tolerance(2e-3, 2.0 ** -6, LR / 10),
           "fp16": Tolerance(1e-3, 2.0 ** -9, LR / 10)}


@pytest.fixture
def device(cuda_suite_device):
    return cuda_suite_device


@pytest.fixture
def loops(monkeypatch):
    """The windows train_batch ran as the micro-batch loop instead of unit-major (a test of the
    window asserts there were none)."""
    from zero.engine.train_batch import TrainBatch

    ran, loop = [], TrainBatch._loop
    monkeypatch.setattr(TrainBatch, "_loop", lambda self, *args: ran.append(len(args[0])) or loop(self, *args))
    return ran


@dataclass(frozen=True)
class Case:
    stage: int
    offload_optimizer: str
    offload_param: str = "none"  # stage 3 only
    precision: str = "fp32"
    k: int = 1  # gradient_accumulation_steps
    window: bool = False  # engine.train_batch (a unit-major window) instead of the micro-batch loop
    clip: float = 0.0
    dynamic: bool = False  # fp16: a dynamic loss scale (else a static one)
    in_backward: bool = False  # the optimizer steps during backward (asserted)

    def __str__(self):
        parts = [f"s{self.stage}", f"p-{self.offload_param}" if self.stage == 3 else "", f"o-{self.offload_optimizer}",
                 self.precision + ("-dynamic" if self.dynamic else "-static" if self.precision == "fp16" else ""),
                 f"k{self.k}", "window" if self.window else "loop", f"clip{self.clip:g}" if self.clip else "",
                 "in-backward" if self.in_backward else ""]
        return "-".join(p for p in parts if p)


CASES = [
    Case(0, "none"),
    Case(1, "cpu", k=2, clip=1.0),
    Case(1, "none", precision="fp16", k=2, dynamic=True),
    Case(2, "nvme", k=2, window=True),
    Case(2, "none", precision="bf16", clip=1.0),
    Case(0, "none", precision="bf16", k=2, window=True),
    Case(3, "none", "none", k=2, window=True, clip=1.0),
    Case(3, "cpu", "cpu", clip=1.0),
    Case(3, "none", "cpu", precision="bf16", k=2),  # each step writes the shards from the device into host memory
    Case(3, "nvme", "nvme", in_backward=True),
    Case(3, "nvme", "nvme", k=2, window=True, in_backward=True),
    Case(3, "nvme", "cpu", precision="bf16", k=2, window=True, in_backward=True),
    Case(3, "cpu", "nvme", precision="fp16", clip=1.0),
    Case(3, "nvme", "none", precision="fp16", in_backward=True),
]


def case_config(case: Case, nvme_path, device: torch.device) -> dict:
    if case.stage < 3:
        config = ladder_config(case.stage, case.offload_optimizer, nvme_path, case.k, case.clip, lr=LR,
                               precision=case.precision)
    else:
        config = base_config(case.offload_param, case.offload_optimizer, nvme_path, accumulation=case.k,
                             clip=case.clip, lr=LR, sub_group_size=3000, precision=case.precision)
    if case.precision == "fp16" and not case.dynamic:
        config["fp16"] = {"enabled": True, "loss_scale": FP16_SCALE}
    config["compute_device"] = device.type  # the suite pins the CPU otherwise (tests/conftest.py)
    if case.offload_param == "cpu":  # as the Hugging Face guide's configs: host shards read ahead onto the GPU
        config["zero_optimization"]["offload_param"]["pin_memory"] = True
    return config


def nvme_config(nvme_path, device: torch.device) -> dict:
    """fp32, parameters and optimizer on NVMe, checksums at their default (on with xxhash)."""
    return case_config(Case(3, "nvme", "nvme"), nvme_path, device)


def on(device, batches):
    return [(x.to(device), y.to(device)) for x, y in batches]


def reference_optimizer(model, offloaded: bool, clip: float = 0.0):
    """The fp32 reference's optimizer: AdamW where the model is, or where an offloaded engine steps
    (the host: [Note: the optimizer steps where the engine's does]); None for train_reference's own."""
    return OffloadedAdamW(model.parameters(), "cpu", lr=LR, clip=clip) if offloaded else None


def plain_torch(batches, device, precision="fp32", k=1, clip=0.0, model=lambda: GPT(CFG), seed=0,
                offloaded=False):
    """Plain PyTorch on ``device`` from the engine's initial weights: (losses, its parameters by
    name, the initial ones). ``offloaded``: the engine's optimizer runs on the host, and so does
    the reference's."""
    torch.manual_seed(seed)
    reference = model().to(device)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    if precision == "fp32":
        opt = reference_optimizer(reference, offloaded, clip)
        losses = train_reference(reference, on(device, batches), len(batches) // k, k, lr=LR,
                                 clip=0.0 if opt else clip, optimizer=opt)
    else:
        losses = train_reference_mixed(reference, on(device, batches), len(batches) // k, DTYPES[precision], lr=LR,
                                       clip=clip, loss_scale=FP16_SCALE if precision == "fp16" else 1.0,
                                       accumulation=k, optimizer_device="cpu" if offloaded else None)
    return losses, dict(reference.named_parameters()), initial


def tolerance(device, precision) -> Tolerance:
    return EXACT if device.type == "cpu" else ON_CUDA[precision]


def assert_close_weights(final, reference, tol: Tolerance):
    assert final.keys() == reference.keys()
    for name, p in reference.items():
        assert final[name].dtype == p.dtype, name
        torch.testing.assert_close(final[name].cpu(), p.detach().cpu(), rtol=tol.weight_rtol, atol=tol.weight_atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def assert_matches(losses, reference_run, final, device, precision="fp32", moved_at_least=LR / 2,
                   leave_out=lambda weights: weights):
    """The engine's losses and final weights against plain torch's, within the stated tolerance;
    ``leave_out`` maps each dict of weights to the part compared (tests/test_cuda_frameworks.py)."""
    expected, reference, initial = reference_run
    tol = tolerance(device, precision)
    assert len(losses) == len(expected) > 0
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=tol.loss_rtol, atol=0)
    final, reference, initial = leave_out(final), leave_out(reference), leave_out(initial)
    # the steps moved the weights far past the tolerance: the comparison is not vacuous
    moved = torch.cat([(p.detach().float() - initial[n].float()).abs().flatten() for n, p in reference.items()])
    assert moved.median() > moved_at_least
    assert_close_weights(final, reference, tol)


# -- a training run equals plain torch ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_training_equals_plain_torch_on_the_same_device(tmp_path, device, loops, case):
    batches = make_batches(CFG, STEPS * case.k, MICRO)
    engine = make_engine(tmp_path, config=case_config(case, tmp_path, device))
    try:
        assert engine.device.type == device.type and engine.zero_optimization_stage() == case.stage
        if case.in_backward:
            assert engine.optimizer.why_not_step_in_backward() is None
        losses = (train_windows if case.window else train_engine)(engine, batches, STEPS, case.k)
        assert loops == []  # a window ran unit-major
        final = weights(engine.module)
        if case.precision == "fp16":
            assert engine.skipped_steps == 0 and engine.get_loss_scale() == FP16_SCALE
    finally:
        engine.destroy()
    reference = plain_torch(batches, device, case.precision, case.k, case.clip,
                            offloaded=case.offload_optimizer != "none")
    assert_matches(losses, reference, final, device, case.precision)


# -- the paths that hand the engine CUDA tensors (issue 30, item 3) ----------------------------------------

def test_initialize_of_a_model_already_on_the_device_trains_as_plain_torch(tmp_path, device):
    batches = make_batches(CFG, STEPS, MICRO)
    engine = make_engine(tmp_path, config=nvme_config(tmp_path, device), model=lambda: GPT(CFG).to(device))
    try:
        store = engine.parts.param_store
        assert store.master is not None and store.swapper._checksums is not None  # homed shards, checksums on
        losses = train_engine(engine, batches, STEPS)
        final = weights(engine.module)
    finally:
        engine.destroy()
    assert_matches(losses, plain_torch(batches, device, offloaded=True), final, device)


def test_gathered_parameters_modified_on_rank_0_in_training(tmp_path, device):
    batches = make_batches(CFG, STEPS, MICRO)
    torch.manual_seed(0)
    reference = GPT(CFG).to(device)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opt = reference_optimizer(reference, offloaded=True)  # nvme_config: the optimizer on NVMe, stepped on the host
    engine = make_engine(tmp_path, config=nvme_config(tmp_path, device))
    model = engine.module
    try:
        losses = train_engine(engine, batches[:1], 1)
        with zero.GatheredParameters([model.head.weight], modifier_rank=0):
            assert model.head.weight.device.type == device.type
            model.head.weight.data.mul_(0.5)
        losses += train_engine(engine, batches[1:], STEPS - 1)
        final = weights(model)
    finally:
        engine.destroy()
    expected = train_reference(reference, on(device, batches[:1]), 1, optimizer=opt)
    with torch.no_grad():
        reference.head.weight.mul_(0.5)
    opt.reload()  # as the engine's master takes the modified weight
    expected += train_reference(reference, on(device, batches[1:]), STEPS - 1, optimizer=opt)
    assert_matches(losses, (expected, dict(reference.named_parameters()), initial), final, device)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_quantized_frozen_weights_cross_on_the_copy_stream_and_train_as_the_dequantized_base(
        tmp_path, device, precision):
    """zero_quantized_nontrainable_weights on the device: each frozen unit's int8 bytes go to the
    device on the copy stream (zero/runtime/host_to_device.py ``copy_then_reuse``, waiting for that copy
    alone), are dequantized there, and the LoRA run equals the unflagged engine's on the dequantized
    base, bit for bit (the same kernels on the same values)."""
    from zero.examples import add_lora
    from zero.runtime import host_to_device
    from helpers import dequantized_base

    def lora():
        return add_lora(GPT(CFG), rank=2)

    batches = make_batches(CFG, STEPS, MICRO)
    runs = []
    for flag, model in ((True, lora), (False, lambda: dequantized_base(lora()))):
        config = base_config("nvme", "cpu", tmp_path / str(flag), precision=precision, micro=MICRO, lr=LR)
        config["compute_device"] = device.type
        config["zero_optimization"]["zero_quantized_nontrainable_weights"] = flag
        engine = make_engine(tmp_path / str(flag), model=model, config=config)
        copies = []
        if flag:
            frozen = engine.frozen_shards
            assert frozen and (frozen.to_device is host_to_device.copy_then_reuse) == (device.type == "cuda")
            real = frozen.to_device
            frozen.to_device = lambda packed, dev: (copies.append(packed.numel()), real(packed, dev))[1]
        try:
            runs.append((train_engine(engine, batches, STEPS), weights(engine.module), copies))
        finally:
            engine.destroy()
    (flagged, flagged_weights, copies), (plain, plain_weights, _) = runs
    assert flagged == plain
    for name, value in plain_weights.items():
        assert torch.equal(flagged_weights[name], value), name
    assert (len(copies) > 0) == (device.type == "cuda")  # on the CPU the packed bytes are dequantized in place


def test_a_lora_window_releases_each_frozen_unit_after_its_last_backward_and_equals_plain_torch(
        tmp_path, device, loops, monkeypatch):
    """A train_batch window on the device (one backward call over the k losses on CUDA) releases a
    frozen unit once the k-th micro-batch's backward is done with its module (zero/runtime/hooks.py
    [Note: frozen units in backward]): at the end of each backward only the embedding's is left."""
    from zero.examples import add_lora
    from helpers import frozen_gathered_at_end_of_backward

    def lora():
        model = add_lora(GPT(CFG), rank=2)
        with torch.no_grad():  # B starts at zero: make the adapters matter from the first step
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.1)
        return model

    k = 2
    batches = make_batches(CFG, STEPS * k, MICRO)
    config = case_config(Case(3, "cpu", "nvme", k=k, window=True), tmp_path, device)
    engine = make_engine(tmp_path, model=lora, config=config)
    try:
        frozen = [u for u in engine.parts.units if u.index in engine.rank_layout.frozen and not u.persistent]
        at_end = frozen_gathered_at_end_of_backward(monkeypatch)
        losses = [loss for i in range(STEPS)
                  for loss in engine.train_batch_losses(on(device, batches[i * k:(i + 1) * k]))]
        final = {n: p.detach().clone() for n, p in weights(engine.module).items()}
    finally:
        engine.destroy()
    assert loops == [] and len(frozen) > 8 and at_end == [1] * STEPS
    expected, reference, initial = plain_torch(batches, device, k=k, model=lora, offloaded=True)
    tol = tolerance(device, "fp32")
    torch.testing.assert_close(torch.tensor([float(l) for l in losses], dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=tol.loss_rtol, atol=0)
    trained = [n for n, p in reference.items() if p.requires_grad]
    moved = torch.cat([(reference[n].detach() - initial[n]).abs().flatten() for n in trained])
    assert moved.median() > LR / 2  # the adapters moved: the comparison is not vacuous
    assert_close_weights(final, reference, tol)


def test_load_pretrained_into_a_built_engine_trains_from_the_loaded_weights(tmp_path, device):
    batches = make_batches(CFG, STEPS, MICRO)
    torch.manual_seed(1)
    pretrained = GPT(CFG)
    zero.save_pretrained(pretrained, tmp_path / "pretrained")
    engine = make_engine(tmp_path / "swap", config=nvme_config(tmp_path / "swap", device))  # seed 0's weights
    try:
        zero.load_pretrained(engine, tmp_path / "pretrained")
        loaded = weights(engine.module)
        assert all(torch.equal(loaded[n].cpu(), p.detach()) for n, p in pretrained.named_parameters())
        losses = train_engine(engine, batches, STEPS)
        final = weights(engine.module)
    finally:
        engine.destroy()
    assert_matches(losses, plain_torch(batches, device, seed=1, offloaded=True), final, device)


# -- checkpoints and activation checkpointing ----------------------------------------------------------

@pytest.mark.parametrize("case", [Case(3, "nvme", "nvme"), Case(2, "cpu", precision="bf16", clip=1.0)], ids=str)
def test_a_checkpoint_round_trip_resumes_the_same_run(tmp_path, device, case):
    batches = make_batches(CFG, STEPS, MICRO)
    engine = make_engine(tmp_path / "a", config=case_config(case, tmp_path / "a", device))
    try:
        train_engine(engine, batches[:2], 2)
        engine.save_checkpoint(tmp_path / "ckpt", tag="two")
        saved = weights(engine.module)
        uninterrupted = train_engine(engine, batches[2:], 1)
        final = weights(engine.module)
    finally:
        engine.destroy()
    resumed = make_engine(tmp_path / "b", config=case_config(case, tmp_path / "b", device), seed=1)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        loaded = weights(resumed.module)
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[n], saved[n]) for n in saved)
        assert resumed.global_steps == 2
        losses = train_engine(resumed, batches[2:], 1)
        after = weights(resumed.module)
    finally:
        resumed.destroy()
    tol = tolerance(device, case.precision)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), rtol=tol.loss_rtol, atol=0)
    assert any(not torch.equal(final[n], saved[n]) for n in saved)  # the third step changed the weights
    assert_close_weights(after, final, tol)


SPILL_SHAPE = GPTConfig(d_model=64, seq=32)  # a micro-batch's hidden state: 8 x 32 x 64 x 4 = 64 KiB, spillable
SPILL_MICRO = 8


@pytest.mark.parametrize("budget", [0, None], ids=["spilled-to-nvme", "kept-in-host-memory"])
def test_activation_checkpointing_with_cpu_checkpointing_equals_plain_torch(tmp_path, device, loops, budget):
    """cpu_checkpointing acts on train_batch's window (zero/config/activation_checkpointing.py); a
    window on CUDA recomputes a forward through Hugging Face's checkpoint function only."""
    k = 2
    batches = make_batches(SPILL_SHAPE, STEPS * k, SPILL_MICRO)
    config = base_config("nvme", "cpu", tmp_path, accumulation=k, micro=SPILL_MICRO, lr=LR, sub_group_size=3000)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    if budget is not None:
        config["activation_checkpointing"]["max_in_cpu_bytes"] = budget
    config["compute_device"] = device.type
    engine = make_engine(tmp_path, config=config, model=lambda: HFCheckpointedGPT(SPILL_SHAPE))
    try:
        losses = train_windows(engine, batches, STEPS, k)
        assert loops == []  # unit-major, its forwards recomputed during one backward on CUDA
        stats = copy.copy(engine.parts.activations.stats)
        final = weights(engine.module)
    finally:
        engine.destroy()
    assert stats.saved_bytes > 0
    if budget == 0:
        assert stats.spilled_bytes == stats.read_bytes == stats.saved_bytes
    else:
        assert stats.spilled_bytes == 0
    reference = plain_torch(batches, device, k=k, model=lambda: CheckpointedGPT(SPILL_SHAPE), offloaded=True)
    assert_matches(losses, reference, final, device)
