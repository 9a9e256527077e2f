"""transformers' ZeRO-3 branches, taken on this engine (zero/partitioning/hf_zero3.py and
zero/partitioning/deepspeed_standin.py).

- ``resize_token_embeddings`` of a model built partitioned gathers the old embeddings through the
  stand-in's ``GatheredParameters`` and gives what it gives on the plain model (mean resizing, tied head);
- a model whose constructor gathers a weight to rewrite it (wav2vec2's weight-normed positional
  convolution, with ``register_external_parameter``) builds in ``zero.Init`` with the plain values and
  computes the plain outputs through the engine;
- the Trainer's parameter count reads ``ds_numel`` of partitioned parameters.
(``generate``'s ``synced_gpus`` on two ranks: test_hf_seq2seq_trainer.py; ``from_config``:
test_hf_from_config.py.)
"""
import pytest
import torch

import zero

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')
from transformers.trainer_pt_utils import get_model_param_count

from zero.hf import HfDeepSpeedConfig

STAGE_3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def gpt2_config():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                   eos_token_id=2)


def wav2vec2_config():
    return transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                       conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                       num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, vocab_size=10)


def gathered(model) -> dict:
    with zero.GatheredParameters(list(model.parameters())):
        return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_resize_token_embeddings_of_a_partitioned_model_gives_the_plain_result():
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(gpt2_config())
    plain.resize_token_embeddings(80)  # mean resizing: draws the new rows from the old ones' distribution
    expected = plain.state_dict()

    dschf = HfDeepSpeedConfig(STAGE_3)  # noqa: F841 - alive while the model is built and resized
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config())
    assert model.transformer.wte.weight.numel() == 0  # partitioned: transformers must gather it to resize
    model.resize_token_embeddings(80)  # (its ZeRO-3 branch also resizes the head before tying it again: more draws)
    assert model.config.vocab_size == 80 and model.lm_head.weight is model.transformer.wte.weight
    got = gathered(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_constructor_that_gathers_a_weight_builds_the_plain_model_and_outputs():
    torch.manual_seed(0)
    plain = transformers.Wav2Vec2Model(wav2vec2_config()).eval()
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=STAGE_3):
        model = transformers.Wav2Vec2Model(wav2vec2_config())
    conv = model.encoder.pos_conv_embed.conv
    assert conv.parametrizations.weight.original0.numel() == 0  # weight-normed inside the gather, then partitioned
    got = gathered(model)
    for name, value in plain.state_dict().items():
        assert torch.equal(got[name], value), name
    engine, _, _, _ = zero.initialize(model=model, config=STAGE_3)
    engine.eval()
    audio = torch.randn(1, 400, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(engine(audio).last_hidden_state, plain(audio).last_hidden_state)
    engine.destroy()


def test_the_trainers_parameter_count_reads_the_partitioned_sizes():
    torch.manual_seed(0)
    count = get_model_param_count(transformers.GPT2LMHeadModel(gpt2_config()), trainable_only=True)
    dschf = HfDeepSpeedConfig(STAGE_3)  # noqa: F841 - alive while the model is built and counted
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config())
    assert all(p.numel() == 0 for p in model.parameters())
    assert get_model_param_count(model, trainable_only=True) == count
