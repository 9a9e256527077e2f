"""Batched ZeRO-Inference: Hugging Face ``generate`` at batch B through an engine whose weights live
on NVMe (the docs' inference config: no optimizer, ``max_in_cpu`` 0).

A left-padded batch of prompts of different lengths gives, row for row, the tokens each prompt
gives alone (greedy), and the parameter swapper reads the weights exactly once per forward pass
whatever the batch: batch 32 reads what batch 1 reads.
"""
import pytest
import torch

import zero

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')

VOCAB = 96
NEW_TOKENS = 5
PAD = 0


def build(kind: str, dtype: torch.dtype = torch.float32):
    """A small Llama (grouped-query attention, rotary positions) or GPT-2 (learned positions, tied
    head) from a config: no model hub."""
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=PAD, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config).to(dtype).eval()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


def inference_config(nvme_path, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": False}, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "max_in_cpu": 0, "min_swap_bytes": 0}}}


def on_nvme(kind: str, checkpoint, nvme_path, bf16: bool = False):
    """``from_pretrained`` under zero.Init, then ``zero.initialize``: (model, engine)."""
    config = inference_config(nvme_path, bf16)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    with zero.Init(config_dict_or_path=config):
        model = cls.from_pretrained(checkpoint)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    engine.eval()
    return model, engine


def prompts(batch: int, seed: int):
    """``batch`` prompts of 3 to 11 tokens, and the batch left-padded: (rows, ids, attention mask)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (3 + (i * 5) % 9,), generator=g) for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return rows, ids, mask


def greedy(model, ids, mask=None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    return out[:, ids.shape[1]:]


@pytest.fixture(params=["llama", "gpt2"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    plain = build(request.param)
    plain.save_pretrained(path)
    return request.param, path, plain


def test_left_padded_batch_equals_each_prompt_alone(saved, tmp_path):
    kind, path, plain = saved
    model, engine = on_nvme(kind, path, tmp_path)
    try:
        rows, ids, mask = prompts(8, seed=1)
        batched = greedy(model, ids, mask)
        assert batched.shape == (8, NEW_TOKENS)
        for i, row in enumerate(rows):
            alone = greedy(model, row[None])[0]
            assert torch.equal(batched[i], alone), f"row {i} ({len(row)} prompt tokens)"
            assert torch.equal(alone, greedy(plain, row[None])[0])  # and the plain model's tokens
        assert len({tuple(r.tolist()) for r in batched}) > 1  # the rows are not all the same
        assert torch.equal(greedy(engine, ids, mask), batched)  # engine.generate: the model's, as DeepSpeed's engine
    finally:
        engine.destroy()


def test_engine_passes_the_models_attributes_through(tmp_path):
    plain = build("gpt2")
    plain.save_pretrained(tmp_path / "ckpt")
    model, engine = on_nvme("gpt2", tmp_path / "ckpt", tmp_path)
    try:
        assert engine.generate.__self__ is model
        assert engine.module is model and engine.config is not model.config  # the engine's own come first
        with pytest.raises(AttributeError, match="'ZeroEngine' object has no attribute 'no_such_thing'"):
            getattr(engine, "no_such_thing")
    finally:
        engine.destroy()


def test_bf16_batch_gives_the_plain_bf16_models_tokens(tmp_path):
    """In bf16 a batch's rows may round differently from each prompt alone (plain torch's too):
    the engine's batched tokens are the plain bf16 model's batched tokens."""
    plain = build("llama")
    plain.save_pretrained(tmp_path / "ckpt")
    model, engine = on_nvme("llama", tmp_path / "ckpt", tmp_path, bf16=True)
    try:
        _, ids, mask = prompts(32, seed=2)
        assert torch.equal(greedy(model, ids, mask), greedy(plain.to(torch.bfloat16), ids, mask))
    finally:
        engine.destroy()


def test_each_forward_reads_the_weights_once_whatever_the_batch(saved, tmp_path):
    kind, path, _ = saved
    model, engine = on_nvme(kind, path, tmp_path)
    io = engine.parts.param_store.swapper.io_bytes
    weights = sum(p.ds_numel for p in model.parameters()) * 4
    starts = []
    model.register_forward_pre_hook(lambda module, args: starts.append(io.read))
    try:
        greedy(model, prompts(1, seed=0)[1])  # records the fetch trace
        per_batch = {}
        for batch in (1, 8, 32):
            _, ids, mask = prompts(batch, seed=batch)
            starts.clear()
            greedy(model, ids, mask)
            ends = starts[1:] + [io.read]
            per_batch[batch] = [end - start for start, end in zip(starts, ends)]
        # One forward per new token, each reading every weight once (the read-ahead of the next
        # forward's first units is counted in the forward that reads it).
        assert per_batch == {b: [weights] * NEW_TOKENS for b in (1, 8, 32)}
    finally:
        engine.destroy()
