"""activation_checkpointing.cpu_checkpointing: the tensors a train_batch window saves for backward
stay in host memory up to max_in_cpu_bytes and go to NVMe past it. Losses and weights are
bit-identical with and without spilling and to the micro-batch loop; the spilled bytes are
read back ahead of backward; the window's swap file is gone after it, failed or not; nothing is
written outside the nvme_path; the config is checked."""
import logging
import os
import tempfile
import warnings

import pytest
import torch
import torch._dynamo  # imported now: its import makes a cache folder under TMPDIR (see below)
import torch.nn.functional as F

from zero.config import ConfigError, load_config
from zero.examples import GPT, GPTConfig, make_batches
from zero.runtime.activation_spill import MIN_SPILL_BYTES, SavedActivations
from helpers import CheckpointedGPT, make_engine, same_weights, train_engine, weights

STEPS = 2
MICRO = 8
SHAPE = GPTConfig(d_model=64, seq=32)  # a hidden state of a micro-batch: 8 x 32 x 64 x 4 = 64 KiB, spillable
assert MICRO * SHAPE.seq * SHAPE.d_model * 4 >= MIN_SPILL_BYTES


MODELS = {"plain": GPT, "checkpointed": CheckpointedGPT}


def spill(budget):
    """The config's activation_checkpointing for ``budget``: "off" (none), None (cpu_checkpointing
    with the default budget) or max_in_cpu_bytes."""
    if budget == "off":
        return {}
    section = {"cpu_checkpointing": True}
    if budget is not None:
        section["max_in_cpu_bytes"] = budget
    return {"activation_checkpointing": section}


def train(nvme_path, k, model="plain", budget="off", loop=False):
    """(window means, weights, the store's stats or None)."""
    engine = make_engine(nvme_path, accumulation=k, micro=MICRO, model=lambda: MODELS[model](SHAPE),
                         overrides=spill(budget))
    batches = make_batches(SHAPE, STEPS * k, MICRO)
    if loop:
        losses = train_engine(engine, batches, STEPS, k)
        means = [torch.tensor(losses[s * k:(s + 1) * k], dtype=torch.float32).mean().item() for s in range(STEPS)]
    else:
        means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
    store = engine.parts.activations
    out = means, weights(engine.module), (store.stats if store is not None else None)
    engine.destroy()
    return out


def assert_same(a, b):
    assert a[0] == b[0]
    assert same_weights(a[1], b[1])


def activation_files(nvme_path):
    folder = os.path.join(nvme_path, "zero_stage_3", "rank0", "activations")
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("model", ["plain", "checkpointed"])
@pytest.mark.parametrize("k", [1, 3])
def test_spilled_windows_equal_kept_ones_and_the_micro_batch_loop(tmp_path, k, model):
    loop = train(tmp_path / "loop", k, model, loop=True)
    spilled = train(tmp_path / "spilled", k, model, budget=0)  # every storage past 64 KiB to NVMe
    kept = train(tmp_path / "kept", k, model, budget=10**12)
    assert_same(spilled, loop)
    assert_same(kept, loop)
    assert_same(train(tmp_path / "off", k, model), loop)
    s, h = spilled[2], kept[2]
    assert s.saved_bytes == h.saved_bytes > 0
    assert s.spilled_bytes == s.read_bytes == s.saved_bytes and s.spilled_tensors > 0
    assert h.spilled_bytes == h.read_bytes == h.spilled_tensors == 0
    assert s.reads_not_ahead == 0  # every read was started before backward needed it
    if model == "checkpointed":  # per micro-batch the blocks' inputs, and ln_f's, head's and the loss's own
        hidden = MICRO * SHAPE.seq * SHAPE.d_model * 4  # = the logits' bytes (vocab 64 = d_model)
        assert s.saved_bytes == STEPS * k * (SHAPE.layers + 3) * hidden


def test_a_budget_keeps_the_newest_bytes_and_spills_the_rest(tmp_path):
    k = 3
    everything = train(tmp_path / "kept", k, budget=10**12)[2].saved_bytes // STEPS
    budget = everything // 3
    means, w, stats = train(tmp_path / "part", k, budget=budget)
    assert_same((means, w), train(tmp_path / "loop", k, loop=True)[:2])
    # At the end of each window's forwards at most the budget is held: the rest went to NVMe.
    assert STEPS * (everything - budget) <= stats.spilled_bytes < STEPS * everything
    assert stats.reads_not_ahead == 0


