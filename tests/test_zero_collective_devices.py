"""Collectives get tensors on the device their backend takes (zero/runtime/comm.py, [Note:
collectives take tensors where the backend wants them]): under NCCL every tensor handed to
torch.distributed is on the CUDA device, whatever the caller held (the offloaded optimizer's
gradient norm, a broadcast of host values), and the result comes back into the caller's tensor;
the process group zero makes on CUDA is bound to its device; window threads make it current.

No GPU here: torch.distributed's collectives are replaced by recorders emulating rank 0 of two,
and "moving to CUDA" makes a CPU stand-in that says it is on cuda:0 (tests/helpers.py
``OnFakeCuda``), so every device a collective sees is checked.
"""
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zero
from helpers import base_config, on_fake_cuda, train_engine
from zero.examples import GPT, GPTConfig, make_batches
from zero.runtime import comm as comm_module
from zero.runtime.comm import Comm, Place, collective_device
from zero.runtime.window import MicroBatchWindow

CUDA0 = torch.device("cuda", 0)
WORLD = 2


class RecordingBackend:
    """torch.distributed's collectives as rank 0 of ``WORLD`` ranks holding the same values:
    each records its name and the devices of the tensors it was given."""

    def __init__(self):
        self.calls = []

    def _seen(self, name, *tensors):
        self.calls.append((name, [t.device for t in tensors]))

    def all_gather(self, full, shard, group=None, async_op=False):
        self._seen("all_gather", full, shard)
        full.copy_(torch.cat([shard] * WORLD))

    def reduce_scatter(self, shard, full, op=None, group=None, async_op=False):
        self._seen("reduce_scatter", shard, full)
        shard.copy_(full[:shard.numel()] * WORLD)
        return Done() if async_op else None

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._seen("all_reduce", tensor)
        if op != dist.ReduceOp.MAX:
            tensor.mul_(WORLD)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        self._seen("broadcast", tensor)

    def broadcast_object_list(self, objects, src=0, group=None, device=None):
        self.calls.append(("broadcast_object_list", [device]))

    def all_gather_object(self, objects, obj, group=None):
        """Every rank gave the same object (the ranks are one process here); torch's NCCL path
        pickles it through the current CUDA device, which the engine set."""
        self.calls.append(("all_gather_object", []))
        objects[:] = [obj] * len(objects)

    def barrier(self, group=None, device_ids=None):
        self.calls.append(("barrier", [torch.device("cuda", device_ids[0]) if device_ids else torch.device("cpu")]))

    def devices(self, name=None):
        return [d for n, ds in self.calls if name is None or n == name for d in ds]


class Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def fake_move(t, device):
    """comm._to_device with a stand-in for CUDA."""
    return on_fake_cuda(t) if device.type == "cuda" else t.to(device)


@pytest.fixture
def backend(monkeypatch):
    b = RecordingBackend()
    monkeypatch.setattr(comm_module, "_ALL_GATHER", b.all_gather)
    monkeypatch.setattr(comm_module, "_REDUCE_SCATTER", b.reduce_scatter)
    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object", "barrier"):
        monkeypatch.setattr(dist, name, getattr(b, name))
    monkeypatch.setattr(comm_module, "_to_device", fake_move)
    return b


def nccl_comm() -> Comm:
    return Comm(rank=0, world_size=WORLD, backend="nccl", collective_device=CUDA0)


# -- Comm: every collective, host tensors in, the results back in them --------------------------------

def test_under_nccl_host_tensors_go_to_the_gpu_and_the_results_come_back(backend):
    comm = nccl_comm()
    x = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(x) is x and torch.equal(x, torch.tensor([2.0, 4.0]))
    assert comm.broadcast(x, 0) is x
    full = torch.zeros(4)
    comm.all_gather_into(full, torch.tensor([5.0, 6.0]))
    assert torch.equal(full, torch.tensor([5.0, 6.0, 5.0, 6.0]))
    shard = torch.zeros(2)
    assert comm.reduce_scatter(shard, torch.arange(4.0)) is None and torch.equal(shard, torch.tensor([0.0, 2.0]))
    assert comm.any(True) and not comm.any(False)
    comm.broadcast_object("tag")
    comm.barrier()
    assert {type(x), type(full), type(shard)} == {torch.Tensor}  # the caller's own tensors, on the host
    assert len(backend.calls) == 8
    assert set(backend.devices()) == {CUDA0}, backend.calls


