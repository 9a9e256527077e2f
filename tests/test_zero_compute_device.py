"""Where the engine computes (zero/runtime/comm.py, [Note: which device computes]): a
``compute_device=`` argument, else the config's ``compute_device``, else ``$DS_ACCELERATOR``,
else CUDA when available; CUDA asked for where there is none is an error saying where.

No GPU here: "CUDA available" is torch.cuda's answers replaced (two devices; making one current
is recorded), enough for every choice. An engine is only ever built on the CPU; the suite pins
it there (DS_ACCELERATOR=cpu, tests/conftest.py), which is what keeps a GPU machine's run of
the CPU suite on the CPU.
"""
import os

import pytest
import torch

import zero
from helpers import base_config
from zero.examples import GPT, GPTConfig
from zero.runtime.comm import choose_compute_device

CPU = torch.device("cpu")


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda says two devices are there; the devices made current are recorded."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_suite_computes_on_the_cpu():
    assert os.environ["DS_ACCELERATOR"] == "cpu"


# -- the order of the choices ---------------------------------------------------------------------------

@pytest.mark.parametrize("argument, configured, env, expected", [
    ("cpu", "cuda", "cuda", "cpu"),  # the argument (a framework's choice) first
    (CPU, "cuda:1", None, "cpu"),  # a torch.device as well
    (torch.device("cpu", 0), "cuda", None, "cpu"),  # (Hugging Face's device of a CPU rank)
    (None, "cpu", "cuda", "cpu"),  # then the config
    ("auto", "cpu", "cuda", "cpu"),  # "auto" chooses nothing
    (None, "auto", "cpu", "cpu"),  # then DS_ACCELERATOR
    (None, "auto", " CUDA ", "cuda:1"),  # (DeepSpeed's spelling, any case)
    (None, "auto", None, "cuda:1"),  # then CUDA, the local rank's device
    ("cuda:0", "cpu", "cpu", "cuda:0"),
    (torch.device("cuda", 1), "auto", None, "cuda:1"),
    (None, "cuda", None, "cuda:1"),
])
def test_the_first_choice_that_names_a_device_wins(cuda, monkeypatch, argument, configured, env, expected):
    if env is None:
        monkeypatch.delenv("DS_ACCELERATOR")
    else:
        monkeypatch.setenv("DS_ACCELERATOR", env)
    got = choose_compute_device(3, argument, configured)  # local rank 3 of 2 devices: cuda:1
    assert got == torch.device(expected)
    assert cuda == ([] if got.type == "cpu" else [got.index])  # a CUDA device is made current


def test_without_cuda_auto_is_the_cpu(no_cuda, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR")
    assert choose_compute_device(0) == CPU


@pytest.mark.parametrize("argument, configured, env, error, message", [
    ("cuda", "auto", None, ValueError, r"compute_device='cuda' asks for CUDA, but torch.cuda.is_available\(\) is "
                                       r"False here"),
    (None, "cuda:0", None, zero.ConfigError, r"compute_device: 'cuda:0' asks for CUDA"),
    (None, "auto", "cuda", ValueError, r"DS_ACCELERATOR='cuda' asks for CUDA"),
])
def test_cuda_where_there_is_none_is_an_error_naming_where_it_was_asked_for(no_cuda, monkeypatch, argument,
                                                                              configured, env, error, message):
    monkeypatch.setenv("DS_ACCELERATOR", env or "")
    with pytest.raises(error, match=message):
        choose_compute_device(0, argument, configured)


def test_a_device_this_machine_does_not_have_is_refused(cuda):
    with pytest.raises(ValueError, match=r"compute_device='cuda:2' names CUDA device 2, but this machine has 2 "
                                         r"\(cuda:0 to cuda:1\)"):
        choose_compute_device(0, "cuda:2")


@pytest.mark.parametrize("argument, message", [
    ("xpu", r"compute_device='xpu': compute device 'xpu' is not supported \(supported: auto, cpu, cuda, cuda:N\)"),
    (torch.device("meta"), r"compute_device=device\(type='meta'\): compute device 'meta' is not supported"),
])
def test_an_argument_that_is_no_compute_device_is_refused(argument, message):
    with pytest.raises(ValueError, match=message):
        choose_compute_device(0, argument)


def test_a_ds_accelerator_we_do_not_compute_on_is_refused(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='xpu': zero computes on cpu or cuda"):
        choose_compute_device(0)


# -- the config key -----------------------------------------------------------------------------------

@pytest.mark.parametrize("given, stored", [("CPU", "cpu"), (" cuda:3 ", "cuda:3"), ("auto", "auto")])
def test_the_config_key_takes_the_device_names(given, stored):
    assert zero.load_config(dict(base_config(), compute_device=given)).compute_device == stored
    assert zero.load_config(base_config()).compute_device == "auto"


@pytest.mark.parametrize("given", ["gpu", "cuda:", "cuda:-1", "cpu:0", 0, None])
def test_the_config_key_refuses_anything_else(given):
    with pytest.raises(zero.ConfigError, match=r"compute_device: compute device .* is not supported \(supported: "
                                               r"auto, cpu, cuda, cuda:N\)"):
        zero.load_config(dict(base_config(), compute_device=given))


# -- zero.initialize and zero.Init on a machine with CUDA ---------------------------------------------

def test_initialize_computes_on_the_cpu_it_is_given_though_cuda_is_there(cuda, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=base_config(), compute_device="cpu")
    assert engine.device == CPU and cuda == []
    assert engine.parts.param_store.flat.device == CPU
    engine.destroy()


def test_initialize_computes_on_the_cpu_the_config_names_though_cuda_is_there(cuda, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR")
    engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=dict(base_config(), compute_device="cpu"))
    assert engine.device == CPU and cuda == []
    engine.destroy()


def test_the_suite_pin_keeps_an_engine_on_the_cpu_where_cuda_is_there(cuda):
    engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=base_config())
    assert engine.device == CPU and cuda == []
    engine.destroy()


def test_init_keeps_slices_on_the_cpu_it_is_given_though_cuda_is_there(cuda, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with zero.Init(compute_device="cpu") as context:
        model = GPT(GPTConfig())
    assert context.shard_device == CPU and cuda == []
    assert all(p._zero_init_shard.read().device == CPU for p in model.parameters())