def test_the_swap_file_lives_in_the_window_only_and_nothing_is_written_outside_nvme_path(tmp_path, monkeypatch):
    # torch makes torchinductor_<user> under TMPDIR when torch._dynamo is first imported (the first
    # torch optimizer does it): done at this module's import, so not counted as the engine's file.
    nvme, elsewhere = tmp_path / "nvme", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    engine = make_engine(nvme, accumulation=3, micro=MICRO, model=lambda: GPT(SHAPE), overrides=spill(0))
    before = set(all_files(tmp_path))
    seen = []

    def loss_fn(micro_batch):
        loss = engine(*micro_batch)
        loss.register_hook(lambda grad: seen.append(set(all_files(tmp_path)) - before))  # in backward
        return loss

    batches = make_batches(SHAPE, 3, MICRO)
    engine.train_batch(batches, loss_fn=loss_fn)
    folder = os.path.join(nvme, "zero_stage_3", "rank0", "activations")
    assert seen and all(new == {os.path.join(folder, "window0")} for new in seen)
    assert activation_files(nvme) == [] and os.listdir(elsewhere) == []
    assert set(all_files(tmp_path)) == before
    engine.destroy()
    assert not os.path.exists(folder)


def all_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


class FailsInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if FailsInBackward.armed:
            raise RuntimeError("injected failure in backward")
        return grad


class FailingGPT(GPT):
    def forward(self, idx, targets):
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        x = self.blocks[0](x)
        x = self.blocks[1](FailsInBackward.apply(x))  # backward fails half way, files written
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))



@pytest.mark.parametrize("k", [1, 3])
def test_an_error_in_backward_removes_the_window_files(tmp_path, monkeypatch, k):
    monkeypatch.setattr(FailsInBackward, "armed", True)
    engine = make_engine(tmp_path, accumulation=k, micro=MICRO, model=lambda: FailingGPT(SHAPE), overrides=spill(0))
    store = engine.parts.activations
    with pytest.raises(RuntimeError, match="injected failure in backward"):
        engine.train_batch(make_batches(SHAPE, k, MICRO))
    assert store.window_stats.spilled_bytes > 0 and store.window_stats.read_bytes < store.window_stats.spilled_bytes
    assert activation_files(tmp_path) == [] and store.host_bytes == 0
    engine.destroy()


def test_the_default_budget_is_half_the_gradient_stash_s_headroom(tmp_path):
    engine = make_engine(tmp_path, accumulation=3, micro=MICRO, model=lambda: GPT(SHAPE), overrides=spill(None))
    stash = engine.parts.reducer.stash
    assert engine.parts.activations.budget == stash.hold_budget // 2 > 0
    engine.destroy()


def test_the_activation_swap_buffers_are_in_the_memory_check(tmp_path, monkeypatch):
    from swapper.host_memory import HostMemory
    from zero.stores import memory_check

    monkeypatch.setattr(memory_check, "probe", lambda: HostMemory(1 << 20, None, 0))
    with pytest.raises(ConfigError) as info:
        make_engine(tmp_path, accumulation=3, micro=MICRO, model=lambda: GPT(SHAPE), overrides=spill(None))
    problem = info.value.problems[0]
    assert problem.path == "activation_checkpointing.cpu_checkpointing"
    assert "; activation swap buffers (4 x 8.00 MiB): 32.00 MiB; " in problem.message
    assert problem.message.endswith("the largest part is the activation swap buffers (4 x 8.00 MiB): set "
                                    "activation_checkpointing.cpu_checkpointing to false (its buffers stage the "
                                    "saved activations written to NVMe)")


# -- the config -------------------------------------------------------------------------------------

def load(section, zero_extra=None):
    return load_config({"zero_optimization": {"stage": 3, **(zero_extra or {})},
                        "activation_checkpointing": section})


def test_a_budget_without_cpu_checkpointing_is_refused():
    with pytest.raises(ConfigError) as info:
        load({"max_in_cpu_bytes": 1e9})
    assert [(p.path, p.message) for p in info.value.problems] == [(
        "activation_checkpointing.max_in_cpu_bytes",
        "max_in_cpu_bytes is the host-memory budget of cpu_checkpointing, which is false; set cpu_checkpointing "
        "to true, or drop max_in_cpu_bytes")]


