"""Shared fixtures: a directory on a real file system and handle settings."""

import os

# Child Pythons started by tests (python -c / -m) must import the installed
# nvmeio, not the source tree of the current directory (it has no built
# _native); PYTHONSAFEPATH keeps the current directory off their sys.path.
os.environ["PYTHONSAFEPATH"] = "1"
# ... and find the test helpers module (``from helpers import ...``) as the tests do.
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_here, os.environ.get("PYTHONPATH")) if p)
# The suite computes on the CPU, GPU or not: its references (plain torch, expected bytes, lending
# and memory expectations) are the CPU's. DeepSpeed's variable, read by zero (zero/runtime/comm.py,
# [Note: which device computes]); this process, its ranks and child Pythons inherit it. A test
# of the GPU path names its device (compute_device="cuda") and skips without one.
os.environ["DS_ACCELERATOR"] = "cpu"
# cuBLAS's deterministic workspace for the CUDA suite (tests/test_cuda_engine.py, which turns on
# torch.use_deterministic_algorithms): cuBLAS reads it when CUDA first uses it, so it is set
# before any test runs. A workspace setting only: nothing else computes differently.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import gc
import importlib

import pytest

from helpers import BACKENDS


def pytest_addoption(parser):
    parser.addoption("--cuda-suite-on-cpu", action="store_true",
                     help="run the CUDA suite (tests/test_cuda_engine.py, test_cuda_frameworks.py, "
                          "test_cuda_inference.py) with the CPU as its device: a dry check of its references "
                          "where there is no GPU")


# -- the CUDA suite (its files: --cuda-suite-on-cpu above) ------------------------------------------------------

@pytest.fixture
def cuda_suite_device(request):
    """cuda:0, or the CPU with --cuda-suite-on-cpu; skips without a GPU."""
    import torch

    if request.config.getoption("--cuda-suite-on-cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (pytest --cuda-suite-on-cpu runs it on the CPU, a dry check)")
    return torch.device("cuda", 0)


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True, warn_only=True) for the test: an op without a
    deterministic kernel warns, naming itself, rather than failing a comparison for it."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture(autouse=True)
def fresh_direct_io_warnings(monkeypatch):
    """The "no O_DIRECT" warning comes once per process per kind of file: each test
    starts as a fresh process would, so that a test expecting it sees it."""
    monkeypatch.setattr(importlib.import_module("nvmeio._handle"), "_warned_no_direct", set())


@pytest.fixture(autouse=True)
def isolated_process_state():
    """Each test leaves the environment and the default process group as it found them. Lightning
    sets MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK in os.environ as it launches; a later
    engine then takes the process for one launched by torchrun and joins a group of one, which
    ranks forked after it inherited ("trying to initialize the default process group twice!")."""
    import torch.distributed as dist

    environ = dict(os.environ)
    grouped = dist.is_available() and dist.is_initialized()
    yield
    if not grouped and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(autouse=True, scope="module")
def frozen_heap():
    """Each test module starts with what the modules before it left alive out of the garbage
    collector's sight (gc.freeze, after a full collection that finalizes their garbage). The leak
    checks' gc.collect() then walks what this module makes, not the half a million objects of
    torch, transformers and lightning (0.3 s a collection here, twice per leak-checked test)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def nvme_dir(tmp_path):
    """A scratch directory (tmp_path is on the machine's ext4 disk)."""
    return tmp_path


@pytest.fixture
def swappers(tmp_path):
    """Keeps the swappers a test makes: ``s = swappers(Swapper(tmp_path, ...))``.

    After the test, cleans each one up and checks that nothing is left in tmp_path.
    """
    made = []

    def keep(swapper):
        made.append(swapper)
        return swapper

    yield keep
    for s in made:
        s.cleanup()
    assert os.listdir(tmp_path) == []


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
