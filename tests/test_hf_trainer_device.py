"""ZeroTrainer and devices: the model stays where it was built until the engine takes it (the
Trainer's ``__init__`` moves a model to ``args.device`` except for DeepSpeed and the like: a model
that needs offload would not fit there), and the engine computes on the TrainingArguments' device
(``use_cpu=True``: the CPU, though CUDA is there and DS_ACCELERATOR asks for it).

No GPU here: the Trainer's moves are seen on the model's ``to``; "CUDA is there" is torch.cuda's
answers replaced, which is all the engine's choice of device reads.
"""
import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'nvmeio[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'nvmeio[hf]'")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero.hf import ZeroTrainer

CONFIG = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                                "stage3_param_persistence_threshold": 0},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto"}


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def dataset(n=8):
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def training_args(out):
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)


def watch_moves(model):
    """Each ``model.to(...)`` call, recorded, then done."""
    moves, to = [], model.to

    def recorded(*args, **kwargs):
        moves.append((args, kwargs))
        return to(*args, **kwargs)

    model.to = recorded
    return moves


def test_the_model_is_not_moved_before_the_engine_takes_it(tmp_path):
    model = tiny_gpt2()
    moves = watch_moves(model)
    trainer = ZeroTrainer(model=model, args=training_args(tmp_path / "out"), train_dataset=dataset(),
                          zero_config=CONFIG)
    assert moves == [] and trainer.place_model_on_device is False  # as the Trainer decides for DeepSpeed
    assert trainer.zero_engine is None
    trainer.train()
    assert moves == [] and trainer.zero_engine is not None  # the engine placed the parameters itself
    trainer.zero_engine.destroy()


def test_use_cpu_computes_on_the_cpu_though_cuda_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # (the Trainer's choice comes first)
    args = training_args(tmp_path / "out")
    assert args.device == torch.device("cpu")
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    trainer = ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), zero_config=CONFIG)
    trainer.train()
    assert trainer.zero_engine.device == torch.device("cpu") and made_current == []
    trainer.zero_engine.destroy()
