"""Load: 8 threads of mixed ops on shared and own handles, byte-checked; and leaks of fds, threads,
VmLck and kernel AIO contexts around churn."""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import numpy as np
import torch

import nvmeio
from nvmeio import faults, resources

from .cases import (BLOCK, Context, Row, Section, file_bytes, lost, random_bytes, run_guarded,
                    settled_snapshot)


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
    grown = resources.grown_since(before)
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
        grown = resources.grown_since(before)
        after = resources.snapshot()
        s.rows.append(Row(name, cases=1, failed=1 if error else 0, leaks=grown,
                          detail=error or f"after: {after.fds} fds, {after.threads} threads, "
                                          f"{after.vmlck_kib} KiB locked, {after.aio_contexts} AIO contexts"))
    return s
