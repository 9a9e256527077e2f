"""initialize refuses, before allocating, a config whose host memory cannot fit, naming the setting."""
import pytest
import torch

import zero
from swapper.host_memory import HostMemory, format_bytes
from zero.stores import memory_check
from zero.config import ConfigError
from zero.examples import GPT, GPTConfig
from helpers import base_config

CFG = GPTConfig(layers=2, d_model=64)
MiB = 1 << 20


def _machine(monkeypatch, available, memlock=None, locked=0):
    monkeypatch.setattr(memory_check, "probe", lambda: HostMemory(available, memlock, locked))


def test_cpu_offload_larger_than_memavailable_says_to_move_the_optimizer_to_nvme(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    numel = sum(p.numel() for p in model.parameters())
    _machine(monkeypatch, available=numel * 4)  # the fp32 parameters alone; the optimizer needs 4x
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=base_config("cpu", "cpu", tmp_path))
    problem = info.value.problems[0]
    assert problem.path == "zero_optimization.offload_optimizer.device"
    states = 4 * numel * 4
    assert (f"fp32 master weights, optimizer states and gradients in host memory (offload_optimizer.device "
            f"cpu): {format_bytes(states)}") in problem.message
    assert f"but MemAvailable is {format_bytes(numel * 4)} (" in problem.message
    assert problem.message.endswith("set zero_optimization.offload_optimizer.device to 'nvme'")


def test_nvme_swap_buffers_over_the_memlock_limit_are_refused_with_the_numbers(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = base_config("nvme", "nvme", tmp_path, sub_group_size=10**6)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    _machine(monkeypatch, available=64 << 30, memlock=1 << 20, locked=0)
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=config)
    problem = info.value.problems[0]
    assert problem.path == "zero_optimization.sub_group_size"
    assert "of locked memory (pin_memory) but the memlock limit leaves 1.00 MiB (ulimit -l 1024 KiB" in problem.message
    assert "raise it with ulimit -l, set pin_memory false, or lower zero_optimization.sub_group_size" in problem.message


def test_live_parameters_bound_is_named_when_gathered_parameters_do_not_fit(monkeypatch, tmp_path):
    torch.manual_seed(0)
    big = GPTConfig(layers=4, d_model=256)
    model = GPT(big)
    numel = sum(p.numel() for p in model.parameters())
    config = base_config("nvme", "nvme", tmp_path, sub_group_size=4096)
    # Swap buffers and one unit fit; every parameter gathered at once (the default bound) does not.
    _machine(monkeypatch, available=numel * 4 * 5 // 4)
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=config)
    assert info.value.problems[0].path == "zero_optimization.stage3_max_live_parameters"
    config["zero_optimization"]["stage3_max_live_parameters"] = numel // 8
    engine, _, _, _ = zero.initialize(model=GPT(big), config=config)  # fits once the bound is lowered
    engine.destroy()


def _stage(config, stage):
    """``config`` at a lower ZeRO stage: no offload_param and no stage3_ key (they need stage 3)."""
    zc = config["zero_optimization"]
    config["zero_optimization"] = {"stage": stage, "sub_group_size": zc["sub_group_size"],
                                   "offload_optimizer": zc["offload_optimizer"]}
    return config


def test_stage_2_counts_its_offloaded_optimizer_and_names_nvme_not_a_stage_3_key(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    numel = sum(p.numel() for p in model.parameters())
    _machine(monkeypatch, available=numel * 4)
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=_stage(base_config("none", "cpu", tmp_path), 2))
    problem = info.value.problems[0]
    assert problem.path == "zero_optimization.offload_optimizer.device"
    assert f"cpu): {format_bytes(4 * numel * 4)}" in problem.message
    assert problem.message.endswith("set zero_optimization.offload_optimizer.device to 'nvme'")
    assert "stage3_" not in problem.message


def test_stage_2_counts_the_whole_models_parameters_on_a_cpu_machine_and_names_stage_3(monkeypatch, tmp_path):
    torch.manual_seed(0)
    big = GPTConfig(layers=8, d_model=128)
    model = GPT(big)
    numel = sum(p.numel() for p in model.parameters())
    config = _stage(base_config("none", "nvme", tmp_path, precision="bf16"), 2)
    # The optimizer's swap buffers fit; the bf16 parameters, whole on the compute device (the CPU), do not.
    _machine(monkeypatch, available=numel * 2)
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=config)
    problem = info.value.problems[0]
    assert problem.path == "zero_optimization.stage"
    assert (f"the largest part is the parameters, whole (one rank: its partition is the whole model) on the "
            f"compute device (zero_optimization.stage 2): set zero_optimization.stage to 3 with "
            f"zero_optimization.offload_param.device 'nvme' and stage3_max_live_parameters below the model's "
            f"{numel} parameters") in problem.message
    assert f"whole model) on the compute device (zero_optimization.stage 2): {format_bytes(numel * 2)}" \
        in problem.message
    # What the message says fits on the same machine.
    config = base_config("nvme", "nvme", tmp_path, precision="bf16", stage3_max_live_parameters=numel // 8)
    engine, _, _, _ = zero.initialize(model=GPT(big), config=config)
    engine.destroy()


@pytest.mark.parametrize("stage,path,fix", [
    (0, "zero_optimization.stage", "set zero_optimization.stage to 1 or 2 with "
                                   "zero_optimization.offload_optimizer.device 'nvme'"),
    (1, "zero_optimization.offload_optimizer.device", "set zero_optimization.offload_optimizer.device to 'nvme'"),
])
def test_below_stage_3_without_offload_the_states_on_the_cpu_are_host_memory(monkeypatch, tmp_path, stage, path,
                                                                               fix):
    torch.manual_seed(0)
    model = GPT(CFG)
    numel = sum(p.numel() for p in model.parameters())
    _machine(monkeypatch, available=numel * 4 * 2)  # fp32: the parameters are the master, 16 bytes a parameter
    with pytest.raises(ConfigError) as info:
        zero.initialize(model=model, config=_stage(base_config("none", "none", tmp_path), stage))
    problem = info.value.problems[0]
    assert problem.path == path
    assert problem.message.startswith(f"the engine needs {format_bytes(16 * numel)} of host memory on this rank")
    assert (f"(fp32 master weights, optimizer states and gradients on the compute device (offload_optimizer.device "
            f"none): {format_bytes(16 * numel)}); ") in problem.message  # the only part: the parameters view it
    assert fix in problem.message