def test_an_asynchronous_reduce_scatter_copies_back_when_waited_for(backend):
    shard = torch.zeros(2)
    work = nccl_comm().reduce_scatter(shard, torch.arange(4.0), async_op=True)
    work.wait()
    assert torch.equal(shard, torch.tensor([0.0, 2.0])) and backend.devices() == [CUDA0, CUDA0]


def test_tensors_on_the_collective_device_are_used_as_they_are(backend):
    x = on_fake_cuda(torch.ones(3))
    nccl_comm().all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((3,), 2.0))  # reduced in place: no copy made


def test_under_gloo_device_tensors_go_to_the_host(backend):
    comm = Comm(rank=0, world_size=WORLD, backend="gloo", collective_device=torch.device("cpu"))
    x = on_fake_cuda(torch.ones(2))
    comm.all_reduce(x)
    assert backend.devices() == [torch.device("cpu")] and torch.equal(x.cpu(), torch.full((2,), 2.0))


@pytest.mark.parametrize("backend_name, compute, expected", [
    ("nccl", "cuda:1", "cuda:1"),  # the compute device
    ("nccl", "cpu", "cuda:3"),  # a CPU engine in a script's NCCL group: this rank's own GPU (local rank 3)
    ("gloo", "cuda:1", "cpu"),
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # gloo serves host tensors
    ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
    (None, "cuda:1", "cuda:1"),  # a world of one: nothing moves
])
def test_the_collective_device_follows_the_backend(monkeypatch, backend_name, compute, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert collective_device(backend_name, torch.device(compute), local_rank=3) == torch.device(expected)


# -- the engine: every collective it makes, under NCCL ------------------------------------------------

def test_an_engine_under_nccl_hands_every_collective_device_tensors(backend, monkeypatch, tmp_path):
    """Stage 3 on a CPU (an engine may compute there in an NCCL group) with the optimizer offloaded
    and clipping: the gradient norm all-reduce is of a host tensor, GatheredParameters broadcasts
    a host value, save_checkpoint agrees on the tag; each reaches torch.distributed on the GPU."""
    fake = nccl_comm()
    monkeypatch.setattr("zero.engine.entry.process_place", lambda: Place(0, WORLD, 0))
    monkeypatch.setattr("zero.engine.entry.init_distributed", lambda **kwargs: fake)
    c = GPTConfig()
    torch.manual_seed(0)
    config = base_config("none", "cpu", world_size=WORLD, clip=1.0, lr=1e-2)
    engine, _, _, _ = zero.initialize(model=GPT(c), config=config)
    assert engine.comm is fake and engine.device == torch.device("cpu")
    train_engine(engine, make_batches(c, 2, 4), 2)
    assert backend.devices("all_reduce"), "the gradient norm was all-reduced"
    with zero.GatheredParameters([engine.module.head.weight], modifier_rank=0):
        engine.module.head.weight.data.mul_(0.5)
    assert backend.devices("broadcast")
    engine.save_checkpoint(tmp_path / "ckpt")
    assert backend.devices("broadcast_object_list")
    engine.destroy()
    assert {"all_gather", "reduce_scatter"} <= {name for name, _ in backend.calls}
    assert set(backend.devices()) == {CUDA0}, [c for c in backend.calls if set(c[1]) != {CUDA0}]


# -- the process group and the window threads ---------------------------------------------------------

@pytest.fixture
def launched(monkeypatch):
    """A launcher's variables, and init_process_group recording what it is given (no group made)."""
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return calls


def test_on_cuda_the_process_group_is_nccl_bound_to_the_compute_device(launched):
    comm = comm_module.init_distributed(device=torch.device("cuda", 1))
    assert launched == [{"backend": "nccl", "device_id": torch.device("cuda", 1)}]
    assert (comm.rank, comm.world_size, comm.backend, comm.collective_device) == (1, 2, "nccl",
                                                                                 torch.device("cuda", 1))


def test_on_the_cpu_the_process_group_is_gloo_without_a_device(launched, monkeypatch):
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "3")
    comm = comm_module.init_distributed(device=torch.device("cpu"))
    assert launched == [{"backend": "gloo", "timeout": timedelta(minutes=3)}]
    assert (comm.backend, comm.collective_device) == ("gloo", torch.device("cpu"))


def test_window_threads_make_the_compute_device_current(monkeypatch):
    current = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), d))
    window = MicroBatchWindow(3, device=torch.device("cuda", 1))
    threads = window.run(lambda i: threading.get_ident())
    assert [current.get(t) for t in threads] == [torch.device("cuda", 1)] * 3


def test_window_threads_on_the_cpu_touch_no_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device on the CPU"))
    assert MicroBatchWindow(2, device=torch.device("cpu")).run(lambda i: i) == [0, 1]

