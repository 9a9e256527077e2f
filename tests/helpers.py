"""Test helpers: engines built for a test and their weights, the engine training loop, test
configs, several ranks in one test, and byte-level helpers for the I/O tests.

Tests import this module directly (``from helpers import ...``): pytest's ``pythonpath``
(pyproject.toml) puts the tests folder on ``sys.path``; their child Pythons find it on the
PYTHONPATH conftest.py sets; bench/reliability imports it as ``tests.helpers``.
"""
from __future__ import annotations

import contextlib
import copy
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

import nvmeio
import zero
from zero.examples import GPT, GPTConfig, make_batches

BACKENDS = nvmeio.available_backends()


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def unaligned_view(n: int, shift: int = 1) -> np.ndarray:
    """A writable n-byte numpy view whose address is not 4096-aligned."""
    base = np.empty(n + 4096 + shift, dtype=np.uint8)
    start = (-base.__array_interface__["data"][0]) % 4096 + shift
    return base[start:start + n]


def is_root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def file_size_limit(nbytes):
    """RLIMIT_FSIZE for this process while the block runs (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# -- special files, made inside a test's own directory (never touching /dev) -----------------------------

NULL_DEVICE = os.makedev(1, 3)  # the numbers of /dev/null
FULL_DEVICE = os.makedev(1, 7)  # ... and of /dev/full: every write fails with ENOSPC


def char_device_node(path, numbers=NULL_DEVICE):
    """A character device node at ``path`` (skips without the right to make one)."""
    import pytest

    try:
        os.mknod(path, stat.S_IFCHR | 0o600, numbers)
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD)")
    return path


def special_file(path, kind: str):
    """A FIFO (``kind="fifo"``) or a Unix socket (``"socket"``) at ``path``."""
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.fspath(path))  # the socket file stays after close
    return path


@contextlib.contextmanager
def fifo_unblocked_after(path, seconds: float = 10.0):
    """Should something block opening the FIFO ``path`` (waiting for a peer), its other
    end is opened and closed after ``seconds``: a regression then fails, never hangs."""
    def peer():
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))

    timer = threading.Timer(seconds, peer)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def loop_device_node(directory, data: bytes):
    """A loop device over the file ``directory/backing.img`` (holding ``data``) and a block
    device node of it at ``directory/loop``: tests write through that node, never through
    /dev. Yields (node, backing file); skips where no loop device can be set up."""
    import pytest

    if not is_root() or shutil.which("losetup") is None:
        pytest.skip("a loop device needs root and losetup")
    backing = directory / "backing.img"
    backing.write_bytes(data)
    made = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True,
                          text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"no loop device can be set up here: {made.stderr.strip()}")
    device = made.stdout.strip()
    try:
        node = directory / "loop"
        os.mknod(node, stat.S_IFBLK | 0o600, os.stat(device).st_rdev)
        yield node, backing
    finally:
        subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=60)


def lora_gpt(cfg: GPTConfig, seed: int = 0, rank: int = 2) -> torch.nn.Module:
    """A GPT with rank-``rank`` adapters (zero.examples.add_lora), all its base frozen; the adapters
    drawn from N(0, 0.1), since B starts at zero: they matter from the first step."""
    from zero.examples import add_lora

    torch.manual_seed(seed)
    model = GPT(cfg)
    torch.manual_seed(seed + 1)
    add_lora(model, rank=rank)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


def train_engine(engine, batches: Sequence, steps: int, accumulation: int = 1, rank: int = 0,
                 shards: int = 1) -> List[float]:
    """The same loop through a ZeRO engine; rank ``rank`` of ``shards`` takes its part of each batch."""
    losses: List[float] = []
    it = iter(batches)
    for _ in range(steps * accumulation):
        x, y = next(it)
        if shards > 1:
            x, y = x.chunk(shards)[rank], y.chunk(shards)[rank]
        loss = engine(x, y)
        losses.append(loss.detach().item())
        engine.backward(loss)
        engine.step()
    return losses


def base_config(offload_param: str = "none", offload_optimizer: str = "none", nvme_path=None,
                accumulation: int = 1, micro: int = 4, world_size: int = 1, clip: float = 0.0,
                precision: str = "fp32", lr: float = 1e-3, weight_decay: float = 0.01, **zero_extra) -> dict:
    """A DeepSpeed config dict for the tests: stage 3, AdamW, the given offload."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4096}
    zero.update(zero_extra)
    for key, device in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        zero[key] = {"device": device}
        if device == "nvme":
            zero[key]["nvme_path"] = str(nvme_path)
        if key == "offload_param" and device == "nvme":
            zero[key]["max_in_cpu"] = 0
            zero[key]["min_swap_bytes"] = 0  # every partition on NVMe, however small
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train_windows(engine, batches: Sequence, steps: int, accumulation: int, rank: int = 0,
                  shards: int = 1) -> List[float]:
    """:func:`train_engine`'s micro-batches through ``engine.train_batch_losses``, a window a step."""
    losses: List[float] = []
    it = iter(batches)
    for _ in range(steps):
        window = []
        for _ in range(accumulation):
            x, y = next(it)
            window.append((x.chunk(shards)[rank], y.chunk(shards)[rank]))
        losses.extend(float(v) for v in engine.train_batch_losses(window))
    return losses


