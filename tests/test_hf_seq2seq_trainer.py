"""zero.hf.ZeroSeq2SeqTrainer: ``predict_with_generate`` on two ranks at stage 3, whose sequences end
at different lengths, does not hang.

A tiny T5 built from its config trains one step, then predicts with generation; on rank 0 every
sequence ends after 2 tokens, on rank 1 after 7 (a logits processor forces the end token). Each
forward is collective at stage 3, so a rank that stopped early would leave the other waiting in a
gather: transformers sees ZeRO-3 while the engine exists and generates with ``synced_gpus``, both
ranks run as many decoder forwards, and each rank's predictions are what the trained weights give
with the plain ``generate``. The ranks run under a timeout (tests/helpers.py run_ranks).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")

from helpers import run_ranks

EOS, PAD = 1, 0
END_AFTER = (2, 7)  # tokens generated on rank 0, rank 1
BATCH = 2


class EndAfter(transformers.LogitsProcessor):
    """The end token after ``n`` generated tokens, never before."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] > self.n:  # the decoder start token, then n tokens
            scores[:] = -float("inf")
            scores[:, EOS] = 0
        else:
            scores[:, EOS] = -float("inf")
        return scores


def tiny_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS)
    return transformers.T5ForConditionalGeneration(config)


def examples(n: int):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(2, 32, (6,), generator=g), "labels": torch.randint(2, 32, (4,), generator=g)}
            for _ in range(n)]


def scenario_predict(rank, world_size, scratch):
    from zero.hf import ZeroSeq2SeqTrainer
    from zero.partitioning.full_state_dict import full_state_dict

    model = tiny_t5()
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=scratch, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, max_steps=1,
        learning_rate=1e-2, predict_with_generate=True, generation_max_length=12, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    trainer = ZeroSeq2SeqTrainer(model=model, args=args, train_dataset=examples(2 * BATCH * world_size),
                                 zero_config=config)
    trainer.train()
    forwards = []
    model.decoder.register_forward_hook(lambda *_: forwards.append(1))
    out = trainer.predict(examples(BATCH * world_size),
                          logits_processor=transformers.LogitsProcessorList([EndAfter(END_AFTER[rank])]))
    mine = out.predictions[rank * BATCH:(rank + 1) * BATCH].tolist()  # the evaluation batches go to the ranks in turn
    plain = tiny_t5()
    plain.load_state_dict(full_state_dict(model))
    inputs = torch.stack([e["input_ids"] for e in examples(BATCH * world_size)[rank * BATCH:(rank + 1) * BATCH]])
    expected = plain.eval().generate(inputs, max_length=12, synced_gpus=False,
                                     logits_processor=transformers.LogitsProcessorList([EndAfter(END_AFTER[rank])]))
    return {"forwards": len(forwards), "predictions": mine, "plain": expected.tolist(),
            "zero3": transformers.integrations.is_deepspeed_zero3_enabled(),
            "stage": trainer.zero_engine.zero_optimization_stage()}


def test_predict_with_generate_on_two_ranks_ending_at_different_lengths(tmp_path):
    results = [r["predict"] for r in run_ranks(2, [("predict", scenario_predict, {})], tmp_path, timeout=300)]
    for rank, result in enumerate(results):
        assert "error" not in result, result["error"]
        assert result["zero3"] and result["stage"] == 3
        for row, plain in zip(result["predictions"], result["plain"]):
            assert row[:len(plain)] == plain and set(row[len(plain):]) <= {PAD}  # padded to the longest
            assert plain[END_AFTER[rank] + 1] == EOS and len(plain) == END_AFTER[rank] + 2
    # rank 0 ended after 2 tokens but kept joining rank 1's forwards until rank 1 ended (synced_gpus)
    assert results[0]["forwards"] == results[1]["forwards"] == END_AFTER[1] + 1 + 1  # + the loss's forward
