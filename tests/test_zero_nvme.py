"""NVMe offload really puts the model states on disk, in fp32 when training in fp32.

One swap file per optimizer sub-group holds its master, exp_avg and
exp_avg_sq (each region 4096-aligned). Training in fp32, the parameter shards
are read from the master region (no parameter swap files: zero/stores/param_store.py
[Note]), which holds the fp32 values bit for bit (DeepSpeed 0.19.8 stores fp32
parameters offloaded to NVMe as bf16). In bf16 each parameter unit has a file
of ``shard_numel × 2`` bytes. And a process training a model with everything
on NVMe stays below the size of the model states in memory.
"""
import json
import os
import sys
import textwrap

import torch

import zero
from zero.stores.param_store import unit_id
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, run_process, train_engine
from swapper._param_swapper import swap_file_name

CFG = GPTConfig()


def _align(n: int) -> int:
    return -(-n // 4096) * 4096


def test_swap_files_hold_exactly_the_partitions_in_fp32(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2, sub_group_size=3000)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        train_engine(engine, make_batches(CFG, 3, 4), 3)
        engine.parts.optimizer_store.swapper.synchronize()
        layout = engine.parts.rank_layout
        param_dir = engine.parts.param_store.swap_dir
        opt_dir = engine.parts.optimizer_store.swap_dir
        assert param_dir.startswith(str(tmp_path)) and opt_dir.startswith(str(tmp_path))
        assert os.listdir(param_dir) == []  # the shards live in the optimizer's master

        # a header page, master, exp_avg, exp_avg_sq (each 4096-aligned); no gradient file: each
        # sub-group was stepped during backward, its gradient never written
        opt_expected = {f"subgroup{sg.index}.swp": 4096 + 3 * _align(sg.numel * 4) for sg in layout.sub_groups}
        opt_actual = {f: os.path.getsize(os.path.join(opt_dir, f)) for f in os.listdir(opt_dir)}
        assert opt_actual == opt_expected and len(opt_expected) > 1

        # The master region holds every unit's fp32 parameters, bit for bit, where the store reads them.
        for unit in engine.parts.units:
            path, offset = engine.parts.optimizer_store.master_home(unit.index)
            with open(path, "rb") as f:
                f.seek(offset)
                on_disk = torch.frombuffer(bytearray(f.read(unit.layout.shard_numel * 4)), dtype=torch.float32)
            with zero.GatheredParameters(unit.params):
                flat = torch.cat([p.detach().reshape(-1) for p in unit.params])
            assert path.startswith(opt_dir) and torch.equal(on_disk, flat), unit.layout.module_name
        assert all(p.dtype == torch.float32 for p in model.parameters())
    finally:
        engine.destroy()
    assert not os.listdir(tmp_path)  # destroy() removed the swap files


def test_bf16_parameters_have_swap_files_of_their_own(tmp_path):
    torch.manual_seed(0)
    config = base_config("nvme", "nvme", tmp_path, lr=1e-2, sub_group_size=3000, precision="bf16")
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    try:
        train_engine(engine, make_batches(CFG, 2, 4), 2)
        engine.parts.param_store.flush()
        layout, param_dir = engine.parts.rank_layout, engine.parts.param_store.swap_dir
        expected = {swap_file_name(unit_id(u)): u.shard_numel * 2 for u in layout.units}
        actual = {f: os.path.getsize(os.path.join(param_dir, f)) for f in os.listdir(param_dir)}
        assert actual == expected
        unit = engine.parts.units[1]
        on_disk = torch.from_file(os.path.join(param_dir, swap_file_name(unit_id(unit.layout))),
                                  size=unit.layout.shard_numel, dtype=torch.bfloat16)
        with zero.GatheredParameters(unit.params):
            assert torch.equal(on_disk, torch.cat([p.detach().reshape(-1) for p in unit.params]))
    finally:
        engine.destroy()


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch, zero
    from zero.examples import GPT, GPTConfig, make_batches
    from helpers import base_config, train_engine

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    # Warm the runtime up first (a torch optimizer imports ~70 MB of torch._dynamo; the first
    # backward loads the kernels): every training process pays that, whatever its model size.
    from zero.examples import train_reference
    small = GPTConfig()
    train_reference(GPT(small), make_batches(small, 1, 2), 1)
    cfg = GPTConfig(vocab=1024, d_model=256, heads=4, layers=16, seq=32, tie=True)
    config = base_config("nvme", "nvme", sys.argv[1], lr=1e-3, micro=2, sub_group_size=1_000_000)
    baseline = status("VmRSS")
    with zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    train_engine(engine, make_batches(cfg, 2, 2), 2)
    params = engine.parts.rank_layout.numel
    print(json.dumps({"params": params, "peak": status("VmHWM") - baseline}))
    engine.destroy()
""")


def test_process_memory_stays_below_the_model_states(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_process([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)], env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    model_states = 16 * result["params"]  # fp32 parameter, gradient, exp_avg, exp_avg_sq
    assert result["params"] > 12_000_000
    assert result["peak"] < model_states, result


def test_optimizer_states_are_read_during_the_last_backward(tmp_path):
    """With the step after backward (step_in_backward false), the first sub-group is read as soon
    as the backward of the last micro-batch has written the gradients, not in step()."""
    from swapper._sub_group import SubGroupState

    config = base_config("none", "nvme", tmp_path, accumulation=2, sub_group_size=3000)
    config["zero_optimization"]["offload_optimizer"]["step_in_backward"] = False
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    swapper = engine.parts.optimizer_store.swapper
    first = engine.parts.rank_layout.sub_groups[0].index
    try:
        (x, y), (x2, y2) = make_batches(CFG, 2, 4)
        engine.backward(engine(x, y))
        assert swapper.state(first) in (SubGroupState.ON_NVME, SubGroupState.WRITING)  # not a boundary
        engine.step()
        engine.backward(engine(x2, y2))
        assert swapper.state(first) in (SubGroupState.READING, SubGroupState.AVAILABLE)
        engine.step()
        assert engine.optimizer.adam_step == 1
    finally:
        engine.destroy()
