"""A read into a tensor autograd depends on (issue 34) is held to what torch holds its own
in-place ops to: a tensor that requires grad is refused before any I/O while grad mode is on,
and a tensor saved for backward makes that backward raise "modified by an inplace operation"
instead of giving a wrong gradient (see [Note: reads into tensors autograd knows] in
nvmeio.buffers)."""

import numpy as np
import pytest
import torch

import nvmeio
from helpers import file_bytes

N = 1000
LEAF = "buffer is a leaf tensor that requires grad, so it cannot be the target of a read"
INPLACE = "modified by an inplace operation"


def read(h, how: str, target, path) -> None:
    """Reads ``target`` from ``path`` through the op ``how`` names, waiting where it is async."""
    if how == "sync_pread":
        h.sync_pread(target, path)
    elif how == "async_pread":
        h.async_pread(target, path)
        h.wait()
    elif how == "pread_async":
        h.pread(target, path, False, True)
        h.wait()
    elif how == "read":
        h.read(target, path)


READS = ["sync_pread", "async_pread", "pread_async", "read"]


@pytest.fixture
def source(nvme_dir):
    """A file of N float32 values, 1..N."""
    path = nvme_dir / "values.bin"
    path.write_bytes(torch.arange(1, N + 1, dtype=torch.float32).numpy().tobytes())
    return path


@pytest.mark.parametrize("how", READS)
def test_a_leaf_that_requires_grad_is_refused_before_any_io(source, how):
    w = torch.zeros(N, requires_grad=True)
    before = file_bytes(source)
    with nvmeio.aio_handle() as h:
        with pytest.raises(ValueError, match=LEAF):
            read(h, how, w, source)
        assert h.wait() == 0  # nothing was submitted
    assert torch.equal(w.detach(), torch.zeros(N)) and w._version == 0
    assert file_bytes(source) == before


@pytest.mark.parametrize("how", ["sync_pread", "async_pread"])
def test_a_view_of_a_leaf_that_requires_grad_is_refused(source, how):
    w = torch.zeros(2 * N, requires_grad=True)
    with nvmeio.aio_handle() as h:
        with pytest.raises(ValueError, match="buffer is a view of a leaf tensor that requires grad"):
            read(h, how, w[:N], source)
        assert h.wait() == 0
    assert torch.equal(w.detach(), torch.zeros(2 * N))


def test_a_tensor_computed_from_one_that_requires_grad_is_refused(source):
    a = torch.ones(N, requires_grad=True)
    b = a * 2  # no tensor saved: without the refusal, backward would give a.grad == 2
    with nvmeio.aio_handle() as h:
        with pytest.raises(ValueError, match="buffer requires grad .* autograd cannot record a read"):
            h.sync_pread(b, source)
    assert torch.equal(b.detach(), torch.full((N,), 2.0))


def test_under_no_grad_a_leaf_is_read_into_as_copy_would_write_it(source):
    w = torch.zeros(N, requires_grad=True)
    with nvmeio.aio_handle() as h, torch.no_grad():
        assert h.sync_pread(w, source) == 1
    assert torch.equal(w.detach(), torch.arange(1, N + 1, dtype=torch.float32))
    assert w._version == 1 and w.requires_grad and w.is_leaf


@pytest.mark.parametrize("how", READS)
def test_a_tensor_saved_for_backward_makes_backward_raise_after_a_read(source, how):
    x = torch.ones(N)                       # a leaf without grad ...
    w = torch.ones(N, requires_grad=True)
    loss = (w * x).sum()                     # ... saved by mul for w's gradient
    with nvmeio.aio_handle() as h:
        read(h, how, x, source)
    assert torch.equal(x, torch.arange(1, N + 1, dtype=torch.float32))
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_non_leaf_saved_for_backward_read_under_no_grad_makes_backward_raise(source):
    a = torch.ones(N, requires_grad=True)
    b = a * 2
    loss = (b * b).sum()  # saves b
    with nvmeio.aio_handle() as h, torch.no_grad():
        h.async_pread(b, source)
        h.wait()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_the_version_moves_at_submission_and_not_for_a_read_refused_there(nvme_dir):
    x = torch.ones(N)
    with nvmeio.aio_handle() as h:
        (nvme_dir / "short.bin").write_bytes(b"\0" * 10)
        with pytest.raises(nvmeio.ShortReadError):
            h.sync_pread(x, nvme_dir / "short.bin")
        assert x._version == 0  # refused at submission: nothing was read
        (nvme_dir / "full.bin").write_bytes(np.zeros(N, np.float32).tobytes())
        h.async_pread(x, nvme_dir / "full.bin")
        assert x._version == 1  # counted at submission
        h.wait()
    assert x._version == 1


def test_writes_leave_tensors_saved_for_backward_usable(nvme_dir):
    x = torch.arange(N, dtype=torch.float32)
    w = torch.ones(N, requires_grad=True)
    loss = (w * x).sum()
    with nvmeio.aio_handle() as h:
        h.sync_pwrite(x, nvme_dir / "x.bin")
        h.write(x, nvme_dir / "whole.bin")
    loss.backward()
    assert torch.equal(w.grad, x) and x._version == 0
