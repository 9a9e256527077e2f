"""Shared fixtures: a directory on a real file system and handle settings."""

import os

# Child Pythons started by tests (python -c / -m) must import the installed
# nvmeio, not the source tree of the current directory (it has no built
# _native); PYTHONSAFEPATH keeps the current directory off their sys.path.
os.environ["PYTHONSAFEPATH"] = "1"

import numpy as np
import pytest

import nvmeio

BACKENDS = nvmeio.available_backends()


@pytest.fixture
def nvme_dir(tmp_path):
    """A scratch directory (tmp_path is on the machine's ext4 disk)."""
    return tmp_path


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


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


def unaligned_view(n: int, shift: int = 1) -> np.ndarray:
    """A writable n-byte numpy view whose address is not 4096-aligned."""
    base = np.empty(n + 4096 + shift, dtype=np.uint8)
    start = (-base.__array_interface__["data"][0]) % 4096 + shift
    return base[start:start + n]


def is_root() -> bool:
    return os.geteuid() == 0
