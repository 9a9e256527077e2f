"""ZeRO-Inference on CUDA (issue 30): a Hugging Face model loaded with ``from_pretrained`` into
partitions on NVMe, served by ``generate`` on the GPU, gives the plain model's tokens on the same
GPU, and each forward reads the weights once.

On a GPU the engine computes on the device while its weights are read into host pool buffers:
nothing can be lent to the forward as on the CPU (tests/test_batched_inference.py); each unit
crosses on the copy stream and its buffer goes back once its copy is done. Marked ``cuda``: it
skips without a GPU, and ``pytest --cuda-suite-on-cpu`` runs it with the CPU as its device.

How they compare: the tokens of greedy decoding must be equal (a flipped argmax is a wrong
weight, not rounding, at these logits' margins: asserted), the logits of one forward within
tests/test_cuda_engine.py's fp32 tolerance on CUDA and equal on the CPU.
"""
import pytest
import torch

import zero
from test_batched_inference import NEW_TOKENS, build, greedy, inference_config, prompts

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_algorithms")]
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.fixture
def device(cuda_suite_device):
    return cuda_suite_device


def served(kind, checkpoint, nvme_path, device, bf16=False):
    """``from_pretrained`` under zero.Init, then ``zero.initialize`` computing on ``device``."""
    config = dict(inference_config(nvme_path, bf16), compute_device=device.type)
    cls = getattr(transformers, CLASSES[kind])
    with zero.Init(config_dict_or_path=config):
        model = cls.from_pretrained(checkpoint)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    engine.eval()
    return model, engine


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_on_the_gpu_with_weights_on_nvme_gives_the_plain_models_tokens(tmp_path, device, kind):
    plain = build(kind)
    plain.save_pretrained(tmp_path / "ckpt")
    plain = plain.to(device)
    model, engine = served(kind, tmp_path / "ckpt", tmp_path, device)
    try:
        assert engine.device.type == device.type
        io = engine.parts.param_store.swapper.io_bytes
        weights = sum(p.ds_numel for p in model.parameters()) * 4
        _, ids, mask = prompts(8, seed=1)
        ids, mask = ids.to(device), mask.to(device)
        expected = greedy(plain, ids, mask)
        assert torch.equal(greedy(model, ids, mask), expected)  # also records the fetch trace
        read = io.read
        got = greedy(engine, ids, mask)  # engine.generate: the model's, as DeepSpeed's engine
        assert got.device.type == device.type and torch.equal(got, expected)
        assert io.read - read == weights * NEW_TOKENS  # each forward reads every weight once
        with torch.no_grad():
            want, have = plain(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        tol = dict(rtol=0, atol=0) if device.type == "cpu" else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(have, want, **tol)
        top2 = want[:, -1].float().topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # the greedy choices are not near-ties
    finally:
        engine.destroy()


def test_bf16_on_the_gpu_gives_the_plain_bf16_models_tokens(tmp_path, device):
    plain = build("llama")
    plain.save_pretrained(tmp_path / "ckpt")
    plain = plain.to(device, torch.bfloat16)
    model, engine = served("llama", tmp_path / "ckpt", tmp_path, device, bf16=True)
    try:
        _, ids, mask = prompts(16, seed=2)
        ids, mask = ids.to(device), mask.to(device)
        assert torch.equal(greedy(model, ids, mask), greedy(plain, ids, mask))
    finally:
        engine.destroy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_int8_weights_on_nvme_cross_to_the_gpu_and_compute_as_the_dequantized_model(tmp_path, device, precision):
    """ZeRO-Inference with ``zero_quantized_nontrainable_weights``: each unit's int8 codes and scales cross
    to the GPU and are dequantized there, giving the weights the host's dequantization gives."""
    from helpers import dequantized_base
    from zero.examples import GPT, GPTConfig, make_batches

    cfg = GPTConfig(vocab=64, d_model=64, heads=4, layers=2, seq=16)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"},
              "compute_device": device.type,
              "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0,
                                                      "min_swap_bytes": 0}}}
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(cfg), config=config)
    try:
        assert engine.device.type == device.type and len(engine.frozen_shards.units) == len(engine.parts.units)
        torch.manual_seed(0)
        reference = dequantized_base(GPT(cfg).requires_grad_(False))
        reference = reference.to(device, torch.bfloat16 if precision == "bf16" else torch.float32)
        x = make_batches(cfg, 1, 2)[0][0].to(device)
        tol = dict(rtol=0, atol=0) if device.type == "cpu" else (
            dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=2 ** -7, atol=1e-2))
        with torch.no_grad():
            for _ in range(2):  # the first forward records the trace, the second reads ahead along it
                torch.testing.assert_close(engine(x), reference(x), **tol)
    finally:
        engine.destroy()
