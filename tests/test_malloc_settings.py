"""glibc malloc settings for CPU training (zero/stores/malloc_settings.py): an engine that trains on
the CPU keeps freed memory for the next tensor instead of mapping fresh pages for each one, and
gives it back once destroyed; NVMEIO_MALLOC_TUNING=0 leaves malloc alone. Each case runs in a process of its own (the settings
are the process's)."""
import os
import sys

import pytest

from helpers import run_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# A 20 MiB tensor (below the fixed 32 MiB mmap threshold, above glibc's dynamic one) is an mmap of its
# own with glibc's defaults, and comes from the heap once the engine has tuned malloc.
SCRIPT = r"""
import ctypes, tempfile, torch, zero
from zero.examples import GPT, GPTConfig

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}
engine, _, _, _ = zero.initialize(model=GPT(GPTConfig(layers=1)), config=config)
before = libc.mallinfo2().hblkhd
t = torch.empty(20 << 20, dtype=torch.uint8)
t.fill_(1)
mapped = libc.mallinfo2().hblkhd - before
del t

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

freed = [torch.ones(5 << 20) for _ in range(10)]  # 200 MiB from the heap, then freed
del freed
kept = rss()
engine.destroy()
print(mapped, kept - rss())
"""


def mapped_bytes_of_a_20_mib_tensor(env_value):
    env = dict(os.environ)
    env.pop("NVMEIO_MALLOC_TUNING", None)
    if env_value is not None:
        env["NVMEIO_MALLOC_TUNING"] = env_value
    done = run_process([sys.executable, "-c", SCRIPT], env=env, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-2000:]
    mapped, returned = map(int, done.stdout.split()[-2:])
    return mapped, returned


def test_a_cpu_training_engine_takes_tensors_from_the_heap_and_gives_it_back_when_destroyed():
    mapped, returned = mapped_bytes_of_a_20_mib_tensor(None)
    assert mapped == 0
    assert returned >= 150 << 20  # the freed heap, kept while the engine lived


def test_nvmeio_malloc_tuning_off_leaves_glibc_s_defaults():
    mapped, _ = mapped_bytes_of_a_20_mib_tensor("0")
    assert mapped >= 20 << 20


def test_a_value_that_is_not_a_flag_is_refused_by_name():
    env = dict(os.environ, NVMEIO_MALLOC_TUNING="sometimes")
    done = run_process([sys.executable, "-c", SCRIPT], env=env, cwd=os.path.dirname(__file__))
    assert done.returncode != 0
    assert "NVMEIO_MALLOC_TUNING='sometimes' is not a boolean" in done.stderr


# [Note: the heap between steps]: the end of a step trims the heap once it has outgrown the working set
# measured at the end of the first step after the last trim; a smaller growth stays for reuse.
STEPS_SCRIPT = r"""
import sys, torch, zero
from zero.examples import GPT, GPTConfig, make_batches

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}
cfg = GPTConfig(layers=1)
engine, _, _, _ = zero.initialize(model=GPT(cfg), config=config)
x, y = make_batches(cfg, 1, 2)[0]

def step():
    engine.backward(engine(x, y))
    engine.step()

step()  # the working set
out = []
for mib in map(int, sys.argv[1:]):
    freed = [torch.ones(1 << 20) for _ in range(mib // 4)]  # 4 MiB each, from the heap, then freed
    del freed
    grown = rss_anon()
    step()
    out.append(grown - rss_anon())
engine.destroy()
print(*out)
"""


def test_a_step_trims_the_heap_once_it_has_outgrown_the_working_set_and_not_before():
    done = run_process([sys.executable, "-c", STEPS_SCRIPT, "64", "768"], cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-2000:]
    small, large = map(int, done.stdout.split()[-2:])
    assert small < 32 << 20  # 64 MiB more than the working set: kept for the next tensors
    assert large >= 512 << 20  # 768 MiB more: given back