def test_a_budget_without_an_nvme_offload_is_refused():
    with pytest.raises(ConfigError) as info:
        load({"cpu_checkpointing": True, "max_in_cpu_bytes": 1e9},
             {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
    assert [(p.path, p.message) for p in info.value.problems] == [(
        "activation_checkpointing.max_in_cpu_bytes",
        "saved activations past max_in_cpu_bytes go to NVMe, but neither zero_optimization.offload_param nor "
        "offload_optimizer has device 'nvme' (with the nvme_path they go to); offload one of them to NVMe, or "
        "drop max_in_cpu_bytes to keep them all in host memory")]


@pytest.mark.parametrize("value, message", [
    (-1, "must be at least 0, got -1"),
    ("auto", "'auto' is not accepted for this key; give a value"),
    (1.5, "expected a whole number, got 1.5"),
])
def test_a_bad_budget_is_refused_naming_it(value, message):
    with pytest.raises(ConfigError) as info:
        load({"cpu_checkpointing": True, "max_in_cpu_bytes": value})
    assert [(p.path, p.message) for p in info.value.problems] == [
        ("activation_checkpointing.max_in_cpu_bytes", message)]


def test_a_misspelled_key_gets_the_closest_one():
    with pytest.raises(ConfigError, match=r"activation_checkpointing.max_in_cpu_byte: unknown key; did you mean "
                                          r"'max_in_cpu_bytes'\?"):
        load({"cpu_checkpointing": True, "max_in_cpu_byte": 1})


def test_cpu_checkpointing_no_longer_warns_and_the_other_keys_still_do(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = load({"cpu_checkpointing": True, "max_in_cpu_bytes": 1e9, "partition_activations": True},
                 {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}})
    assert [str(w.message) for w in caught] == [
        "activation_checkpointing.partition_activations = True is accepted for DeepSpeed compatibility but has no "
        "effect in nvmeio"]
    assert c.activation_checkpointing.max_in_cpu_bytes == 10**9


def test_without_an_nvme_offload_saved_activations_stay_in_memory_with_one_log_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        engine = make_engine(None, "cpu", accumulation=3, micro=MICRO, model=lambda: GPT(SHAPE),
                             overrides=spill(None))
    said = [r.getMessage() for r in caplog.records if "cpu_checkpointing" in r.getMessage()]
    assert said == ["[zero] activation_checkpointing.cpu_checkpointing: saved activations stay in host memory, all "
                    "of them (no zero_optimization offload has device nvme to spill to)"]
    assert engine.parts.activations is None  # on the CPU they are in host memory already
    engine.destroy()


# -- the store itself ----------------------------------------------------------------------------------

def big():
    g = torch.Generator().manual_seed(0)
    return torch.randn(MIN_SPILL_BYTES // 4, generator=g).requires_grad_()


def views_and_leaves(leaf):
    h = leaf * 2
    q, k = h[: h.numel() // 2], h[h.numel() // 2:]
    return (q * k).sum() + (leaf * leaf).sum()  # two views of h's storage saved; the leaf twice


def test_views_of_one_storage_are_stored_once_and_leaves_are_not_taken():
    reference = big()
    views_and_leaves(reference).backward()
    store = SavedActivations(None)
    store.begin(backward_turns=False)
    leaf = big()
    with store.saving(0):
        out = views_and_leaves(leaf)
    assert store.stats.saved_bytes == store.host_bytes == leaf.numel() * 4  # h's storage, once
    out.backward()
    assert torch.equal(leaf.grad, reference.grad)
    assert store.host_bytes == 0  # dropped with the graph's nodes
    store.end()


def test_a_tensor_changed_in_place_after_it_was_saved_is_refused():
    store = SavedActivations(None)
    store.begin(backward_turns=False)
    x = big()
    with store.saving(0):
        h = x * 2
        out = (h * h).sum()
    h.add_(1)
    with pytest.raises(RuntimeError, match=r"a tensor of shape \(16384,\) saved for backward in a train_batch window "
                                           r"was modified by an in-place operation after it was saved \(version 1, "
                                           r"saved at version 0\)"):
        out.backward()
    store.end()


def test_a_saved_tensor_used_after_its_window_ended_is_refused():
    store = SavedActivations(None)
    store.begin(backward_turns=False)
    x = big()
    with store.saving(0):
        out = (x * 2).exp().sum()
    store.end()
    with pytest.raises(RuntimeError, match=r"a tensor saved for backward in a train_batch window is gone: the window "
                                           r"ended \(its activations and swap file were dropped\) before this "
                                           r"backward used it; run the window again"):
        out.backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: saved tensors copied to pinned host memory "
                                                          "and back (no GPU here)")
def test_on_cuda_saved_tensors_go_to_host_memory_and_back_unchanged(tmp_path):
    from swapper._activation_swapper import ActivationSwapper

    for budget, swapper in ((None, None), (0, ActivationSwapper(tmp_path, job_id="job"))):
        store = SavedActivations(budget, swapper)
        store.begin(backward_turns=False)
        x = big().cuda().detach().requires_grad_()
        with store.saving(0):
            out = ((x * 3).sin() * 2).sum()
        assert store.stats.saved_bytes > 0
        out.backward()
        expected = torch.autograd.grad(((x * 3).sin() * 2).sum(), x)[0]
        assert torch.equal(x.grad, expected)
        store.end()
        if swapper is not None:
            assert store.stats.spilled_bytes == store.stats.read_bytes > 0
            swapper.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the asynchronous copy to host memory "
                                                          "(no GPU here)")
def test_on_cuda_saving_waits_for_no_copy_and_an_in_place_change_after_it_is_refused(monkeypatch):
    waits = []
    real = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (waits.append(1), real(self))[1])
    store = SavedActivations(None)
    store.begin(backward_turns=False)
    x = big().cuda().detach().requires_grad_()
    with store.saving(0):
        y = (x * 3).sin()
        out = (y * y).sum()
    assert waits == [] and store.stats.saved_bytes > 0
    y.add_(1)  # a saved tensor changed after it was saved: its copy may have raced the change
    with pytest.raises(RuntimeError, match="was modified by an in-place operation after it was saved"):
        out.backward()
    store.end()
