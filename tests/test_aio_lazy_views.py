"""Conjugate and negative views (x.conj(), x.conj().imag) hold other values in
memory than they show: a write stores the values they show, a read into one
is refused (see [Note: conjugate and negative views] in nvmeio._buffers)."""

import os

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes


@pytest.fixture
def h():
    return nvmeio.aio_handle(backend="psync")


def test_a_conjugate_view_is_written_as_the_values_it_shows(h, nvme_dir):
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    c = x.conj()
    assert c.is_conj()
    h.sync_pwrite(c, nvme_dir / "c.bin")
    assert file_bytes(nvme_dir / "c.bin") == c.resolve_conj().numpy().tobytes()
    assert file_bytes(nvme_dir / "c.bin") != x.numpy().tobytes()
    back = torch.empty_like(x)
    h.sync_pread(back, nvme_dir / "c.bin")
    assert torch.equal(back, torch.conj_physical(x))


def test_a_negative_view_is_written_as_the_values_it_shows(h, nvme_dir):
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128)
    imag = x.conj().imag                               # a real tensor with the negative bit
    assert imag.is_neg()
    h.async_pwrite(imag, nvme_dir / "n.bin")
    del imag                                           # the materialised copy lives until wait()
    h.wait()
    assert np.frombuffer(file_bytes(nvme_dir / "n.bin"), np.float64).tolist() == [-2.0, 4.0]


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_reading_into_a_lazy_view_is_refused(h, nvme_dir, view):
    path = nvme_dir / "src.bin"
    path.write_bytes(bytes(32))
    x = torch.zeros(2, dtype=torch.complex128)
    target = x.conj() if view == "conj" else x.conj().imag
    kind = "conjugate" if view == "conj" else "negative"
    with pytest.raises(ValueError, match=f"tensor is a {kind} view .* cannot be the target of a "
                                         "read.*resolve_conj"):
        h.sync_pread(target, path)
    assert h.wait() == 0


def test_write_whole_file_of_a_conjugate_view(h, nvme_dir):
    x = torch.randn(1000, dtype=torch.complex64)
    h.write(x.conj(), nvme_dir / "w.bin")
    assert file_bytes(nvme_dir / "w.bin") == torch.conj_physical(x).numpy().tobytes()
    assert os.listdir(nvme_dir) == ["w.bin"]
