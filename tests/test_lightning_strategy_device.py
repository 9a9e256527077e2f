"""ZeroStrategy computes where Lightning's accelerator says: ``accelerator="cpu"`` builds the
engine (and zero.Init's slices) on the CPU though CUDA is there and DS_ACCELERATOR asks for it
(zero/runtime/comm.py, [Note: which device computes]: the framework's choice comes first).

No GPU here: torch.cuda says two devices are there (its answers replaced), which is all the
engine's choice reads; Lightning trains on the CPU it was told to use.
"""
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from torch.utils.data import DataLoader, TensorDataset

from zero.examples import GPT, GPTConfig, make_batches
from zero.lightning import ZeroStrategy

CFG = GPTConfig()


class GPTModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.gpt = None

    def configure_model(self):
        if self.gpt is None:
            torch.manual_seed(0)
            self.gpt = GPT(CFG)
            self.shard_devices = {p._zero_init_shard.read().device for p in self.gpt.parameters()
                                  if getattr(p, "_zero_init_shard", None) is not None}

    def training_step(self, batch, batch_idx):
        return self.gpt(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, fused=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerator_cpu_computes_on_the_cpu_though_cuda_is_there(tmp_path, monkeypatch, stage):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # (Lightning's choice comes first)
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    b = make_batches(CFG, 2, 4)
    data = DataLoader(TensorDataset(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b])), batch_size=4)
    module = GPTModule()
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=1, max_steps=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    engine = trainer.strategy.engine
    assert engine.device == torch.device("cpu") and made_current == []
    assert module.shard_devices == ({torch.device("cpu")} if stage == 3 else set())
    engine.destroy()
