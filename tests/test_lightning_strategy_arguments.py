"""The DeepSpeedStrategy arguments ZeroStrategy refused before, each with its effect, and arguments without
effect warned about by name.

cpu_checkpointing keeps a train_batch window's saved activations in host memory (results unchanged) and
warns where no window runs; partition_activations and DeepSpeed's other activation keys reach the config,
which says they have no effect here; save_full_weights writes one Lightning file with the gathered weights
(exclude_frozen_parameters leaves the frozen ones out of it, and out of a checkpoint directory, which then
loads only where the module's strict_loading allows); load_full_weights
loads such a file (or any Lightning checkpoint of the module) into the partitions, on one rank and on two,
strictly unless the module says otherwise; arguments beside config= are said to be replaced by it.
"""
import json
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install 'nvmeio[lightning]'")

from torch.utils.data import DataLoader, TensorDataset

from zero.config import IgnoredSettingWarning, load_config
from zero.examples import GPT, GPTConfig, make_batches
from zero.lightning import ZeroStrategy
from zero.integrations.lightning_strategy import CHECKPOINT_TAG
from zero.partitioning.full_state_dict import full_state_dict
from zero.runtime.activation_spill import MIN_SPILL_BYTES
from helpers import run_ranks
from test_lightning_strategy import GPTModule, assert_same_weights, loader, nvme_strategy, trainer


# -- activation checkpointing -----------------------------------------------------------------------------------

SHAPE = GPTConfig(d_model=64, seq=32)  # a micro-batch's hidden state, 8 x 32 x 64 x 4 bytes: 64 KiB, which the
MICRO = 8                              # store takes (smaller tensors stay where autograd keeps them)
assert MICRO * SHAPE.seq * SHAPE.d_model * 4 >= MIN_SPILL_BYTES


class WideGPTModule(GPTModule):
    def __init__(self):
        super().__init__(build_in_configure_model=True)
        torch.manual_seed(0)
        self.gpt = GPT(SHAPE)


def wide_loader(batches):
    b = make_batches(SHAPE, batches, MICRO)
    return DataLoader(TensorDataset(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b])), batch_size=MICRO)


def test_cpu_checkpointing_keeps_a_windows_activations_in_host_memory_with_the_same_results(tmp_path):
    plain = WideGPTModule()
    trainer("auto", tmp_path, accumulate_grad_batches=2).fit(plain, wide_loader(6))
    ours = WideGPTModule()
    strategy = nvme_strategy(tmp_path, cpu_checkpointing=True, use_train_batch=True)
    assert strategy.config["activation_checkpointing"] == {"cpu_checkpointing": True}
    trainer(strategy, tmp_path, accumulate_grad_batches=2).fit(ours, wide_loader(6))
    stats = strategy.engine.parts.activations.stats
    assert stats.saved_bytes >= 3 * 2 * MIN_SPILL_BYTES and stats.spilled_bytes == 0  # 3 windows of 2
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same_weights(plain.state_dict(), full_state_dict(ours))


@pytest.mark.parametrize("use_train_batch, k", [(False, 2), (True, 1)])
def test_cpu_checkpointing_without_train_batch_windows_warns(tmp_path, use_train_batch, k):
    strategy = ZeroStrategy(stage=3, cpu_checkpointing=True, use_train_batch=use_train_batch)
    with pytest.warns(IgnoredSettingWarning) as caught:
        trainer(strategy, tmp_path, accumulate_grad_batches=k, max_steps=1).fit(GPTModule(), loader(2))
    assert strategy.engine.config.activation_checkpointing.cpu_checkpointing
    assert [str(w.message) for w in caught if "cpu_checkpointing" in str(w.message)] == [
        "activation_checkpointing.cpu_checkpointing has no effect here: it keeps the tensors an accumulation "
        "window saves for backward in host memory (past its budget on NVMe) when windows run through "
        "engine.train_batch, which takes ZeroStrategy(use_train_batch=True) and accumulate_grad_batches > 1 "
        f"(this fit: use_train_batch={use_train_batch}, accumulate_grad_batches={k})"]


@pytest.mark.parametrize("name", ["partition_activations", "contiguous_memory_optimization",
                                  "synchronize_checkpoint_boundary"])
def test_deepspeeds_model_parallel_activation_keys_reach_the_config_which_says_they_do_nothing(name):
    config = ZeroStrategy(stage=3, **{name: True}).config
    assert config["activation_checkpointing"] == {name: True}
    with pytest.warns(IgnoredSettingWarning) as caught:
        load_config(config)  # what zero.initialize reads in setup
    assert [str(w.message) for w in caught] == [
        f"activation_checkpointing.{name} = True is accepted for DeepSpeed compatibility but has no effect in nvmeio"]


