"""Checkpoints: resume bit for bit, atomic saves, zero_to_fp32 and save_16bit_model.

A run saved after 3 steps and resumed in a fresh engine (fresh random
weights, so nothing carries over by accident) continues with exactly the
losses of the uninterrupted run, for every offload and for fp16 (whose loss
scaler state is restored), with the LR schedule and client state restored. A
save that dies half way leaves ``latest`` on the previous complete checkpoint.
"""
import os
import sys

import pytest
import torch

import nvmeio
import zero
import zero.checkpoint.save as checkpoint_module
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, make_engine, run_process, same_weights, train_engine, weights

CFG = GPTConfig()


# Every engine here clips, warms its learning rate up and gathers 16-bit weights on save.
SETTINGS = dict(clip=1.0, lr=1e-2, overrides={
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
    "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}})


@pytest.mark.parametrize("offload,precision", [("none", "fp32"), ("cpu", "fp32"), ("nvme", "fp32"),
                                               ("nvme", "fp16")])
def test_resume_continues_exactly(tmp_path, offload, precision):
    batches = make_batches(CFG, 6, 4)
    engine = make_engine(tmp_path / "swap", offload, precision=precision, **SETTINGS)
    train_engine(engine, batches[:3], 3)
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 7})
    expected = train_engine(engine, batches[3:], 3)
    expected_lr = engine.get_lr()
    engine.destroy()

    resumed = make_engine(tmp_path / "swap", offload, precision=precision, seed=1, **SETTINGS)
    path, client = resumed.load_checkpoint(tmp_path / "ckpt")
    assert path == str(tmp_path / "ckpt" / "global_step3") and client == {"epoch": 7}
    assert resumed.global_steps == 3 and resumed.lr_scheduler.last_batch_iteration == 2
    assert train_engine(resumed, batches[3:], 3) == expected
    assert resumed.get_lr() == expected_lr
    resumed.destroy()


def test_layout_latest_and_no_partial_left(tmp_path):
    engine = make_engine(tmp_path / "swap", "none", **SETTINGS)
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt", tag="named")
    engine.destroy()
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "named"
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest", "named"]
    files = sorted(os.listdir(ckpt / "named" / "rank00000"))
    n = len(engine.parts.rank_layout.sub_groups)
    assert files == ["engine.pt"] + [f"subgroup{i:05d}.safetensors" for i in range(n)]


def test_a_crash_during_save_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = make_engine(tmp_path / "swap", "none", **SETTINGS)
    model = engine.module
    batches = make_batches(CFG, 2, 4)
    train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    first = weights(model)
    train_engine(engine, batches[1:], 1)

    real_save, calls = torch.save, []

    def dying_save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 1:  # engine.pt, after the sub-group shards
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1"
    assert not (tmp_path / "ckpt" / "global_step2").exists()

    engine.load_checkpoint(tmp_path / "ckpt")
    assert same_weights(weights(model), first)
    engine.save_checkpoint(tmp_path / "ckpt", tag="again")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["again", "global_step1", "latest"]
    engine.destroy()


def test_resaving_a_tag_replaces_it_whole(tmp_path):
    engine = make_engine(tmp_path / "swap", "none", **SETTINGS)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    engine.destroy()
    small = make_engine(tmp_path / "swap", "none", sub_group_size=100_000, **SETTINGS)
    small.save_checkpoint(tmp_path / "ckpt", tag="t")
    small.destroy()
    assert sorted(os.listdir(tmp_path / "ckpt" / "t" / "rank00000")) == ["engine.pt", "subgroup00000.safetensors"]


def test_zero_to_fp32_cli_and_functions_give_the_trained_weights(tmp_path):
    engine = make_engine(tmp_path / "swap", "nvme", precision="fp16", **SETTINGS)
    train_engine(engine, make_batches(CFG, 3, 4), 3)
    engine.save_checkpoint(tmp_path / "ckpt")
    master = {}
    for sg in engine.parts.rank_layout.sub_groups:  # the fp32 masters, for comparison
        m, _ = engine.parts.optimizer_store.read(sg)
        master[sg.index] = m
    engine.destroy()

    out = tmp_path / "model.bin"
    run = run_process([sys.executable, "-m", "zero.zero_to_fp32", str(tmp_path / "ckpt"), str(out)],
                      timeout=120)
    assert run.returncode == 0, run.stderr
    state = torch.load(out, weights_only=True)
    direct = zero.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert list(state) == list(direct) and all(torch.equal(state[k], direct[k]) for k in state)
    reference = GPT(CFG)
    assert set(state) == set(reference.state_dict())
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["head.weight"].data_ptr() == state["wte.weight"].data_ptr()  # tied, stored once
    layout = engine.parts.rank_layout
    unit = layout.units[1]
    start, _ = layout.unit_range(1)
    sg = layout.sub_group_of(1)
    flat = torch.cat([state[s.name].reshape(-1) for s in unit.slots])
    assert torch.equal(flat, master[sg.index][start - sg.start:start - sg.start + unit.numel])

    loaded = zero.load_state_dict_from_zero_checkpoint(GPT(CFG), tmp_path / "ckpt")
    assert all(torch.equal(p, state[n]) for n, p in loaded.named_parameters())


def test_zero_to_fp32_reports_a_missing_checkpoint(tmp_path):
    run = run_process([sys.executable, "-m", "zero.zero_to_fp32", str(tmp_path), str(tmp_path / "o.bin")],
                      timeout=120)
    assert run.returncode == 1
    assert f"{tmp_path} has no 'latest' file; pass the tag explicitly" in run.stderr


