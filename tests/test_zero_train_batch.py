"""engine.train_batch: one accumulation window run unit-major. Losses and weights are
bit-identical to the micro-batch loop (and so to plain PyTorch with accumulation), each
unit's parameters are read once per window whatever k is, and a model whose micro-batches
take different paths gets the loop, with one log line saying why."""
import logging

import pytest
import torch
import torch.nn as nn

from zero.examples import GPT, GPTConfig, make_batches, train_reference
from helpers import base_config, make_engine, run_ranks, same_weights, train_engine, weights

STEPS = 2


def window_means(losses, k):
    """The mean loss of each window, as train_batch computes it (fp32, torch)."""
    return [torch.tensor(losses[s * k:(s + 1) * k], dtype=torch.float32).mean().item()
            for s in range(len(losses) // k)]


def window_batches(k):
    """The micro-batches of STEPS windows of ``k``."""
    return make_batches(GPTConfig(), STEPS * k, 4)


# The pipelined NVMe optimizer: sub-groups read ahead while the window's last backward steps them.
PIPELINED = {"zero_optimization": {"offload_optimizer": {"pipeline_read": True, "pipeline_write": True}}}


def io_bytes(engine):
    stores = [engine.parts.param_store, engine.parts.optimizer_store]
    counts = [s.swapper.io_bytes for s in stores if getattr(s, "swapper", None) is not None]
    return sum(c.read for c in counts), sum(c.written for c in counts)


def run_loop(tmp_path, k, **kw):
    engine = make_engine(tmp_path / "loop", accumulation=k, **kw)
    losses = train_engine(engine, window_batches(k), STEPS, k)
    out = window_means(losses, k), weights(engine.module)
    engine.destroy()
    return out


def run_window(tmp_path, k, **kw):
    engine, batches = make_engine(tmp_path / "window", accumulation=k, **kw), window_batches(k)
    means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
    out = means, weights(engine.module)
    engine.destroy()
    return out


def assert_same(a, b):
    assert a[0] == b[0]
    assert same_weights(a[1], b[1])


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("offload", ["nvme", "cpu", "none"])
def test_train_batch_equals_the_micro_batch_loop(tmp_path, k, offload):
    assert_same(run_window(tmp_path, k, offload=offload), run_loop(tmp_path, k, offload=offload))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_batch_equals_the_loop_with_the_pipelined_nvme_optimizer(tmp_path, precision):
    kw = dict(precision=precision, sub_group_size=20000, overrides=PIPELINED)
    assert_same(run_window(tmp_path, 3, **kw), run_loop(tmp_path, 3, **kw))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_batch_equals_the_loop_in_16_bit_compute(tmp_path, precision):
    assert_same(run_window(tmp_path, 3, precision=precision), run_loop(tmp_path, 3, precision=precision))


def test_train_batch_with_clipping_equals_the_loop_and_plain_torch(tmp_path):
    k = 3
    window = run_window(tmp_path, k, offload="none", clip=0.5)
    assert_same(window, run_loop(tmp_path, k, offload="none", clip=0.5))
    torch.manual_seed(0)
    c = GPTConfig()
    model = GPT(c)
    reference = train_reference(model, make_batches(c, STEPS * k, 4), STEPS, k, clip=0.5)
    assert window[0] == window_means(reference, k)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_bytes_read_and_written_per_window_do_not_grow_with_k(tmp_path, k):
    counted = {}
    for kk in (1, k):
        engine, batches = make_engine(tmp_path / str(kk), accumulation=kk), window_batches(kk)
        engine.train_batch(batches[:kk])  # the first window records the trace
        before = io_bytes(engine)
        engine.train_batch(batches[kk:2 * kk])
        after = io_bytes(engine)
        counted[kk] = (after[0] - before[0], after[1] - before[1])
        engine.destroy()
    assert counted[1][0] > 0 and counted[1][1] > 0
    assert counted[k] == counted[1]


def test_the_micro_batch_loop_reads_every_parameter_per_micro_batch(tmp_path):
    """What train_batch saves: the loop's parameter reads grow with k (the figure it is measured
    against); the optimizer's bytes are the same (the loop holds its running gradient in memory)."""
    def param_and_optimizer_reads(engine):
        return engine.parts.param_store.swapper.io_bytes.read, engine.parts.optimizer_store.swapper.io_bytes.read

    counted = {}
    for name in ("loop", "window"):
        engine, batches = make_engine(tmp_path / name, accumulation=4), window_batches(4)
        run = (lambda b: train_engine(engine, b, 1, 4)) if name == "loop" else engine.train_batch
        run(batches[:4])
        before = param_and_optimizer_reads(engine)
        run(batches[4:])
        counted[name] = [a - b for a, b in zip(param_and_optimizer_reads(engine), before)]
        engine.destroy()
    assert counted["loop"][0] == 4 * counted["window"][0] > 0
    assert counted["loop"][1] == counted["window"][1] > 0


class Branchy(nn.Module):
    """Odd micro-batches (by their first token) go through another layer: different paths."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x, y):
        h = self.embed(x)
        h = self.a(h) if int(x[0, 0]) % 2 == 0 else self.b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def branchy_batches(count):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        x = torch.randint(0, 16, (2, 4), generator=g)
        x[0, 0] = i % 16  # micro-batch i takes branch a when i is even
        out.append((x, torch.randint(0, 16, (2, 4), generator=g)))
    return out


def test_micro_batches_on_different_paths_get_the_loop_with_one_log_line(tmp_path, caplog):
    k = 2
    results = []
    for use_window in (False, True):
        engine = make_engine(tmp_path / str(use_window), accumulation=k, micro=2, model=Branchy)
        batches = branchy_batches(2 * k)
        if use_window:
            with caplog.at_level(logging.INFO, logger="zero"):
                means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(2)]
        else:
            means = window_means(train_engine(engine, batches, 2, k), k)
        results.append((means, weights(engine.module)))
        engine.destroy()
    assert_same(results[1], results[0])
    said = [r.getMessage() for r in caplog.records if "train_batch runs the micro-batch loop" in r.getMessage()]
    assert len(said) == 1 and "different paths" in said[0] and "Linear" in said[0]


def test_wrong_number_of_micro_batches_is_refused(tmp_path):
    engine, batches = make_engine(tmp_path, accumulation=3), window_batches(3)
    with pytest.raises(ValueError, match=r"train_batch got 2 micro-batches; the config's "
                                         r"gradient_accumulation_steps is 3"):
        engine.train_batch(batches[:2])
    with pytest.raises(ValueError, match=r"train_batch took 2 micro-batches from the iterator before it ended"):
        engine.train_batch(iter(batches[:2]))
    engine.destroy()


def test_an_iterator_gives_the_next_window(tmp_path):
    engine, batches = make_engine(tmp_path, accumulation=3), window_batches(3)
    it = iter(batches)
    means = [engine.train_batch(it).item() for _ in range(STEPS)]
    assert next(it, None) is None and engine.global_steps == STEPS
    engine.destroy()
    assert means == run_loop(tmp_path, 3)[0]


def test_train_batch_in_the_middle_of_a_window_is_refused(tmp_path):
    engine, batches = make_engine(tmp_path, accumulation=3), window_batches(3)
    loss = engine(*batches[0])
    engine.backward(loss)
    engine.step()
    with pytest.raises(ValueError, match=r"train_batch runs a whole accumulation window, but this one is 1 "
                                         r"micro-batch\(es\) in"):
        engine.train_batch(batches[1:4])
    engine.destroy()


def test_a_model_that_returns_no_loss_is_refused(tmp_path):
    engine = make_engine(tmp_path, "none", accumulation=2, micro=2, model=lambda: nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"train_batch needs the model to return its loss \(a one-element tensor, "
                                        r"or an output with .loss or \['loss'\]\); it returned Tensor"):
        engine.train_batch([torch.randn(2, 4), torch.randn(2, 4)])
    engine.destroy()


def test_no_optimizer_is_refused(tmp_path):
    config = base_config("none", "none", tmp_path, accumulation=2)
    del config["optimizer"]
    engine = make_engine(config=config)
    with pytest.raises(RuntimeError, match="this engine has no optimizer"):
        engine.train_batch(make_batches(GPTConfig(), 2, 4))
    engine.destroy()


def scenario_window(rank, world_size, scratch, use_window):
    k = 3
    engine = make_engine(scratch, accumulation=k, world_size=world_size, sub_group_size=3000)
    batches = [(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
               for x, y in make_batches(GPTConfig(), STEPS * k, 4 * world_size)]
    if use_window:
        means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
    else:
        means = window_means(train_engine(engine, batches, STEPS, k), k)
    w = {n: t.tolist() for n, t in weights(engine.module).items()}
    engine.destroy()
    return {"means": means, "weights": w}


def test_two_ranks_train_batch_equals_the_loop(tmp_path):
    results = run_ranks(2, [("loop", scenario_window, {"use_window": False}),
                            ("window", scenario_window, {"use_window": True})], tmp_path)
    for r in results:
        assert "error" not in r["window"], r["window"].get("error")
        assert "error" not in r["loop"], r["loop"].get("error")
        assert r["window"] == r["loop"]


def hf_model(kind: str, checkpointing: bool):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)  # tied head
    if checkpointing:  # activation_checkpointing_enable since transformers 5.24; the old name before
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def hf_batches(count):
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (2, 8), generator=g)
                                                          for _ in range(count))]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_train_batch_equals_the_loop(tmp_path, kind, checkpointing):
    k, results = 3, []
    for use_window in (False, True):
        engine = make_engine(tmp_path / str(use_window), accumulation=k, micro=2,
                             model=lambda: hf_model(kind, checkpointing))
        batches = hf_batches(STEPS * k)
        if use_window:
            means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
        else:
            losses = []
            for mb in batches:
                loss = engine(**mb).loss
                losses.append(loss.item())
                engine.backward(loss)
                engine.step()
            means = window_means(losses, k)
        results.append((means, weights(engine.module)))
        engine.destroy()
    assert_same(results[1], results[0])


class Checkpointed(GPT):
    """torch.utils.checkpoint called directly: the forward is recomputed during backward."""

    def forward(self, x, y):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, y, use_reentrant=False)


def test_a_forward_recomputed_by_torch_checkpoint_equals_the_loop(tmp_path):
    """On the CPU each micro-batch's backward runs on its own thread, so a recomputed forward
    uses that micro-batch's aliases whatever checkpoint function recomputes it."""
    k, results = 3, []
    for use_window in (False, True):
        engine = make_engine(tmp_path / str(use_window), accumulation=k, model=lambda: Checkpointed(GPTConfig()))
        batches = make_batches(GPTConfig(), STEPS * k, 4)
        if use_window:
            means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
        else:
            means = window_means(train_engine(engine, batches, STEPS, k), k)
        results.append((means, weights(engine.module)))
        engine.destroy()
    assert_same(results[1], results[0])


def test_a_window_backward_keeps_at_most_one_unit_of_gradients_per_micro_batch(tmp_path):
    """The k backwards take turns unit by unit: a unit's gradients of the k micro-batches are
    reduced before the next unit's arrive, so no more than the largest units' wait."""
    k = 4
    engine, batches = make_engine(tmp_path, accumulation=k), window_batches(k)
    coordinator = engine.parts.coordinator
    pending, inner = [0], coordinator.window_grad

    def counting(p, i, grad):
        inner(p, i, grad)
        pending[0] = max(pending[0], sum(g.numel() for g in coordinator.window.grads.values()))

    coordinator.window_grad = counting
    engine.train_batch(batches[:k])
    engine.destroy()
    largest = max(u.layout.numel for u in coordinator.units)
    embedding = coordinator.units[0].layout.numel  # tied to the head: used first and last in backward
    assert 0 < pending[0] <= (k - 1) * embedding + k * largest


def test_a_forward_drawing_random_numbers_gets_the_loop_with_one_log_line(tmp_path, caplog, monkeypatch):
    """Dropout: interleaved forwards would draw the loop's numbers in another order, so the
    window stops at the first draw, puts the generator back and runs the loop."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")
    monkeypatch.setattr("zero.engine.train_batch._TOLD", set())  # said once per process: maybe already
    k, results = 2, []
    for use_window in (False, True):
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)  # dropout 0.1
        engine = make_engine(tmp_path / str(use_window), accumulation=k, micro=2,
                             model=lambda: transformers.GPT2LMHeadModel(config).train())
        batches = hf_batches(STEPS * k)
        torch.manual_seed(1)
        with caplog.at_level(logging.INFO, logger="zero"):
            if use_window:
                means = [engine.train_batch(batches[s * k:(s + 1) * k]).item() for s in range(STEPS)]
            else:
                means = window_means([train_step(engine, mb) for mb in batches], k)
        results.append((means, weights(engine.module), torch.get_rng_state()))
        engine.destroy()
    assert_same(results[1][:2], results[0][:2])
    assert torch.equal(results[1][2], results[0][2])
    said = [r.getMessage() for r in caplog.records if "train_batch runs the micro-batch loop" in r.getMessage()]
    assert said == ["[zero] train_batch runs the micro-batch loop: its forward draws random numbers (dropout?), "
                    "which unit-major would draw in another order than the loop; it runs the loop from now on"]


def train_step(engine, micro_batch):
    loss = engine(**micro_batch).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_a_window_ended_short_steps_and_the_next_window_starts_whole(tmp_path):
    """set_gradient_accumulation_boundary(True): 2 micro-batches of a window of 3 step (each
    loss divided by 3, as the loop divides it), then train_batch takes the next whole window;
    the losses are plain PyTorch's doing the same."""
    engine, batches = make_engine(tmp_path, "none", accumulation=3), window_batches(3)
    losses = [train_step_xy(engine, batches[0])]
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    losses.append(train_step_xy(engine, batches[1]))
    assert (engine.global_steps, engine.micro_steps, engine.is_gradient_accumulation_boundary()) == (1, 3, False)
    mean = engine.train_batch(batches[2:5]).item()
    engine.destroy()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    reference = []
    for window in (batches[:2], batches[2:5]):
        for x, y in window:
            loss = model(x, y)
            reference.append(loss.item())
            (loss / 3).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert losses == reference[:2] and mean == window_means(reference[2:], 3)[0]


def test_a_loss_fn_calling_the_engine_equals_the_model_called_on_the_micro_batch(tmp_path):
    engine, batches = make_engine(tmp_path / "fn", accumulation=3), window_batches(3)
    means = [engine.train_batch(batches[s * 3:(s + 1) * 3], loss_fn=lambda mb: engine(*mb)).item()
             for s in range(STEPS)]
    out = means, weights(engine.module)
    engine.destroy()
    assert_same(out, run_window(tmp_path, 3))


def train_step_xy(engine, micro_batch):
    loss = engine(*micro_batch)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_a_window_counts_each_micro_batchs_backward_through_a_module_once():
    """A frozen unit goes once all k micro-batches' backwards are done with its module (zero/runtime/hooks.py
    [Note: frozen units in backward]); a micro-batch saying so twice (a recompute's second hook) is one."""
    from zero.runtime.window import MicroBatchWindow

    window, module, other = MicroBatchWindow(3), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert [window.backward_passed(module, i) for i in (0, 0, 1)] == [False, False, False]
    assert window.backward_passed(other, 2) is False  # another module's count is its own
    assert window.backward_passed(module, 2) is True
    # a module a forward calls twice: the next k
    assert [window.backward_passed(module, i) for i in (2, 1, 1, 0)] == [False, False, False, True]