def test_arguments_beside_a_config_are_said_to_be_replaced():
    with pytest.warns(IgnoredSettingWarning) as caught:
        strategy = ZeroStrategy(config={"zero_optimization": {"stage": 3}}, stage=2, offload_optimizer=True,
                                loss_scale_window=100, remote_device="cpu")
    assert [str(w.message) for w in caught] == [
        "ZeroStrategy(stage=2, offload_optimizer=True) has no effect beside config=: the config replaces the "
        "arguments that build one (as in DeepSpeedStrategy); set them in the config"]
    assert strategy.config == {"zero_optimization": {"stage": 3}}


# -- single files: save_full_weights, exclude_frozen_parameters, load_full_weights ------------------------------

def fit_one_epoch(tmp_path, strategy, module=None, **kw):
    module = module or GPTModule()
    t = trainer(strategy, tmp_path, max_steps=-1, max_epochs=1, **kw)
    t.fit(module, loader(2))
    return module, t


def test_save_full_weights_writes_one_lightning_file(tmp_path):
    module, t = fit_one_epoch(tmp_path, ZeroStrategy(stage=3, save_full_weights=True))
    path = tmp_path / "full.ckpt"
    t.save_checkpoint(path)
    assert os.path.isfile(path)
    saved = torch.load(path, weights_only=True)
    assert "optimizer_states" not in saved and saved["global_step"] == 2 and saved["hyper_parameters"]["lr"] == 1e-3
    assert_same_weights(full_state_dict(module), saved["state_dict"], exact=True)
    assert_same_weights(full_state_dict(module), GPTModule.load_from_checkpoint(path).state_dict(), exact=True)


