"""Reliability report: how nvmeio fails, tried on purpose. Regenerates bench/RELIABILITY.md.

    python3 bench/reliability.py                      # everything, scratch files under /tmp
    python3 bench/reliability.py --dir /local_nvme    # scratch files there
    python3 bench/reliability.py --quick              # fewer cases (a minute or so)
    python3 bench/reliability.py --only faults,leaks  # some sections; the others are kept from
                                                      # bench/reliability.json

Sections (each a function ``(Context) -> Section``, listed in SECTIONS):

- faults: every injected fault of nvmeio.faults on every backend: the error
  surfaces from the op that hit it, wait() never hangs, nothing leaks, the
  handle stays usable, no byte of a surviving file is lost;
- model: hypothesis sequences of sync/async reads and writes, whole-file
  writes and truncations against an in-memory model of the file (tests/io_model.py);
- config: the ZeRO config loader fed mutated real configs and damaged files
  (tests/config_mutations.py): ConfigError or a loaded config, nothing else;
- stress: 8 threads x 2,000 mixed ops, shared and own handles, byte-checked;
- leaks: fds, threads, VmLck and kernel AIO contexts around churn (200 handles,
  2,000 failing ops, locked tensors, engine failures): goal 0;
- security: NUL paths, planted symlinks, read-only targets, killed writers,
  lazy (conjugate/negative) views, out-of-range integers;
- engine, checkpoints (bench/reliability_engine.py): the ZeRO-3 engine under
  injected swap-in/swap-out faults and damaged swap files; hostile checkpoints
  and saves cut at their worst moment.

To add a section (e.g. the engine under injected faults): write a function
``def my_section(ctx: Context) -> Section`` (in its own bench/reliability_*.py
if it is long), append it to SECTIONS, and rerun. Rows are aggregated into the
summary table; a row fails when any of its cases fails, loses bytes or leaks.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import gc
import itertools
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))   # io_model, config_mutations, helpers

import numpy as np
import torch

import nvmeio
from nvmeio import atomic_file, faults, resources

sys.path.insert(0, ROOT)   # tools.results_md
from tools.results_md import bar_chart, chart_link

REPORT = os.path.join(HERE, "RELIABILITY.md")
CHART = os.path.join(HERE, "reliability.png")
RAW = os.path.join(HERE, "out", "reliability.json")   # raw figures (not committed)
HANG_LIMIT_S = 60


# -- the report's model ---------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    cases: int = 0
    failed: int = 0
    bytes_lost: int = 0
    leaks: Dict[str, int] = field(default_factory=dict)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.bytes_lost == 0 and not self.leaks


@dataclass
class Section:
    key: str
    title: str
    about: str
    rows: List[Row] = field(default_factory=list)
    figures: Dict[str, object] = field(default_factory=dict)   # extra numbers worth a line
    seconds: float = 0.0


@dataclass
class Context:
    scratch: str
    quick: bool
    backends: List[str]

    def fresh_dir(self, name: str) -> str:
        d = os.path.join(self.scratch, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def lost(actual: bytes, expected: bytes) -> int:
    n = min(len(actual), len(expected))
    diff = np.count_nonzero(np.frombuffer(actual[:n], np.uint8) != np.frombuffer(expected[:n], np.uint8))
    return int(diff) + abs(len(actual) - len(expected))


def settled_snapshot() -> resources.Resources:
    gc.collect()
    time.sleep(0.05)   # threads that were joined have left /proc/self/task
    return resources.snapshot()


def run_guarded(fn: Callable[[], None]) -> Optional[str]:
    """Runs fn in a thread; returns None, the error text, or 'hang' after HANG_LIMIT_S."""
    box: Dict[str, str] = {}

    def target():
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported as the case's failure
            box["error"] = traceback.format_exc(limit=4).strip().splitlines()[-1]

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_LIMIT_S)
    if t.is_alive():
        return f"hang: still running after {HANG_LIMIT_S} s"
    return box.get("error")


# -- faults ---------------------------------------------------------------------------------------

BLOCK = 64 << 10


class Expectation(AssertionError):
    pass


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Expectation(what)


def _handle(backend: str, **kw) -> nvmeio.aio_handle:
    kw.setdefault("queue_depth", 4)
    kw.setdefault("intra_op_parallelism", 1)
    return nvmeio.aio_handle(block_size=BLOCK, backend=backend, **kw)


def _usable(h, d: str) -> None:
    src = random_bytes(300_001, 77)
    h.sync_pwrite(src, os.path.join(d, "after.bin"))
    dst = np.zeros_like(src)
    h.sync_pread(dst, os.path.join(d, "after.bin"))
    expect(np.array_equal(dst, src), "the handle is not usable after the fault")


def _raises(fn, check: Callable[[BaseException], bool], what: str) -> None:
    try:
        fn()
    except nvmeio.AioError as e:
        expect(check(e), f"{what}: wrong error {e}")
        return
    raise Expectation(f"{what}: no error raised")


def sc_fail_nth_write(backend, d, row):
    h = _handle(backend)
    a, b = random_bytes(1 << 20, 1), random_bytes(1 << 20, 2)
    with faults.inject(fail_nth=2, errno="ENOSPC", path_contains="b.bin"):
        h.async_pwrite(a, os.path.join(d, "a.bin"))
        h.async_pwrite(b, os.path.join(d, "b.bin"))
        _raises(h.wait, lambda e: e.errno == errno.ENOSPC and e.filename.endswith("b.bin")
                and e.offset == BLOCK, "the failed write")
    row.bytes_lost += lost(file_bytes(os.path.join(d, "a.bin")), a.tobytes())
    expect(not os.path.exists(os.path.join(d, "b.bin")), "the failed new file was left behind")
    _usable(h, d)
    h.close()


def sc_fail_nth_read(backend, d, row):
    h = _handle(backend)
    src = random_bytes(1 << 20, 3)
    path = os.path.join(d, "r.bin")
    h.sync_pwrite(src, path)
    with faults.inject(fail_nth=3, errno="EIO", op="read"):
        _raises(lambda: h.sync_pread(np.zeros_like(src), path),
                lambda e: e.errno == errno.EIO and e.filename == path, "the failed read")
    row.bytes_lost += lost(file_bytes(path), src.tobytes())     # a failed read changes no byte
    _usable(h, d)
    h.close()


def sc_fail_byte_exact(backend, d, row):
    h = _handle(backend)
    path = os.path.join(d, "f.bin")
    old = random_bytes(400_000, 4).tobytes()
    with open(path, "wb") as f:
        f.write(old)
    with faults.inject(fail_nth=1, errno="EIO", op="write"):
        _raises(lambda: h.sync_pwrite(np.zeros(200_000, np.uint8), path, file_offset=1000),
                lambda e: e.offset == 1000 and e.length == 4096 - 1000, "the failed head")
    row.bytes_lost += lost(file_bytes(path)[:1000], old[:1000])  # outside the op: untouched
    _usable(h, d)
    h.close()


def _short(backend, d, row, op, unaligned):
    h = _handle(backend)
    n = 8 * BLOCK + 777
    data = random_bytes(n, 5)
    src = data
    if unaligned:
        base = np.empty(n + 4097, np.uint8)
        start = (-base.__array_interface__["data"][0]) % 4096 + 1
        src = base[start:start + n]
        src[:] = data
    path = os.path.join(d, "s.bin")
    with faults.inject(short_nth=3, short_bytes=4196, op=op) as fired:
        if op == "write":
            h.sync_pwrite(src, path)
            row.bytes_lost += lost(file_bytes(path), data.tobytes())
        else:
            with open(path, "wb") as f:
                f.write(data.tobytes())
            dst = np.zeros_like(data)
            h.sync_pread(dst, path)
            row.bytes_lost += lost(dst.tobytes(), data.tobytes())
    expect(fired()["shortened"] == 1, "the short transfer was not injected")
    h.close()


def sc_delay(backend, d, row):
    h = _handle(backend)
    src = random_bytes(6 * BLOCK, 6)
    with faults.inject(delay_us=2000):
        for i in range(3):
            h.async_pwrite(src, os.path.join(d, f"d{i}.bin"))
        expect(h.wait() == 3, "not every delayed op completed")
    for i in range(3):
        row.bytes_lost += lost(file_bytes(os.path.join(d, f"d{i}.bin")), src.tobytes())
    h.close()


def sc_eagain(backend, d, row):
    h = _handle(backend)
    src = random_bytes(8 * BLOCK, 7)
    with faults.inject(submit_refusals=5) as fired:
        h.sync_pwrite(src, os.path.join(d, "e.bin"))
    expect(fired()["submit_refusals"] == 5, "the refusals were not injected")
    row.bytes_lost += lost(file_bytes(os.path.join(d, "e.bin")), src.tobytes())
    h.close()


def sc_eagain_forever(backend, d, row):
    h = _handle(backend)
    with faults.inject(submit_refusals=-1):
        h.async_pwrite(random_bytes(4 * BLOCK), os.path.join(d, "never.bin"))
        _raises(h.wait, lambda e: "Resource temporarily unavailable" in str(e), "EAGAIN forever")
    expect(not os.path.exists(os.path.join(d, "never.bin")), "the failed new file was left")
    _usable(h, d)
    h.close()


def sc_submit_error(backend, d, row):
    h = _handle(backend)
    with faults.inject(submit_refusals=1, submit_errno="EBADF"):
        h.async_pwrite(random_bytes(4 * BLOCK), os.path.join(d, "bad.bin"))
        _raises(h.wait, lambda e: "Bad file descriptor" in str(e), "the submission error")
    _usable(h, d)
    h.close()


def sc_engine_failure(backend, d, row):
    h = _handle(backend, queue_depth=8)
    bufs = [random_bytes(16 * BLOCK, i) for i in range(4)]
    with faults.inject(engine_failure_nth=1):
        for i, b in enumerate(bufs):
            h.async_pwrite(b, os.path.join(d, f"w{i}.bin"))
        _raises(h.wait, lambda e: "I/O engine failure" in str(e), "the engine failure")
    expect(not os.path.exists(os.path.join(d, "w0.bin")), "the failed new file was left")
    for i, b in enumerate(bufs):
        h.async_pwrite(b, os.path.join(d, f"w{i}.bin"))
    h.wait()
    for i, b in enumerate(bufs):
        row.bytes_lost += lost(file_bytes(os.path.join(d, f"w{i}.bin")), b.tobytes())
    h.close()


def sc_engine_cannot_restart(backend, d, row):
    h = _handle(backend)
    src = random_bytes(4 * BLOCK)
    with faults.inject(engine_failure_nth=1, engine_create_failures=1):
        _raises(lambda: h.sync_pwrite(src, os.path.join(d, "a.bin")),
                lambda e: "I/O engine failure" in str(e), "the engine failure")
        _raises(lambda: h.sync_pwrite(src, os.path.join(d, "b.bin")),
                lambda e: "a new engine could not be made" in str(e), "the worker without engine")
    h.close()
    h2 = _handle(backend)
    _usable(h2, d)
    h2.close()


def sc_every_request_fails(backend, d, row):
    h = _handle(backend, queue_depth=8, intra_op_parallelism=2)
    src = random_bytes(3 * BLOCK + 5)
    with faults.inject(fail_nth=1, fail_count=0) as fired:
        for r in range(20):
            for i in range(10):
                h.async_pwrite(src, os.path.join(d, f"x{i}.bin"), file_offset=r)
            _raises(h.wait, lambda e: e.errno == errno.EIO, "200 failing ops")
    expect(fired()["failed"] >= 200 and os.listdir(d) == [], "failed ops left files")
    _usable(h, d)
    h.close()


def sc_whole_file_write_fails(backend, d, row):
    h = _handle(backend)
    path = os.path.join(d, "model.bin")
    old = random_bytes(100_000, 9).tobytes()
    with open(path, "wb") as f:
        f.write(old)
    with faults.inject(fail_nth=2, op="write"):
        _raises(lambda: h.write(random_bytes(1 << 20), path), lambda e: e.filename == path,
                "the failed write()")
    row.bytes_lost += lost(file_bytes(path), old)
    expect(os.listdir(d) == ["model.bin"], "write() left a temporary file")
    h.close()


FAULT_SCENARIOS = {
    "fail the 2nd write request of one op (ENOSPC)": sc_fail_nth_write,
    "fail the 3rd read request (EIO)": sc_fail_nth_read,
    "fail a byte-exact head request (EIO)": sc_fail_byte_exact,
    "short write transfer (user memory)": lambda b, d, r: _short(b, d, r, "write", False),
    "short write transfer (bounce buffer)": lambda b, d, r: _short(b, d, r, "write", True),
    "short read transfer (user memory)": lambda b, d, r: _short(b, d, r, "read", False),
    "short read transfer (bounce buffer)": lambda b, d, r: _short(b, d, r, "read", True),
    "completions delayed 2 ms": sc_delay,
    "submission refused with EAGAIN x5": sc_eagain,
    "submission refused with EAGAIN forever": sc_eagain_forever,
    "submission fails with EBADF": sc_submit_error,
    "engine breaks with requests in flight": sc_engine_failure,
    "engine breaks and cannot restart": sc_engine_cannot_restart,
    "every request fails (200 ops)": sc_every_request_fails,
    "whole-file write() fails midway": sc_whole_file_write_fails,
}


def section_faults(ctx: Context) -> Section:
    s = Section("faults", "Injected faults (nvmeio.faults), every backend",
                "Each scenario runs once per backend (" + ", ".join(ctx.backends) + "). A case "
                "fails if the error is not raised by the op that hit it, wait() hangs "
                f"(> {HANG_LIMIT_S} s), the handle is unusable afterwards, a byte of a file or "
                "buffer that should have survived differs, or fds / threads / VmLck / AIO "
                "contexts grew.")
    for name, fn in FAULT_SCENARIOS.items():
        row = Row(name)
        bad = []
        for backend in ctx.backends:
            d = ctx.fresh_dir("faults")
            before = settled_snapshot()
            error = run_guarded(lambda: fn(backend, d, row))
            faults.disarm()
            grown = resources.grown(before, settled_snapshot())
            row.cases += 1
            if error or grown:
                row.failed += 1
                bad.append(f"{backend}: {error or ''}{' leaked ' + str(grown) if grown else ''}")
            for k, v in grown.items():
                row.leaks[k] = row.leaks.get(k, 0) + v
        row.detail = "; ".join(bad) or "error from the op that hit it, handle usable"
        s.rows.append(row)
    return s


# -- model ----------------------------------------------------------------------------------------

def section_model(ctx: Context) -> Section:
    from hypothesis import HealthCheck, given, settings
    from io_model import handle_settings, run_sequence, sequences

    examples = 100 if ctx.quick else 500
    totals = {"examples": 0, "ops": 0, "bytes_checked": 0, "bytes_lost": 0}
    first: List[str] = []
    d = ctx.fresh_dir("model")

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cfg=handle_settings, seq=sequences)
    def run(cfg, seq):
        path = os.path.join(d, f"m{totals['examples']}.bin")
        out = run_sequence(cfg, seq, path)
        os.unlink(path)
        totals["examples"] += 1
        totals["ops"] += out.ops
        totals["bytes_checked"] += out.bytes_checked
        totals["bytes_lost"] += out.bytes_lost
        if out.first_difference and not first:
            first.append(f"{out.first_difference} ({cfg}, {seq})")

    before = settled_snapshot()
    error = run_guarded(run)
    grown = resources.grown(before, settled_snapshot())
    row = Row("random read/write sequences vs an in-memory model", cases=totals["examples"],
              failed=1 if error else 0, bytes_lost=totals["bytes_lost"], leaks=grown,
              detail=(error or (first[0] if first else
                                f"{totals['ops']:,} ops, {totals['bytes_checked']:,} bytes compared")))
    return Section("model", "Hypothesis: random I/O sequences against a model of the file",
                   "Sequences of up to 12 steps (sync/async pwrite and pread at any offset and "
                   "size up to 200 KB, whole-file write(), truncation from outside, wait()) on a "
                   "random backend and handle settings (block size, queue depth, threads, "
                   "single_submit, overlap_events); every read and the final file compared with a "
                   "bytearray model; a read past the end must raise ShortReadError and leave its "
                   "buffer untouched. tests/io_model.py.", [row], dict(totals))


# -- config ---------------------------------------------------------------------------------------

def section_config(ctx: Context) -> Section:
    from config_mutations import fuzz

    cases = 500 if ctx.quick else 4000
    d = ctx.fresh_dir("config")
    before = settled_snapshot()
    result = fuzz(cases=cases, seed=14, scratch=d)
    grown = resources.grown(before, settled_snapshot())
    row = Row("mutated configs and damaged JSON files", cases=result.cases,
              failed=len(result.findings), leaks=grown,
              detail=("; ".join(result.findings[:5]) or
                      f"{result.loaded} loaded, {result.clear_errors} ConfigError with the key named"))
    return Section("config", "ZeRO config loader fuzzing (zero config)",
                   "The real DeepSpeed configs of tests/data and the test suite's base configs, "
                   "with 1-3 random mutations each (a key deleted, a value replaced by junk of "
                   "another type or an extreme value such as NaN, 2**63, '', '../../etc', a key "
                   "misspelled, an unknown key added), loaded for a random world size; and files "
                   "cut short, with a flipped byte or a duplicated key. A case fails on any outcome "
                   "but a loaded config or a ConfigError with a message. tests/config_mutations.py.",
                   [row], {"loaded": result.loaded, "config_errors": result.clear_errors})


# -- stress ---------------------------------------------------------------------------------------

def section_stress(ctx: Context) -> Section:
    threads, ops = 8, (300 if ctx.quick else 2000)
    d = ctx.fresh_dir("stress")
    region = 1 << 20
    shared_path = os.path.join(d, "shared.bin")
    with open(shared_path, "wb") as f:
        f.truncate(threads * region)
    shared_handles = [nvmeio.aio_handle(block_size=BLOCK, queue_depth=16, intra_op_parallelism=2,
                                        backend=b) for b in ctx.backends]
    totals = {"ops": 0, "bytes_checked": 0, "bytes_lost": 0, "errors": []}
    lock = threading.Lock()

    def worker(t: int) -> None:
        rng = random.Random(1000 + t)
        own = nvmeio.aio_handle(block_size=rng.choice([4096, BLOCK, 1 << 20]),
                                queue_depth=rng.choice([2, 8, 64]),
                                intra_op_parallelism=rng.choice([1, 2]),
                                backend=ctx.backends[t % len(ctx.backends)])
        # Two files per thread: its own file, and its region of one shared file.
        own_path = os.path.join(d, f"t{t}.bin")
        open(own_path, "wb").close()
        models = {own_path: bytearray(), shared_path: bytearray(region)}
        bases = {own_path: 0, shared_path: t * region}
        done = checked = bad = 0
        try:
            for i in range(ops):
                path = rng.choice((own_path, shared_path))
                h = own if path == own_path or rng.random() < 0.5 else rng.choice(shared_handles)
                model = models[path]
                limit = region if path == shared_path else 3 * region // 2
                n = rng.choice([0, 1, 511, 4096, 4097, rng.randrange(1, 65536)])
                off = rng.randrange(0, limit - n)
                kind = rng.random()
                if kind < 0.3:       # one write, waited for at once (on a shared handle the
                    #                  wait also collects other threads' ops)
                    data = random_bytes(n, t * 100003 + i)
                    h.sync_pwrite(data, path, file_offset=bases[path] + off)
                    writes = [(off, data)]
                elif kind < 0.5:     # a batch of async writes to disjoint ranges, one wait
                    writes = []
                    for j, start in enumerate(sorted(rng.sample(range(0, limit - 65536, 65536),
                                                                rng.randint(2, 5)))):
                        data = random_bytes(rng.randrange(0, 65536), t * 100003 + i * 7 + j)
                        start += rng.randrange(0, 65536 - len(data) + 1)
                        h.async_pwrite(data, path, file_offset=bases[path] + start)
                        writes.append((start, data))
                    h.wait()
                elif kind < 0.55 and path == own_path:   # whole-file replacement
                    data = random_bytes(rng.randrange(0, region), t * 100003 + i)
                    h.write(data, own_path)
                    model[:] = data.tobytes()
                    writes = []
                else:
                    writes = []
                for start, data in writes:
                    if len(data):
                        model.extend(bytes(max(0, start + len(data) - len(model))))
                        model[start:start + len(data)] = data.tobytes()
                if kind < 0.55:
                    pass
                elif off + n <= len(model) or n == 0:
                    buf = np.zeros(n, np.uint8)
                    if rng.random() < 0.5:
                        h.sync_pread(buf, path, file_offset=bases[path] + off)
                    else:
                        h.async_pread(buf, path, file_offset=bases[path] + off)
                        h.wait()
                    checked += n
                    bad += lost(buf.tobytes(), bytes(model[off:off + n]))
                else:                # a read past what this thread wrote: only own file
                    if path == own_path:
                        try:
                            h.sync_pread(np.zeros(n, np.uint8), path, file_offset=off)
                            bad += n
                        except nvmeio.ShortReadError:
                            pass
                done += 1
            actual = file_bytes(own_path) if os.path.exists(own_path) else b""
            bad += lost(actual, bytes(models[own_path]))
            checked += len(models[own_path])
        except Exception as e:  # noqa: BLE001 - counted, the run goes on
            with lock:
                totals["errors"].append(f"thread {t}: {type(e).__name__}: {e}")
        finally:
            own.close()
        with lock:
            totals["ops"] += done
            totals["bytes_checked"] += checked
            totals["bytes_lost"] += bad
            totals["regions"] = totals.get("regions", []) + [(t, bytes(models[shared_path]))]

    before = settled_snapshot()
    started = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for p in pool:
        p.start()
    for p in pool:
        p.join(600)
    elapsed = time.perf_counter() - started
    shared = file_bytes(shared_path)
    for t, model in totals.pop("regions", []):
        totals["bytes_lost"] += lost(shared[t * region:(t + 1) * region], model)
        totals["bytes_checked"] += region
    for h in shared_handles:
        h.close()
    grown = resources.grown(before, settled_snapshot())
    row = Row(f"{threads} threads x {ops:,} mixed ops", cases=totals["ops"],
              failed=len(totals["errors"]) + (threads * ops - totals["ops"]),
              bytes_lost=totals["bytes_lost"], leaks=grown,
              detail="; ".join(totals["errors"][:3]) or
              f"{totals['bytes_checked']:,} bytes compared in {elapsed:.1f} s")
    return Section("stress", "Stress: concurrent mixed ops, byte-checked",
                   f"{threads} threads, each {ops:,} random ops (sync writes, batches of 2-5 async "
                   "writes, whole-file write(), sync and async reads, of 0 B to 64 KB at any "
                   "offset, reads past the end) on its own file and on its own 1 MiB region "
                   "of one shared file, through its own handle (random settings and backend) or "
                   "handles shared by all threads (one per backend). Every read is compared with "
                   "the thread's model; the files are compared at the end.", [row],
                   {"ops": totals["ops"], "bytes_checked": totals["bytes_checked"],
                    "seconds": round(elapsed, 1)})


# -- leaks ----------------------------------------------------------------------------------------

def leak_handles(ctx, d):
    for i in range(200):
        h = nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=2,
                              backend=ctx.backends[i % len(ctx.backends)])
        h.sync_pwrite(random_bytes(5000), os.path.join(d, "h.bin"))
        h.close()


def leak_failing_ops(ctx, d):
    h = nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=2)
    for r in range(100):
        for _ in range(10):
            h.async_pwrite(random_bytes(10_000), "/dev/full")
        with contextlib.suppress(nvmeio.AioError):
            h.wait()
    with faults.inject(fail_nth=1, fail_count=0):
        for r in range(100):
            for i in range(10):
                h.async_pwrite(random_bytes(10_000), os.path.join(d, f"f{i}.bin"))
            with contextlib.suppress(nvmeio.AioError):
                h.wait()
    h.close()


def leak_locked(ctx, d):
    h = nvmeio.aio_handle()
    for _ in range(100):
        t = h.new_cpu_locked_tensor(1 << 18, torch.empty(0, dtype=torch.float32))
        h.sync_pwrite(t, os.path.join(d, "l.bin"))
        h.free_cpu_locked_tensor(t)
        del t
    h.close()


def leak_engine_failures(ctx, d):
    for backend in ctx.backends:
        h = nvmeio.aio_handle(block_size=BLOCK, queue_depth=8, backend=backend)
        for _ in range(20):
            with faults.inject(engine_failure_nth=1):
                h.async_pwrite(random_bytes(8 * BLOCK), os.path.join(d, "e.bin"))
                with contextlib.suppress(nvmeio.AioError):
                    h.wait()
        h.close()


def leak_dropped_handles(ctx, d):
    for i in range(50):
        h = nvmeio.aio_handle(backend=ctx.backends[i % len(ctx.backends)])
        h.async_pwrite(random_bytes(5000), os.path.join(d, f"g{i % 5}.bin"))
        del h          # never closed, never waited: garbage collection must free it all


LEAK_SCENARIOS = {
    "200 handles opened, used, closed": leak_handles,
    "2,000 failing ops (/dev/full and injected)": leak_failing_ops,
    "100 locked tensors allocated, used, freed": leak_locked,
    "20 engine failures per backend, recovered": leak_engine_failures,
    "50 handles dropped with an op in flight": leak_dropped_handles,
}


def section_leaks(ctx: Context) -> Section:
    s = Section("leaks", "Leaks: fds, threads, VmLck, kernel AIO contexts",
                "Counted in /proc/self (fd, task, status VmLck, and the [aio] rings mapped into "
                "the process: system-wide fs.aio-nr would count other processes) before and "
                "after each churn, after garbage collection. Goal: 0 everywhere. Every other "
                "section is measured the same way (its rows' leak column).")
    for name, fn in LEAK_SCENARIOS.items():
        d = ctx.fresh_dir("leaks")
        before = settled_snapshot()
        error = run_guarded(lambda: fn(ctx, d))
        faults.disarm()
        after = settled_snapshot()
        grown = resources.grown(before, after)
        s.rows.append(Row(name, cases=1, failed=1 if error else 0, leaks=grown,
                          detail=error or f"after: {after.fds} fds, {after.threads} threads, "
                                          f"{after.vmlck_kib} KiB locked, {after.aio_contexts} AIO contexts"))
    return s


# -- security -------------------------------------------------------------------------------------

def sec_nul(ctx, d):
    calls = {
        "async_pread": lambda h, b, p: h.async_pread(b, p),
        "async_pwrite": lambda h, b, p: h.async_pwrite(b, p),
        "sync_pread": lambda h, b, p: h.sync_pread(b, p),
        "sync_pwrite": lambda h, b, p: h.sync_pwrite(b, p),
        "pread": lambda h, b, p: h.pread(b, p),
        "pwrite": lambda h, b, p: h.pwrite(b, p),
        "read": lambda h, b, p: h.read(b, p),
        "write": lambda h, b, p: h.write(b, p),
    }
    h = nvmeio.aio_handle()
    n = 0
    for name, call in calls.items():
        for path in (f"{d}/victim\0.ignored", os.fsencode(f"{d}/victim\0.ignored")):
            try:
                call(h, np.zeros(100, np.uint8), path)
                raise Expectation(f"{name}: a NUL path was accepted")
            except ValueError as e:
                expect("NUL byte" in str(e), f"{name}: unclear message {e}")
            expect(os.listdir(d) == [], f"{name}: a file was created")
            n += 1
    with contextlib.suppress(ValueError):
        atomic_file.write_atomically(f"{d}/victim\0.x", b"x")
        raise Expectation("atomic_file accepted a NUL path")
    expect(os.listdir(d) == [], "atomic_file created a file")
    h.close()
    return n + 1


def _predictable_names():
    names = itertools.chain(["guessed"], (f"fresh{i}" for i in itertools.count()))
    return lambda n: next(names)


@contextlib.contextmanager
def named_temporaries_with_a_guessable_name():
    """The attacker's best case: no O_TMPFILE, and the first random name known."""
    saved_flag = getattr(os, "O_TMPFILE", None)
    saved_token = atomic_file.secrets.token_hex
    if saved_flag is not None:
        del os.O_TMPFILE
    atomic_file.secrets.token_hex = _predictable_names()
    try:
        yield
    finally:
        if saved_flag is not None:
            os.O_TMPFILE = saved_flag
        atomic_file.secrets.token_hex = saved_token


