"""What a process pays to build an engine: torch's Optimizer wraps add_param_group in
torch._disable_dynamo, whose first call imports torch._dynamo (2.3 s here, in every rank of every
launch); the engine's optimizer calls it unwrapped (zero/engine/optimizer.py)."""
import sys

import pytest
import torch

import zero
from helpers import base_config, run_process

CHILD = """
import sys, tempfile
import torch, zero
from zero.examples import GPT, GPTConfig
swap = tempfile.mkdtemp()
conf = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
                              "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}
model = GPT(GPTConfig(vocab=64, d_model=16, heads=2, layers=1, seq=8))
engine, *_ = zero.initialize(model=model, config=conf)
x = torch.randint(0, 64, (1, 8))
engine.backward(torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten()))
engine.step()
engine.save_checkpoint(swap + "/ckpt")
engine.load_checkpoint(swap + "/ckpt")
engine.destroy()
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_building_training_and_checkpointing_an_engine_does_not_import_dynamo():
    r = run_process([sys.executable, "-c", CHILD], timeout=120, check=True)
    assert r.stdout.splitlines()[-1] == "dynamo imported: False", r.stdout + r.stderr


def test_the_optimizers_param_groups_are_still_checked_as_torchs_are():
    model = torch.nn.Linear(4, 4)
    engine, optimizer, _, _ = zero.initialize(model=model, config=base_config("none", "none"))
    try:
        with pytest.raises(TypeError, match="ordered collections"):
            optimizer.add_param_group({"params": {torch.nn.Parameter(torch.ones(2))}})
        with pytest.raises(TypeError, match="param_group must be a dict"):
            optimizer.add_param_group([torch.nn.Parameter(torch.ones(2))])
        with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
            optimizer.add_param_group({"params": [torch.ones(2, requires_grad=True) * 2]})
        assert len(optimizer.param_groups) == 1  # nothing refused was added
    finally:
        engine.destroy()