class FrozenNorm(GPTModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.gpt.ln_f.requires_grad_(False)


def test_exclude_frozen_parameters_leaves_them_out_of_the_file(tmp_path):
    module, t = fit_one_epoch(tmp_path, ZeroStrategy(stage=3, save_full_weights=True, exclude_frozen_parameters=True),
                              FrozenNorm())
    t.save_checkpoint(tmp_path / "trainable.ckpt")
    saved = torch.load(tmp_path / "trainable.ckpt", weights_only=True)["state_dict"]
    everything = full_state_dict(module)
    assert set(everything) - set(saved) == {"gpt.ln_f.weight", "gpt.ln_f.bias"}
    assert_same_weights({k: v for k, v in everything.items() if k in saved}, saved, exact=True)
    # a file without them loads where the module allows it (as with DeepSpeedStrategy)
    loader_module = FrozenNorm()
    loader_module.strict_loading = False
    t2 = trainer(ZeroStrategy(stage=3, load_full_weights=True), tmp_path, max_steps=-1, max_epochs=1)
    t2.validate(loader_module, loader(2), ckpt_path=str(tmp_path / "trainable.ckpt"), verbose=False)
    assert_same_weights(everything, full_state_dict(loader_module), exact=True)  # ln_f: the same initial values


def test_exclude_frozen_parameters_leaves_them_out_of_a_checkpoint_directory_too(tmp_path):
    module, t = fit_one_epoch(tmp_path, ZeroStrategy(stage=3, exclude_frozen_parameters=True), FrozenNorm())
    t.save_checkpoint(tmp_path / "ckpt")
    meta = json.load(open(tmp_path / "ckpt" / CHECKPOINT_TAG / "zero_meta.json"))
    left_out = [p["names"][0] for i in meta["excluded_units"] for p in meta["units"][i]["params"]]
    assert sorted(left_out) == ["gpt.ln_f.bias", "gpt.ln_f.weight"]
    everything = full_state_dict(module)
    with pytest.raises(ValueError, match=r"holds no values for 2 frozen parameter\(s\) \(gpt.ln_f.weight, "
                                         r"gpt.ln_f.bias\); load it with load_module_strict=False"):
        trainer(ZeroStrategy(stage=3), tmp_path, max_steps=-1, max_epochs=1).validate(
            FrozenNorm(), loader(2), ckpt_path=str(tmp_path / "ckpt"), verbose=False)
    lenient = FrozenNorm()
    lenient.strict_loading = False
    with torch.no_grad():  # the trained weights come from the checkpoint, ln_f stays the module's
        lenient.gpt.wte.weight.add_(1.0)
    trainer(ZeroStrategy(stage=3), tmp_path, max_steps=-1, max_epochs=1).validate(
        lenient, loader(2), ckpt_path=str(tmp_path / "ckpt"), verbose=False)
    assert_same_weights(everything, full_state_dict(lenient), exact=True)  # ln_f: the same initial values


class Loaded(pl.Callback):
    def on_train_start(self, trainer, module):
        self.weights = full_state_dict(module)


def test_load_full_weights_resumes_from_a_lightning_file_without_optimizer_states(tmp_path):
    plain, t = fit_one_epoch(tmp_path, "auto")
    t.save_checkpoint(tmp_path / "plain.ckpt")
    torch.manual_seed(1)
    other = GPTModule(build_in_configure_model=True)  # built under zero.Init, from other values
    seen = Loaded()
    t2 = trainer(ZeroStrategy(stage=3, load_full_weights=True), tmp_path, max_steps=-1, max_epochs=2,
                 callbacks=[seen])
    with pytest.warns(UserWarning, match=r"ZeroStrategy\(load_full_weights=True\) loads the weights of a single "
                                         r"file, which holds no optimizer states: Adam's moments start again "
                                         r"\(resume from the checkpoint directory to restore them\)"):
        t2.fit(other, loader(2), ckpt_path=str(tmp_path / "plain.ckpt"))
    assert_same_weights(plain.state_dict(), seen.weights, exact=True)
    assert t2.global_step == 4 and len(other.losses) == 2  # the loops went on from the file's


def test_a_file_that_does_not_match_is_refused_and_a_file_needs_load_full_weights(tmp_path):
    plain, t = fit_one_epoch(tmp_path, "auto")
    t.save_checkpoint(tmp_path / "plain.ckpt")
    state = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    del state["state_dict"]["gpt.pos"]
    torch.save(state, tmp_path / "partial.ckpt")
    t2 = trainer(ZeroStrategy(stage=3, load_full_weights=True), tmp_path)
    with pytest.raises(RuntimeError, match=r"loading the full weights into GPTModule: missing keys: \['gpt.pos'\], "
                                           r"unexpected keys: \[\] \(LightningModule.strict_loading = False loads "
                                           r"what matches\)"):
        t2.validate(GPTModule(), loader(2), ckpt_path=str(tmp_path / "partial.ckpt"), verbose=False)
    torch.save({"epoch": 0}, tmp_path / "no_weights.ckpt")
    with pytest.raises(KeyError, match=r"no_weights.ckpt holds no 'state_dict': load_full_weights=True reads a "
                                       r"Lightning checkpoint file \(or one convert_zero_checkpoint_to_fp32_state_dict "
                                       r"wrote\)"):
        t2.validate(GPTModule(), loader(2), ckpt_path=str(tmp_path / "no_weights.ckpt"), verbose=False)
    with pytest.raises(FileNotFoundError, match=r"plain.ckpt is not a ZeroStrategy checkpoint directory \(it holds "
                                                r"'latest' and 'checkpoint/'\); a single-file checkpoint loads with "
                                                r"ZeroStrategy\(load_full_weights=True\) or "
                                                r"LightningModule.load_from_checkpoint"):
        trainer(ZeroStrategy(stage=3), tmp_path).validate(GPTModule(), loader(2),
                                                          ckpt_path=str(tmp_path / "plain.ckpt"), verbose=False)


def scenario_full_weights_round_trip(rank, world_size, scratch):
    """Two ranks at stage 3: one epoch saved with save_full_weights, loaded by other ranks' modules built
    from other values with load_full_weights."""
    module = GPTModule()
    t = trainer(ZeroStrategy(stage=3, save_full_weights=True), scratch, devices=world_size,
                use_distributed_sampler=True, max_steps=-1, max_epochs=1)
    t.fit(module, loader(4))
    path = os.path.join(scratch, "full.ckpt")
    t.save_checkpoint(path)
    saved = full_state_dict(module)
    torch.manual_seed(1 + rank)
    other = GPTModule(build_in_configure_model=True)
    t2 = trainer(ZeroStrategy(stage=3, load_full_weights=True), scratch, devices=world_size,
                 use_distributed_sampler=True)
    t2.validate(other, loader(2), ckpt_path=path, verbose=False)
    loaded = full_state_dict(other)
    return {"files": sorted(os.listdir(scratch)), "same": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "trained": not all(torch.equal(saved[k], v) for k, v in GPTModule().state_dict().items())}


def test_full_weights_round_trip_on_two_ranks(tmp_path):
    got = run_ranks(2, [("round_trip", scenario_full_weights_round_trip, {})], tmp_path)
    for rank in range(2):
        result = got[rank]["round_trip"]
        assert "error" not in result, result["error"]
        assert result["same"] and result["trained"] and "full.ckpt" in result["files"]