def ladder_config(stage: int, offload_optimizer: str, nvme_path, accumulation: int = 1, clip: float = 0.0,
                  world_size: int = 1, lr: float = 1e-2, precision: str = "fp32", **extra) -> dict:
    """A config of ZeRO stage ``stage`` below 3 (no ``offload_param``, no stage-3 keys) or 3, the
    optimizer states offloaded to ``offload_optimizer``; ``extra``: more top-level keys."""
    config = base_config("none", offload_optimizer, nvme_path, accumulation=accumulation, clip=clip, lr=lr,
                         world_size=world_size, sub_group_size=3000, precision=precision)
    config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                   if not k.startswith("stage3_") and k != "offload_param"}
    config["zero_optimization"]["stage"] = stage
    config.update(extra)
    return config


def load_error(engine, load_dir):
    """``engine.load_checkpoint(load_dir)``'s error as "Type: message" (for a rank to report to
    its test), or None when it loaded."""
    try:
        engine.load_checkpoint(load_dir)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


# -- engines built for a test, and their weights -------------------------------------------------------

def _merge(into: dict, extra: dict) -> None:
    """``extra`` merged into ``into``: a dict merged key by key, any other value replacing (copied)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def make_engine(nvme_path=None, offload: str = "nvme", *, seed: int = 0,
                model: Optional[Callable[[], torch.nn.Module]] = None, config: Optional[dict] = None,
                checksum: Optional[str] = None, overrides: Optional[dict] = None, **config_args):
    """A ZeRO engine for a test; its model is ``engine.module``.

    The model is ``model()`` (default ``GPT(GPTConfig())``), built right after
    ``torch.manual_seed(seed)``: engines made with one seed start from the same weights. The
    config is a copy of ``config``, or else ``base_config(offload, offload, nvme_path,
    **config_args)``; ``checksum`` is then set on both offload sections and ``overrides`` merged in
    (a dict key by key, any other value replacing). ``nvme_path`` is created when missing.
    """
    if config is None:
        config = base_config(offload, offload, nvme_path, **config_args)
    elif config_args:
        raise TypeError(f"make_engine: base_config's arguments {sorted(config_args)} given with a whole config")
    else:
        config = copy.deepcopy(config)
    if checksum is not None:
        _merge(config, {"zero_optimization": {key: {"checksum": checksum}
                                              for key in ("offload_param", "offload_optimizer")}})
    _merge(config, overrides or {})
    if nvme_path is not None:
        os.makedirs(nvme_path, exist_ok=True)
    torch.manual_seed(seed)
    built = model() if model is not None else GPT(GPTConfig())
    engine, _, _, _ = zero.initialize(model=built, config=config)
    return engine


def weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of a partitioned ``model`` (``engine.module``) gathered whole: name -> a copy."""
    with zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def weight_digests(model: torch.nn.Module) -> Dict[str, str]:
    """``weights(model)`` as SHA-256 digests of their bytes (for a rank to report to its test)."""
    import hashlib

    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in weights(model).items()}