def test_save_16bit_model(tmp_path, caplog):
    engine = make_engine(tmp_path / "swap", "cpu", precision="bf16", **SETTINGS)
    model = engine.module
    train_engine(engine, make_batches(CFG, 2, 4), 2)
    assert engine.save_16bit_model(tmp_path / "export")
    state = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    with zero.GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], p.detach())
    assert set(state) == set(GPT(CFG).state_dict())
    engine.destroy()

    off = make_engine(tmp_path / "swap", "none", **SETTINGS)
    off.config.zero_optimization.__dict__["stage3_gather_16bit_weights_on_model_save"] = False
    assert off.save_16bit_model(tmp_path / "none") is False
    assert not (tmp_path / "none").exists()
    assert "stage3_gather_16bit_weights_on_model_save is false" in caplog.text
    off.destroy()


@pytest.mark.parametrize("stage, offload", [(0, "none"), (2, "cpu")])
def test_save_16bit_model_below_stage_3_saves_without_the_gather_flag(tmp_path, stage, offload):
    # Below stage 3 every rank holds the whole parameters: DeepSpeed saves them with no flag to set.
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config(offload_optimizer=offload, precision="bf16", stage=stage)
    del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, _, _, _ = zero.initialize(model=model, config=config)
    assert not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
    train_engine(engine, make_batches(CFG, 2, 4), 2)
    assert engine.save_16bit_model(tmp_path / "export")
    state = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    assert set(state) == set(GPT(CFG).state_dict())
    for name, p in model.named_parameters():
        assert p.numel() > 0 and state[name].dtype == torch.bfloat16 and torch.equal(state[name], p.detach())
    engine.destroy()


CONVERT_SCRIPT = """
import sys, threading, time

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024

import torch
from zero.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

base = anon()
peak, stop = [base], [False]

def sample():
    while not stop[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

thread = threading.Thread(target=sample)
thread.start()
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], safe_serialization=sys.argv[3] == "1")
stop[0] = True
thread.join()
print(peak[0] - base)
"""


@pytest.mark.parametrize("safe", [False, True])
def test_zero_to_fp32_holds_the_model_once(tmp_path, safe):
    """Anonymous memory grows by the fp32 model, once (torch.save format), or by one parameter
    (safetensors, streamed), plus the writer's two locked buffers: only the masters' bytes are read,
    the optimizer states (three times the model) never are, and no second copy of the model is made."""
    cfg = GPTConfig(vocab=1024, d_model=256, heads=4, layers=16, seq=32, tie=True)
    engine, _, _, _ = zero.initialize(model=GPT(cfg), config=base_config(sub_group_size=1_000_000))
    engine.save_checkpoint(tmp_path / "ckpt")
    model_bytes = 4 * engine.parts.rank_layout.numel
    engine.destroy()
    run = run_process([sys.executable, "-c", CONVERT_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "o.bin"),
                       "1" if safe else "0"], timeout=300)
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.strip().splitlines()[-1])
    assert model_bytes > 50_000_000
    writer_buffers = 2 * nvmeio._fast_io.DEFAULT_BUFFER_SIZE + (8 << 20)  # + Python's own allocations
    largest = 4 * max(s.numel for u in engine.parts.rank_layout.units for s in u.slots)
    held = largest if safe else model_bytes
    assert growth < 1.25 * held + writer_buffers, (growth, held, writer_buffers)


def test_zero_to_fp32_safe_serialization_streams_the_same_weights(tmp_path):
    engine = make_engine(tmp_path / "swap", "nvme", precision="bf16", **SETTINGS)
    train_engine(engine, make_batches(CFG, 2, 4), 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    (tmp_path / "out").mkdir()
    run = run_process([sys.executable, "-m", "zero.zero_to_fp32", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                       "--safe_serialization"], timeout=120)
    assert run.returncode == 0, run.stderr
    import safetensors.torch
    state = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    direct = zero.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(state) == set(direct) == set(GPT(CFG).state_dict())
    assert all(torch.equal(state[k], direct[k]) and state[k].dtype == torch.float32 for k in state)
    assert oct(os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777) == "0o600"


def test_save_16bit_model_as_safetensors_streams_each_unit(tmp_path, monkeypatch):
    engine = make_engine(tmp_path / "swap", "nvme", precision="bf16", **SETTINGS)
    model = engine.module
    train_engine(engine, make_batches(CFG, 2, 4), 2)
    written = []  # (name, number of units gathered so far): each unit is written as soon as it is gathered
    import nvmeio.safetensors_file as st
    real_write = st.SafetensorsWriter.write
    gathers = [0]
    for unit in engine.parts.units:
        real_gather = unit.gather
        def counting(real_gather=real_gather):
            gathers[0] += 1
            return real_gather()
        monkeypatch.setattr(unit, "gather", counting)
    monkeypatch.setattr(st.SafetensorsWriter, "write",
                        lambda self, name, t: (written.append((name, gathers[0])), real_write(self, name, t))[1])
    assert engine.save_16bit_model(tmp_path / "export", "model.safetensors")
    monkeypatch.undo()
    import safetensors.torch
    state = safetensors.torch.load_file(str(tmp_path / "export" / "model.safetensors"))
    with zero.GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], p.detach())
    assert set(state) == set(GPT(CFG).state_dict())
    first_unit_names = [n for s in engine.parts.units[0].layout.slots for n in s.names]
    assert all(g == 1 for n, g in written if n in first_unit_names)  # written before unit 2 was gathered
    engine.destroy()