def sec_planted_temp_symlink(ctx, d):
    victim = os.path.join(d, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.symlink(victim, os.path.join(d, ".model.bin.guessed.tmp"))
    h = nvmeio.aio_handle()
    with named_temporaries_with_a_guessable_name():
        h.write(random_bytes(100_000), os.path.join(d, "model.bin"))
    expect(file_bytes(victim) == b"precious", "write() followed the planted symlink")
    os.unlink(os.path.join(d, "model.bin"))
    with named_temporaries_with_a_guessable_name():
        os.replace(os.path.join(d, ".model.bin.guessed.tmp"), os.path.join(d, ".latest.guessed.tmp"))
        atomic_file.write_atomically(os.path.join(d, "latest"), b"step")
    expect(file_bytes(victim) == b"precious", "write_atomically followed the planted symlink")
    h.close()
    return 2


def sec_target_symlink(ctx, d):
    victim = os.path.join(d, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.symlink(victim, os.path.join(d, "model.bin"))
    h = nvmeio.aio_handle()
    h.write(random_bytes(1000), os.path.join(d, "model.bin"))
    expect(file_bytes(victim) == b"precious", "write() wrote through the target symlink")
    expect(not os.path.islink(os.path.join(d, "model.bin")), "the link was not replaced")
    h.close()
    return 1


def sec_read_only(ctx, d):
    shared = tempfile.mkdtemp(prefix="nvmeio-shared-")
    try:
        os.chmod(shared, 0o777)
        path = os.path.join(shared, "ro.bin")
        with open(path, "wb") as f:
            f.write(b"keep me")
        os.chmod(path, 0o444)
        h = nvmeio.aio_handle(backend="psync")
        root = os.geteuid() == 0
        if root:
            os.seteuid(65534)
        try:
            try:
                h.write(random_bytes(1000), path)
                raise Expectation("a read-only file was replaced")
            except PermissionError as e:
                expect(e.filename == path, "the error does not name the file")
        finally:
            if root:
                os.seteuid(0)
        expect(file_bytes(path) == b"keep me", "the read-only file changed")
        h.close()
    finally:
        shutil.rmtree(shared)
    return 1


def sec_directory(ctx, d):
    os.mkdir(os.path.join(d, "dir"))
    h = nvmeio.aio_handle()
    for call in (lambda: h.write(random_bytes(10), os.path.join(d, "dir")),
                 lambda: h.sync_pwrite(random_bytes(10), os.path.join(d, "dir"))):
        try:
            call()
            raise Expectation("a directory was written")
        except IsADirectoryError:
            pass
    expect(os.listdir(os.path.join(d, "dir")) == [], "something was created in the directory")
    h.close()
    return 2


def sec_sigterm(ctx, d):
    code = ("import os, signal, threading, numpy, nvmeio\n"
            "from nvmeio import faults\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the launcher set\n"
            "h = nvmeio.aio_handle(block_size=1 << 20, backend='psync')\n"
            "faults.arm(delay_us=20000)\n"
            "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
            f"h.write(numpy.ones(200 << 20, numpy.uint8), {os.path.join(d, 'big.bin')!r})\n")
    env = dict(os.environ, PYTHONSAFEPATH="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env, cwd=d)
    expect(r.returncode == -signal.SIGTERM, f"the writer was not killed: {r.stderr[-300:]}")
    expect(os.listdir(d) == [], f"SIGTERM left {os.listdir(d)}")
    return 1


def sec_lazy_views(ctx, d):
    h = nvmeio.aio_handle()
    x = torch.randn(1000, dtype=torch.complex64)
    h.write(x.conj(), os.path.join(d, "c.bin"))
    expect(file_bytes(os.path.join(d, "c.bin")) == torch.conj_physical(x).numpy().tobytes(),
           "a conjugate view was written as raw memory")
    y = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128)
    h.sync_pwrite(y.conj().imag, os.path.join(d, "n.bin"))
    expect(np.frombuffer(file_bytes(os.path.join(d, "n.bin")), np.float64).tolist() == [-2.0, 4.0],
           "a negative view was written as raw memory")
    try:
        h.sync_pread(torch.zeros(1000, dtype=torch.complex64).conj(), os.path.join(d, "c.bin"))
        raise Expectation("a read into a conjugate view was accepted")
    except ValueError as e:
        expect("conjugate view" in str(e), f"unclear message {e}")
    h.close()
    return 3


def sec_integers(ctx, d):
    cases = [
        (lambda: nvmeio.aio_handle(block_size=8 << 30), "block_size must be at most"),
        (lambda: nvmeio.aio_handle(queue_depth=1 << 40), "queue_depth must be at most"),
        (lambda: nvmeio.aio_handle(intra_op_parallelism=1 << 33), "intra_op_parallelism must be at most"),
        (lambda: nvmeio.aio_handle().sync_pwrite(np.zeros(10, np.uint8), os.path.join(d, "x"),
                                                 file_offset=1 << 63), "file_offset"),
        (lambda: nvmeio.aio_handle().sync_pwrite(np.zeros(10, np.uint8), 1 << 40), "out of range"),
        (lambda: nvmeio.aio_handle().new_cpu_locked_tensor(1 << 62, torch.empty(0)), "num_elem"),
    ]
    for fn, message in cases:
        try:
            fn()
            raise Expectation(f"accepted: expected ValueError '{message}'")
        except ValueError as e:
            expect(message in str(e), f"unclear message {e}")
    expect(os.listdir(d) == [], "a file was created")
    return len(cases)


SECURITY_CASES = {
    "NUL byte in every path argument (str and bytes)": sec_nul,
    "symlink planted at the temporary name (write, write_atomically)": sec_planted_temp_symlink,
    "target is a symlink: replaced, never written through": sec_target_symlink,
    "read-only target (as an unprivileged user)": sec_read_only,
    "directory as the target": sec_directory,
    "SIGTERM in the middle of write(): nothing left behind": sec_sigterm,
    "conjugate / negative views": sec_lazy_views,
    "integers out of range (settings, offset, fd, num_elem)": sec_integers,
}


def section_security(ctx: Context) -> Section:
    s = Section("security", "Security cases (nvmeio)",
                "Hostile-but-realistic input to the I/O layer. A case fails if anything is "
                "written outside the path the user gave, a refusal is not a clear error naming "
                "the argument, or a file is left behind.")
    for name, fn in SECURITY_CASES.items():
        d = ctx.fresh_dir("security")
        box = {}
        before = settled_snapshot()
        error = run_guarded(lambda: box.setdefault("n", fn(ctx, d)))
        grown = resources.grown(before, settled_snapshot())
        s.rows.append(Row(name, cases=box.get("n", 1), failed=1 if error else 0, leaks=grown,
                          detail=error or "refused or contained, as expected"))
    return s


from reliability_engine import section_checkpoints, section_engine  # the engine's sections

SECTIONS: List[Callable[[Context], Section]] = [
    section_faults, section_model, section_config, section_stress, section_leaks, section_security,
    section_engine, section_checkpoints,
]


# -- the report -----------------------------------------------------------------------------------

def _leaks_text(leaks: dict) -> str:
    return ", ".join(f"{k} +{v}" for k, v in leaks.items()) or "0"


def chart(sections: List[dict]) -> str:
    """bench/reliability.png: cases run and survived per section (log scale); its markdown line."""
    cases = [sum(r["cases"] for r in s["rows"]) for s in sections]
    survived = [c - sum(r["failed"] for r in s["rows"]) for c, s in zip(cases, sections)]
    png = bar_chart(CHART, "Reliability cases per section (bench/reliability.py)", [s["key"] for s in sections],
                    {"run": cases, "survived": survived}, ylabel="cases (log scale)", log_scale=True,
                    value_format="{:,.0f}")
    return chart_link(png, REPORT, "cases run and survived per section")


def render(sections: List[dict], meta: dict, chart_line: str = "") -> str:
    lines = ["# nvmeio reliability report", "",
             f"Regenerated by `python3 bench/reliability.py` on {meta['date']} "
             f"({meta['machine']}; load average {meta['loadavg']}; backends {meta['backends']}; "
             f"commit {meta['commit']}; {meta['seconds']:.0f} s{'; --quick' if meta['quick'] else ''})"
             + (f"; only {meta['only']} rerun then, the other sections kept from the run before."
                if meta.get("only") else "."),
             "", "| section | cases | survived | failed | bytes lost | leaks |", "|---|---:|---:|---:|---:|---|"]
    total = {"cases": 0, "failed": 0, "lost": 0, "leaks": {}}
    for s in sections:
        cases = sum(r["cases"] for r in s["rows"])
        failed = sum(r["failed"] for r in s["rows"])
        lost_ = sum(r["bytes_lost"] for r in s["rows"])
        leaks: Dict[str, int] = {}
        for r in s["rows"]:
            for k, v in r["leaks"].items():
                leaks[k] = leaks.get(k, 0) + v
        total["cases"] += cases
        total["failed"] += failed
        total["lost"] += lost_
        for k, v in leaks.items():
            total["leaks"][k] = total["leaks"].get(k, 0) + v
        lines.append(f"| [{s['title']}](#{s['key']}) | {cases:,} | {cases - failed:,} | {failed:,} | "
                     f"{lost_:,} | {_leaks_text(leaks)} |")
    lines.append(f"| **all** | **{total['cases']:,}** | **{total['cases'] - total['failed']:,}** | "
                 f"**{total['failed']:,}** | **{total['lost']:,}** | **{_leaks_text(total['leaks'])}** |")
    if chart_line:
        lines += ["", chart_line]
    for s in sections:
        lines += ["", f'<a id="{s["key"]}"></a>', f"## {s['title']}", "", s["about"], ""]
        if s["figures"]:
            lines += [", ".join(f"{k.replace('_', ' ')}: {v:,}" if isinstance(v, int) else
                                f"{k.replace('_', ' ')}: {v}" for k, v in s["figures"].items()) + ".", ""]
        lines += ["| case | runs | failed | bytes lost | leaks | result |", "|---|---:|---:|---:|---|---|"]
        for r in s["rows"]:
            mark = "ok" if (r["failed"] == 0 and r["bytes_lost"] == 0 and not r["leaks"]) else "**FAILED**"
            detail = r["detail"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['name']} | {r['cases']:,} | {r['failed']} | {r['bytes_lost']:,} | "
                         f"{_leaks_text(r['leaks'])} | {mark}: {detail} |")
        lines.append("")
        lines.append(f"({s['seconds']:.1f} s)")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="where scratch files go (default: a new /tmp dir)")
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("--only", default=None, help="comma-separated section keys to rerun")
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="nvmeio-reliability-", dir=args.dir)
    ctx = Context(scratch, args.quick, nvmeio.available_backends())
    wanted = set(args.only.split(",")) if args.only else None
    previous = {}
    if wanted and os.path.exists(RAW):
        with open(RAW) as f:
            previous = {s["key"]: s for s in json.load(f)["sections"]}
    with open("/proc/loadavg") as f:
        load_start = " ".join(f.read().split()[:3])
    started = time.perf_counter()
    results = []
    try:
        for fn in SECTIONS:
            key = fn.__name__.replace("section_", "")
            if wanted and key not in wanted and fn.__name__ not in wanted:
                if key in previous:
                    results.append(previous[key])
                continue
            print(f"[reliability] {key} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            section = fn(ctx)
            section.seconds = time.perf_counter() - t0
            results.append(asdict(section))
            bad = [r.name for r in section.rows if not r.ok]
            print(f"[reliability] {key}: {sum(r.cases for r in section.rows):,} cases, "
                  f"{len(bad)} rows failed {bad or ''} ({section.seconds:.1f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    if subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--",
                       ".", ":!bench/RELIABILITY.md"], capture_output=True, text=True).stdout.strip():
        commit += " + local changes"
    with open("/proc/loadavg") as f:
        loadavg = f"{load_start} at the start, {' '.join(f.read().split()[:3])} at the end"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}",
            "loadavg": loadavg, "backends": ", ".join(ctx.backends), "commit": commit,
            "seconds": time.perf_counter() - started, "quick": args.quick, "only": args.only}
    os.makedirs(os.path.dirname(RAW), exist_ok=True)
    with open(RAW, "w") as f:
        json.dump({"meta": meta, "sections": results}, f, indent=1)
    with open(REPORT, "w") as f:
        f.write(render(results, meta, chart(results)))
    failed = sum(r["failed"] + (1 if r["bytes_lost"] or r["leaks"] else 0)
                 for s in results for r in s["rows"])
    print(f"[reliability] wrote {REPORT} ({failed} failing rows)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