def frozen_gathered_at_end_of_backward(monkeypatch) -> List[int]:
    """From now on, at the end of each backward: how many frozen units (no parameter that trains, not
    persistent) are still gathered (zero/runtime/hooks.py [Note: frozen units in backward])."""
    from zero.runtime.hooks import Coordinator
    from zero.runtime.param_state import ParamState

    counts, end_backward = [], Coordinator.end_backward

    def counting(coordinator):
        counts.append(sum(u.state is ParamState.AVAILABLE for u in coordinator.units
                          if not u.grad_count and not u.persistent))
        end_backward(coordinator)
    monkeypatch.setattr(Coordinator, "end_backward", counting)
    return counts


def same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    """Two ``weights()`` results with the same names and equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# -- a stand-in for CUDA tensors on a machine without a GPU ------------------------------------------

class OnFakeCuda(torch.Tensor):
    """A CPU tensor that, where the tests look, is one on cuda:0 (a CPU torch makes no CUDA tensor):
    its ``device`` says cuda:0 and, as a CUDA tensor's, its ``.numpy()`` refuses; ``.cpu()`` and
    ``.to("cpu")`` give a plain host copy. Operations on it compute on the host as usual and give
    OnFakeCuda tensors (torch's subclass rules)."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()

    def to(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if device is not None and torch.device(device).type == "cpu":
            return self.as_subclass(torch.Tensor).to(*args, **kwargs).clone()
        return super().to(*args, **kwargs)


def on_fake_cuda(t: torch.Tensor) -> OnFakeCuda:
    """A copy of ``t`` that says it is on cuda:0 (see :class:`OnFakeCuda`)."""
    return t.detach().as_subclass(torch.Tensor).clone().as_subclass(OnFakeCuda)


# -- processes a test starts: never waited for longer than a timeout ------------------------------------

# [Note: timeouts of multi-process tests]
# A process that hangs (a rank in a collective whose peer died or went another way, a
# child stuck in I/O) would hold its test for gloo's default of 30 minutes, or for ever.
# Every process a test starts is waited for through the helpers below: after `timeout`
# seconds it gets SIGABRT (a Python child then prints every thread's stack, faulthandler
# being on) and then SIGKILL, and the test fails with everything the process printed.
# run_ranks builds the process group itself with the same timeout, so that a collective
# waiting for a lost peer gives up no later than the test does.
PROCESS_TIMEOUT_S = 600.0
_STACK_DUMP_S = 5.0  # how long a process is given to print its stacks before SIGKILL


def _stop(pids, group: bool) -> None:
    """SIGABRT, a moment to print stacks, then SIGKILL: to each pid (its process group
    with ``group``: any process it started too)."""
    send = os.killpg if group else os.kill
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                send(pid, sig)
        if sig == signal.SIGABRT:
            time.sleep(_STACK_DUMP_S)


def finish_process(proc: "subprocess.Popen", timeout: float = PROCESS_TIMEOUT_S):
    """``proc.communicate()`` within ``timeout`` seconds; past it, the process is stopped
    (see [Note: timeouts of multi-process tests]) and an AssertionError carries its output."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            own_group = os.getpgid(proc.pid) == proc.pid
        except ProcessLookupError:
            own_group = False
        _stop([proc.pid], group=own_group)
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args!r} did not finish within {timeout:g} s and was killed; "
                             f"it printed:\n{out or ''}{err or ''}") from None


def start_process(args, **kwargs) -> "subprocess.Popen":
    """``subprocess.Popen(args, stdout=PIPE, stderr=PIPE, text=True, **kwargs)`` in a session of
    its own (so that what it starts is stopped with it), for a test that runs several at once;
    each must then be waited for with :func:`finish_process`."""
    env = dict(kwargs.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1")
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(args, text=True, env=env, start_new_session=True, **kwargs)


def run_process(args, timeout: float = PROCESS_TIMEOUT_S, check: bool = False,
                **kwargs) -> "subprocess.CompletedProcess":
    """``subprocess.run(args, capture_output=True, text=True, **kwargs)`` bounded by
    ``timeout`` (see [Note: timeouts of multi-process tests]); ``check``: a non-zero exit
    fails the test with the output. The process gets a session of its own, so that what
    it starts is stopped with it."""
    proc = start_process(args, **kwargs)
    out, err = finish_process(proc, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args!r} failed ({proc.returncode}):\n{out}{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def wait_for_line(proc: "subprocess.Popen", timeout: float = PROCESS_TIMEOUT_S) -> str:
    """The next line of ``proc``'s stdout (a text pipe); should none come within
    ``timeout``, the process is stopped and the test fails with what it printed."""
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        finish_process(proc, timeout=0)
    return line[0]


# -- several ranks in one test: processes started by torch.multiprocessing -----------------------------

# [Note: where the test ranks compute]
# run_ranks' ranks compute on the CPU over gloo, GPU or not (DS_ACCELERATOR=cpu, as the whole suite:
# tests/conftest.py), so a GPU machine runs the CPU suite's multi-rank tests as this one does. NCCL
# refuses two ranks on one GPU, so a test on CUDA (device="cuda") needs a GPU per rank and skips,
# saying so, with fewer. The ranks are forked (fast) unless CUDA is initialised in this process (an
# earlier test used the GPU), which a forked child cannot use: then, and for CUDA ranks, spawned.

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_log(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.log")


def _worker(rank: int, world_size: int, port: int, scenarios, out_dir: str, timeout: float,
            device: str = "cpu") -> None:
    import datetime
    import faulthandler
    import json
    import sys
    import traceback

    import torch.distributed as dist

    # Everything this rank prints goes to its log, for the test to show should it fail;
    # SIGABRT (see [Note: timeouts of multi-process tests]) prints every thread's stack there.
    log = os.open(_rank_log(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.disable()  # installed afresh: an imported library may have replaced its handler
    faulthandler.enable(sys.stderr, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR=device)
    torch.set_num_threads(1)
    # The group zero.initialize would make for this device, with the test's timeout.
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout),
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    results = {}
    for name, fn, kwargs in scenarios:
        try:
            results[name] = fn(rank, world_size, os.path.join(out_dir, name), **kwargs)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
            results[name] = {"error": traceback.format_exc()}
            traceback.print_exc()  # and into the rank's log, for a failure after it
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        # Rank 0 serves the group's store: leaving before every rank has joined the group would
        # close it under a rank still connecting ("connectFullMesh failed ... closed by peer").
        dist.barrier()
        dist.destroy_process_group()


def rank_start_method(device: str = "cpu") -> str:
    """How run_ranks starts its ranks (see [Note: where the test ranks compute])."""
    return "spawn" if device == "cuda" or torch.cuda.is_initialized() else "fork"


def run_ranks(world_size: int, scenarios, out_dir, timeout: float = PROCESS_TIMEOUT_S,
              device: str = "cpu") -> List[dict]:
    """Run ``scenarios`` (``(name, fn, kwargs)``; ``fn(rank, world_size, scratch_dir, **kwargs)``
    returns something JSON-able) in ``world_size`` processes computing on ``device`` ("cpu":
    gloo; "cuda": NCCL, a GPU per rank, else the test skips); one result dict per rank (see
    [Note: where the test ranks compute]). Spawned ranks import ``fn`` by name: a module-level
    function. Ranks not done within ``timeout`` seconds are stopped and the test fails with what
    each printed (see [Note: timeouts of multi-process tests]), as it does when a rank dies."""
    import json

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_ranks computes on 'cpu' or 'cuda', not {device!r}")
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world_size:
            import pytest

            pytest.skip(f"{world_size} ranks on CUDA need {world_size} GPUs (NCCL refuses two ranks on one "
                        f"device); this machine has {have}")
    out_dir = os.fspath(out_dir)
    for name, _, _ in scenarios:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    ranks = mp.start_processes(_worker, args=(world_size, free_port(), scenarios, out_dir, timeout, device),
                               nprocs=world_size, start_method=rank_start_method(device), join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                _stop([p.pid for p in ranks.processes if p.is_alive()], group=False)
                raise AssertionError(f"the {world_size} ranks did not finish within {timeout:g} s "
                                     "and were killed" + _rank_logs(out_dir, world_size))
    except ProcessException as e:
        raise AssertionError(f"a rank failed: {e}" + _rank_logs(out_dir, world_size)) from None
    finally:
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
            p.join()
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def _rank_logs(out_dir: str, world_size: int) -> str:
    """What each rank printed, for a failure message."""
    text = ""
    for rank in range(world_size):
        try:
            with open(_rank_log(out_dir, rank), errors="replace") as f:
                printed = f.read()
        except FileNotFoundError:
            printed = "(nothing: it did not start)"
        text += f"\n--- rank {rank} printed:\n{printed}"
    return text


def scenario_train(rank: int, world_size: int, scratch: str, offload_param: str = "none",
                   offload_optimizer: str = "none", accumulation: int = 1, clip: float = 0.0,
                   precision: str = "fp32", steps: int = 10, lr: float = 1e-2, use_init: bool = False,
                   config_extra: dict = None, **zero_extra) -> List[float]:
    """Train the test GPT on this rank's part of each batch; returns this rank's losses.

    ``use_init`` builds the model inside ``zero.Init``; ``config_extra`` adds top-level keys.
    """
    config = base_config(offload_param, offload_optimizer, scratch, accumulation=accumulation, clip=clip,
                         precision=precision, lr=lr, world_size=world_size, sub_group_size=3000, **zero_extra)
    config.update(config_extra or {})
    c = GPTConfig()

    def model():
        if not use_init:
            return GPT(c)
        with zero.Init(config_dict_or_path=config):
            return GPT(c)

    batches = make_batches(c, steps * accumulation, 4 * world_size)
    engine = make_engine(scratch, config=config, model=model)
    try:
        return train_engine(engine, batches, steps, accumulation, rank=rank, shards=world_size)
    finally:
        engine.destroy()


def parameter_read_dir(engine) -> str:
    """Where an NVMe engine reads parameter shards from: the optimizer's swap directory when fp32
    shards live in its master (zero/stores/param_store.py [Note]), else the parameter swap directory."""
    store = engine.parts.param_store
    return store.master.swap_dir if store.master is not None else store.swap_dir


def scenario_step_fails_on_one_rank(rank, world_size, scratch, fail_rank=-1, which="optimizer", op="write",
                                    precision="fp32"):
    """Train 4 steps on this rank's half of each batch; step 2 fails on ``fail_rank`` only (its
    swap directory refuses ``op``s) and that rank calls step() again, as the error says. The
    step's only collective (the clip norm) comes before any I/O, so the retry needs none.
    (Parameters are written to swap files of their own with bf16 only: fp32 shards live in the
    optimizer's master.)"""
    from nvmeio import faults

    engine = make_engine(scratch, world_size=world_size, clip=0.5, lr=1e-2, sub_group_size=3000, precision=precision)
    losses, refused = [], ""
    for step, (x, y) in enumerate(make_batches(GPTConfig(), 4, 4 * world_size)):
        loss = engine(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        losses.append(loss.item())
        engine.backward(loss)
        if step != 1 or rank != fail_rank:
            engine.step()
            continue
        store = engine.parts.optimizer_store if which == "optimizer" else engine.parts.param_store
        with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=store.swap_dir, op=op):
            try:
                engine.step()
            except OSError as error:
                refused = f"{error.errno}: {error}"
        try:
            engine(x, y)
        except zero.EngineStateError as error:
            refused += f"\n{error}"
        engine.step()  # finish it
    digests = weight_digests(engine.module)
    engine.destroy()
    return {"losses": losses, "weights": digests, "refused": refused}


def scenario_io_fails_on_one_rank(rank, world_size, scratch, fail_rank=-1, clip=0.5, fault="optimizer write",
                                  phase="backward"):
    """Train 4 steps on this rank's half of each batch, a checkpoint after the first. In the
    second step's ``phase`` (forward or backward) ``fail_rank``'s I/O fails (``fault``: its
    optimizer swap directory refuses writes, gradients with ``clip`` (no hold budget: they go to
    NVMe), sub-groups stepped in backward without; or its parameter reads fail); every rank raises, then runs the batch
    again (forward) or loads the checkpoint (backward) and trains on. Returns losses, weight
    digests and each rank's errors."""
    from nvmeio import faults

    engine = make_engine(os.path.join(scratch, "swap"), world_size=world_size, clip=clip, lr=1e-2,
                         sub_group_size=3000, stage3_max_reuse_distance=0)  # backward reads parameters too
    engine.parts.reducer.stash.hold_budget = 0
    batches = [(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
               for x, y in make_batches(GPTConfig(), 4, 4 * world_size)]
    losses = train_engine(engine, batches[:1], 1)
    engine.save_checkpoint(os.path.join(scratch, "ckpt"))
    error = ""
    if fail_rank >= 0:
        where = parameter_read_dir(engine) if fault == "parameter read" else engine.parts.optimizer_store.swap_dir
        plan = dict(fail_nth=1 if rank == fail_rank else 10**9, fail_count=0, errno="EIO",
                    op=fault.split()[-1], path_contains=where)
        loss = engine(*batches[1]) if phase == "backward" else None
        with faults.inject(**plan):
            try:
                engine.backward(loss) if phase == "backward" else engine(*batches[1])
            except Exception as exc:  # noqa: BLE001 - returned to the test
                error = f"{type(exc).__name__}: {exc}"
        if phase == "backward":
            try:
                engine.step()
            except zero.EngineStateError as exc:
                error += f"\n{exc}"
            engine.load_checkpoint(os.path.join(scratch, "ckpt"))
    losses += train_engine(engine, batches[1:], 3)
    digests = weight_digests(engine.module)
    engine.destroy()
    return {"losses": losses, "weights": digests, "error": error}


# -- a child Python, for what must be measured in a fresh process (peak RSS) ----------------------------

def run_child(code: str, *args: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh Python (the installed packages, never the source tree) with
    ``sys.argv[1:] == args``; it prints one JSON object last, which is returned."""
    import json
    import sys

    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    out = run_process([sys.executable, "-c", code, *args], timeout=timeout, env=env)
    if out.returncode != 0:
        raise AssertionError(f"child Python failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


PEAK_RSS_CODE = '''
def peak_rss_bytes():
    """VmHWM of this process: the peak resident set so far."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss():
    """Start VmHWM again from the current resident set (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
'''
"""Source of ``peak_rss_bytes()`` for child Pythons (prepend it to their code)."""


# -- tensors of every dtype, compared bit for bit ---------------------------------------------

def all_dtypes():
    """Every dtype torch.save handles that has a fixed element size."""
    out = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
           torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
           torch.bool]
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out.append(getattr(torch, name))
    return out


def random_tensor(dtype, shape, seed):
    """A tensor of random bytes (any bit pattern, NaNs included) of ``dtype`` and ``shape``."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a, b) -> bool:
    """Tensors equal bit for bit (NaN payloads included), recursively through containers."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


class CheckpointedGPT(GPT):
    """Each block recomputed in backward (torch.utils.checkpoint, non-reentrant): only the blocks'
    inputs are saved; the recomputation saves what the block needs, ``weight.detach()`` included."""

    def checkpointed(self, block, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, x, use_reentrant=False)

    def forward(self, idx, targets):
        import torch.nn.functional as F

        x = self.wte(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = self.checkpointed(block, x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class HFCheckpointedGPT(CheckpointedGPT):
    """:class:`CheckpointedGPT` through ``_gradient_checkpointing_func``, where Hugging Face layers keep
    their checkpoint function: ``train_batch`` binds it to each micro-batch of its window, which on
    CUDA a forward recomputed by another checkpoint function needs (zero/engine/train_batch.py)."""

    def __init__(self, c: GPTConfig = GPTConfig()):
        import functools

        from torch.utils.checkpoint import checkpoint

        super().__init__(c)
        self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

    def checkpointed(self, block, x):
        return self._gradient_checkpointing_func(block, x)


def dequantized_base(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each frozen unit's parameters replaced by what one rank stores for them: the
    unit (a module's own parameters, flattened in order) quantized in groups and dequantized."""
    from zero.runtime.unit import plan_units
    from zero.stores.quantized import dequantize, quantize

    _, params_per_unit, _ = plan_units(model, 1)
    with torch.no_grad():
        for params in params_per_unit:
            if any(p.requires_grad for p in params):
                continue
            flat = torch.cat([p.reshape(-1) for p in params])
            values = dequantize(*quantize(flat))
            at = 0
            for p in params:
                p.copy_(values[at:at + p.numel()].view(p.shape))
                at += p.numel()
    return model


class RecordingBackend:
    """A CUDA backend stand-in for nvmeio.RegisteredHost and the swap pools' registration: what was
    registered (address, bytes) and unregistered (address), in order."""

    def __init__(self):
        self.pinned, self.unpinned = [], []

    def pin_host(self, ptr, nbytes):
        self.pinned.append((ptr, nbytes))
        return None

    def unpin_host(self, ptr):
        self.unpinned.append(ptr)
