"""backend="auto": measured, overridable, and clear about what exists."""

import os

import pytest

import nvmeio
from nvmeio import _backend_choice as backend_choice


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.setattr(backend_choice, "_chosen", None)


def test_every_available_backend_is_measured(tmp_path):
    times = backend_choice.measure_backends(str(tmp_path), rounds=1)
    assert set(times) == set(nvmeio.available_backends())
    assert all(0 < t < float("inf") for t in times.values())
    assert os.listdir(tmp_path) == []        # the probe file is removed


def test_auto_keeps_the_preferred_order_unless_clearly_beaten(monkeypatch):
    order = nvmeio.available_backends()
    if len(order) < 2:
        pytest.skip("only one backend here")
    first, second = order[0], order[1]
    slightly = {b: 1.0 for b in order}
    slightly[second] = 1.0 * (1 - backend_choice.MARGIN / 2)   # faster, but within the margin
    assert backend_choice.pick(slightly) == first
    clearly = dict(slightly)
    clearly[second] = 1.0 * (1 - 2 * backend_choice.MARGIN)    # clearly faster
    assert backend_choice.pick(clearly) == second
    monkeypatch.setattr(backend_choice, "measure_backends", lambda: clearly)
    assert nvmeio.aio_handle().get_backend() == second


def test_environment_fixes_auto(monkeypatch):
    monkeypatch.setenv("NVMEIO_BACKEND", "psync")
    assert nvmeio.aio_handle().get_backend() == "psync"


def test_environment_naming_a_missing_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("NVMEIO_BACKEND", "spdk")
    with pytest.raises(ValueError, match="NVMEIO_BACKEND='spdk' is not available here; available "
                                         "backends: " + ", ".join(nvmeio.available_backends())):
        nvmeio.aio_handle()


def test_explicit_backend_is_kept():
    for b in nvmeio.available_backends():
        assert nvmeio.aio_handle(backend=b).get_backend() == b
