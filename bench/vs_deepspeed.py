"""nvmeio's aio_handle against DeepSpeed's, side by side in one process.

    /opt/dsvenv/bin/python -m bench.vs_deepspeed [--dir DIR] [--repeats 3]

Both handles get identical settings and identical page-locked buffers, each
allocated by its own handle's new_cpu_locked_tensor (DeepSpeed stages a
buffer it did not lock through a bounce copy); the two alternate within
every repeat (best of N), so disk drift hits both alike.
Rows: 1 GiB write and read at intra_op_parallelism 1/4/8 x queue_depth
32/128 (block 1 MiB, overlap_events on), and 10,000 x 64 KiB ops to 10,000
existing files and to one file at different offsets. Every nvmeio backend is
also compared with fio running the matching engine (aio: libaio, io_uring:
io_uring, psync: psync). Without deepspeed installed, says so and exits 0.
GiB/s = 2**30 bytes per second. Writes JSON (--json) and a table; --results
updates the "nvmeio vs DeepSpeed" section of bench/RESULTS.md. (Run from the repository root
by a Python with both deepspeed and nvmeio: [Note: which nvmeio a benchmark measures] in
bench/harness.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import nvmeio
from bench import harness
from bench.io_throughput import Unsupported, fio_contender, machine_info
from tools import fio

GIB = 1 << 30
SMALL, NSMALL = 64 << 10, 10_000
FIO_ENGINE = {"aio": "libaio", "io_uring": "io_uring", "psync": "psync"}
SECTION = "## nvmeio vs DeepSpeed aio_handle (bench/vs_deepspeed.py)"


def load_deepspeed_aio():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None
    return AsyncIOBuilder().load(verbose=False)


def best_of(repeats: int, fns: dict, setup=None) -> dict:
    """Runs each fn once per repeat, alternating; returns the best seconds of each."""
    best = {k: float("inf") for k in fns}
    for r in range(repeats):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for k in order:
            if setup:
                setup(k)
            t0 = time.perf_counter()
            fns[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def big_rows(ds, d: str, repeats: int, size: int) -> list[dict]:
    rows = []
    for intra in (1, 4, 8):
        for qd in (32, 128):
            ours = nvmeio.aio_handle(block_size=1 << 20, queue_depth=qd, single_submit=False,
                                     overlap_events=True, intra_op_parallelism=intra)
            theirs = ds.aio_handle(1 << 20, qd, False, True, intra)
            handle = {"nvmeio": ours, "deepspeed": theirs}
            buf = {k: h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
                   for k, h in handle.items()}
            buf["nvmeio"].random_(0, 256)
            buf["deepspeed"].copy_(buf["nvmeio"])
            # One file for both: its layout on disk (and any caching below the
            # VM) is then the same for both handles.
            shared = os.path.join(d, "big.bin")
            path = {"nvmeio": shared, "deepspeed": shared}

            def fresh(k):
                if os.path.exists(path[k]):
                    os.unlink(path[k])
                os.sync()

            def writer(k):
                return lambda: (handle[k].sync_pwrite(buf[k], path[k]))

            def reader(k):
                return lambda: (handle[k].sync_pread(buf[k], path[k]))

            names = ("nvmeio", "deepspeed")
            w_new = best_of(repeats, {k: writer(k) for k in names}, setup=fresh)
            w_over = best_of(repeats, {k: writer(k) for k in names}, setup=lambda k: os.sync())
            rd = best_of(repeats, {k: reader(k) for k in names})
            assert torch.equal(buf["nvmeio"], buf["deepspeed"]), "the two handles read different bytes"
            for what, t in (("write (new file)", w_new), ("write (overwrite)", w_over), ("read", rd)):
                rows.append({"case": f"{size >> 20} MiB {what}", "intra_op_parallelism": intra,
                             "queue_depth": qd, "nvmeio_gibps": size / GIB / t["nvmeio"],
                             "deepspeed_gibps": size / GIB / t["deepspeed"]})
            os.unlink(shared)
            for k, h in handle.items():
                h.free_cpu_locked_tensor(buf[k])
            buf.clear()  # the locked buffers go before the next size's are made
    return rows


def small_rows(ds, d: str, repeats: int) -> list[dict]:
    rows = []
    for intra in (1, 8):
        ours = nvmeio.aio_handle(block_size=1 << 20, queue_depth=32, overlap_events=True,
                                 intra_op_parallelism=intra)
        theirs = ds.aio_handle(1 << 20, 32, False, True, intra)
        handle = {"nvmeio": ours, "deepspeed": theirs}
        buf = {k: h.new_cpu_locked_tensor(NSMALL * SMALL, torch.empty(0, dtype=torch.uint8))
               for k, h in handle.items()}
        buf["nvmeio"].random_(0, 256)
        buf["deepspeed"].copy_(buf["nvmeio"])
        parts = {k: [b[i * SMALL:(i + 1) * SMALL] for i in range(NSMALL)] for k, b in buf.items()}
        for layout in ("files", "one file"):
            if layout == "files":
                targets = {k: [(os.path.join(d, f"{k}_{i}.bin"), 0) for i in range(NSMALL)]
                           for k in handle}
            else:
                targets = {k: [(os.path.join(d, f"{k}_one.bin"), i * SMALL) for i in range(NSMALL)]
                           for k in handle}
            for k in handle:                      # files exist before timing: creation is not I/O
                for p, off in targets[k]:
                    handle[k].async_pwrite(parts[k][0], p, off)
                handle[k].wait()

            def run(k, write):
                def go():
                    op = handle[k].async_pwrite if write else handle[k].async_pread
                    for part, (p, off) in zip(parts[k], targets[k]):
                        op(part, p, off)
                    handle[k].wait()
                return go

            for write in (True, False):
                t = best_of(repeats, {k: run(k, write) for k in handle}, setup=lambda k: os.sync())
                rows.append({"case": f"{NSMALL} x 64 KiB {'write' if write else 'read'}, {layout}",
                             "intra_op_parallelism": intra, "queue_depth": 32,
                             "nvmeio_gibps": NSMALL * SMALL / GIB / t["nvmeio"],
                             "deepspeed_gibps": NSMALL * SMALL / GIB / t["deepspeed"]})
            for k in handle:
                for p in {p for p, _ in targets[k]}:
                    os.unlink(p)
        buf.clear()
        parts.clear()
    return rows


def fio_rows(d: str, repeats: int, size: int) -> list[dict]:
    """Every backend at intra 1 / qd 32 (one thread, like fio's one job) vs fio's engine."""
    rows = []
    if not fio.available():
        return rows
    for backend in nvmeio.available_backends():
        engine = FIO_ENGINE[backend]
        ref = fio_contender(fio.FioJob("write", size, engine=engine),
                            fio.FioJob("read", size, engine=engine), f"fio {engine}")
        h = nvmeio.aio_handle(block_size=1 << 20, queue_depth=32, overlap_events=True,
                              backend=backend)
        buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        buf.random_(0, 256)
        p_ours, p_fio = os.path.join(d, "fio_nv.bin"), os.path.join(d, "fio_fio.bin")
        best = {"nvmeio_w": 0.0, "nvmeio_r": 0.0, "fio_w": 0.0, "fio_r": 0.0}
        try:
            for _ in range(repeats):
                for p in (p_ours, p_fio):
                    if os.path.exists(p):
                        os.unlink(p)
                os.sync()
                t0 = time.perf_counter()
                h.sync_pwrite(buf, p_ours)
                best["nvmeio_w"] = max(best["nvmeio_w"], size / (time.perf_counter() - t0))
                best["fio_w"] = max(best["fio_w"], ref.write(p_fio))
                t0 = time.perf_counter()
                h.sync_pread(buf, p_ours)
                best["nvmeio_r"] = max(best["nvmeio_r"], size / (time.perf_counter() - t0))
                best["fio_r"] = max(best["fio_r"], ref.read(p_fio))
        except Unsupported as e:
            rows.append({"backend": backend, "fio_engine": FIO_ENGINE[backend], "error": str(e)})
            continue
        finally:
            for p in (p_ours, p_fio):
                if os.path.exists(p):
                    os.unlink(p)
        rows.append({"backend": backend, "fio_engine": FIO_ENGINE[backend],
                     **{k: v / GIB for k, v in best.items()}})
    return rows


def render(rows: list[dict], fio: list[dict], info: dict, repeats: int) -> str:
    out = [f"{info['started']}, {info['nproc']} cores, kernel {info['kernel']}, {info['disk']} "
           f"({info['fstype']}), nvmeio {info['commit']} (auto backend: {info.get('backend')}), "
           f"deepspeed {info.get('deepspeed')}; load {os.getloadavg()[0]:.1f}; "
           f"best of {repeats}, alternating; GiB/s.", "",
           "| case | intra | qd | nvmeio | DeepSpeed | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["nvmeio_gibps"] / r["deepspeed_gibps"]
        out.append(f"| {r['case']} | {r['intra_op_parallelism']} | {r['queue_depth']} | "
                   f"{r['nvmeio_gibps']:.2f} | {r['deepspeed_gibps']:.2f} | {ratio:.2f}x |")
    if fio:
        out += ["", "Each backend (intra 1, qd 32, new file) against fio's default job with the matching "
                "engine (1 MiB blocks in 4 KiB-page memory, which this disk receives split into small "
                "requests: not fio at its best; the I/O throughput section compares with fio's best "
                "configuration):", "",
                "| backend | fio engine | write nvmeio / fio | read nvmeio / fio |", "|---|---|---|---|"]
        for f in fio:
            if "error" in f:
                out.append(f"| {f['backend']} | {f['fio_engine']} | {f['error']} | |")
                continue
            out.append(f"| {f['backend']} | {f['fio_engine']} | {f['nvmeio_w']:.2f} / {f['fio_w']:.2f}"
                       f" = {f['nvmeio_w'] / f['fio_w']:.2f}x | {f['nvmeio_r']:.2f} / {f['fio_r']:.2f}"
                       f" = {f['nvmeio_r'] / f['fio_r']:.2f}x |")
    return "\n".join(out)


def figures(rows: list[dict], when: str) -> list:
    """The headline: nvmeio over DeepSpeed, the range over the rows of each kind."""
    out = []
    for kind, what in (("MiB", "1 GiB ops (every intra x qd, new file, overwrite, read)"),
                       ("64 KiB", "10,000 x 64 KiB ops (files, one file)")):
        ratios = [r["nvmeio_gibps"] / r["deepspeed_gibps"] for r in rows if kind in r["case"]]
        if ratios:
            out.append(harness.Figure(f"{what}: nvmeio / DeepSpeed", f"**{min(ratios):.2f}-{max(ratios):.2f}x**",
                                      when=when))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--json", default=str(Path(__file__).parent / "out" / "vs_deepspeed.json"))
    ap.add_argument("--results", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: big,small,fio")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    ds = load_deepspeed_aio()
    if ds is None:
        print("deepspeed is not installed: nothing to compare against "
              "(pip install deepspeed==0.19.8 ninja into a separate venv)")
        return 0
    skip = set(filter(None, args.skip.split(",")))
    d = tempfile.mkdtemp(prefix="nvmeio-vs-ds-", dir=args.dir)
    try:
        info = machine_info(d)
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
        info["backend"] = nvmeio.aio_handle().get_backend()   # what "auto" means in this run
        size = args.size_mib << 20
        rows = [] if "big" in skip else big_rows(ds, d, args.repeats, size)
        rows += [] if "small" in skip else small_rows(ds, d, args.repeats)
        fio = [] if "fio" in skip else fio_rows(d, args.repeats, size)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    text = render(rows, fio, info, args.repeats)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": info, "rows": rows, "fio": fio}, indent=1))
    if args.results:
        harness.write_section(str(Path(__file__).parent / "RESULTS.md"), SECTION, figures(rows, info["when"]),
                              "python -m bench.vs_deepspeed " + " ".join(argv or []), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
