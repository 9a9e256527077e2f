"""I/O throughput: nvmeio.aio_handle against fio at its best, and the usual ways to save a tensor.

Run on purpose (under ``flock /tmp/bench.lock``), not in CI:

    python -m bench.io_throughput                          # 1 GiB in /tmp, 7 headline rounds
    python -m bench.io_throughput --dir /local_nvme --size 256M --rounds 9
    python -m bench.io_throughput --results-md bench/RESULTS.md   # also refresh that section
    python -m bench.io_throughput --gpu                    # + CUDA rows (exit 2 without CUDA)

[Note: what is compared]
The headline compares the best aio_handle configuration with fio's best
configuration (see [Note: fio's best configuration] in tools/fio.py), each
chosen by a sweep in the same run: fio's block size (1M, 4M), memory
(``malloc``: 4 KiB pages; ``mmaphuge``: huge pages, reserved for the run) and
engine (libaio, io_uring); aio_handle's block_size, intra_op_parallelism and
queue_depth. Every timing of the sweep and the headline reads or rewrites one
existing, fully allocated file of --size bytes with O_DIRECT, after ``sync``
and a page-cache drop. The headline then runs the two winners in alternating
order for --rounds rounds and reports medians (and the spread), with the load
average of each round: on a shared machine a single best-of run says more
about the neighbours than about the code.

A second table times the usual ways of saving a tensor to a *new* file
(torch.save / torch.load, numpy tofile / fromfile, aio_handle, and fio's
default job: 1 MiB blocks in 4 KiB-page memory), medians of --rounds; the
buffered writes include a final ``os.fsync``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import nvmeio
from bench import harness
from tools import fio
from tools.results_md import bar_chart, chart_link

GIB = 1 << 30
SECTION = "## I/O throughput (bench/io_throughput.py)"
# aio_handle's sweep: block_size x (intra_op_parallelism, queue_depth), default backend
AIO_BLOCKS = (1 << 20, 4 << 20, 8 << 20)
AIO_THREADS = ((1, 32), (4, 32), (8, 32), (8, 128))


# -- sizes, machine, disturbance -------------------------------------------------------

def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected e.g. 1G, 256M, 1GiB or bytes")
    n = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))
    if n <= 0 or n % (1 << 20):
        raise argparse.ArgumentTypeError(f"size {text!r}: must be a positive multiple of 1 MiB "
                                         "(fio's bs=1M)")
    return n


def fmt_size(n: int) -> str:
    return f"{n / GIB:g} GiB" if n % GIB == 0 else f"{n >> 20} MiB"


def machine_info(bench_dir: str) -> dict:
    """The run's provenance and what an I/O figure depends on besides: versions, root, memlock."""
    return {**harness.provenance(bench_dir), "torch": torch.__version__, "numpy": np.__version__,
            "nvmeio": nvmeio.__version__, "dir": bench_dir, "root": os.geteuid() == 0,
            "memlock_soft_bytes": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]}


class Disturbance:
    """CPU used by other user-space processes, and steal time, during the run.

    Load average counts our own threads in I/O wait, so it is only a fair sign
    of other load before we start; this counts the others' CPU seconds instead
    (utime+stime+cutime+cstime of every process but this one, kernel threads
    excluded).
    """

    def __init__(self) -> None:
        self.load_start = os.getloadavg()
        self.t0, self.others0 = time.monotonic(), self._others()
        self.steal0, self.total0 = self._steal()

    @staticmethod
    def _others() -> float:
        hz, me, total = os.sysconf("SC_CLK_TCK"), os.getpid(), 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ppid, flags = int(fields[1]), int(fields[6])
            if int(pid) == me or int(pid) == 2 or ppid == 2 or flags & 0x00200000:  # PF_KTHREAD
                continue
            total += sum(int(x) for x in fields[11:15])
        return total / hz

    @staticmethod
    def _steal() -> tuple[int, int]:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return cpu[7] if len(cpu) > 7 else 0, sum(cpu[:8])

    def finish(self) -> dict:
        wall = time.monotonic() - self.t0
        others = max(0.0, self._others() - self.others0)
        steal, total = self._steal()
        return {"load_avg_start": self.load_start, "load_avg_end": os.getloadavg(),
                "wall_s": round(wall, 1), "other_cpu_s": round(others, 1),
                "other_cores_avg": round(others / wall, 2) if wall else 0.0,
                "steal_pct": round(100 * (steal - self.steal0) / max(1, total - self.total0), 1)}


class DiskStats:
    """Average request size at the block device, from /sys/class/block/<dev>/stat.

    Shows what reached the disk after the block layer merged or split our
    requests. Counts the whole device, so other processes' I/O mixes in.
    """

    def __init__(self, source: str) -> None:
        name = os.path.basename(os.path.realpath(source)) if source.startswith("/dev/") else ""
        self.path = f"/sys/class/block/{name}/stat" if name else ""
        if self.path and not os.path.exists(self.path):
            self.path = ""

    def sample(self) -> tuple[int, int, int, int] | None:
        """(read requests, read sectors, write requests, write sectors) or None."""
        if not self.path:
            return None
        with open(self.path) as f:
            v = [int(x) for x in f.read().split()]
        return v[0], v[2], v[4], v[6]

    @staticmethod
    def avg_kib(before, after, write: bool) -> float | None:
        if before is None or after is None:
            return None
        i = 2 if write else 0
        ios, sectors = after[i] - before[i], after[i + 1] - before[i + 1]
        return sectors / 2 / ios if ios else None


# -- contenders ------------------------------------------------------------------------

@dataclass
class Contender:
    """A way to write and read ``path``; each returns bytes/s (timing only the I/O)."""

    name: str
    settings: str
    write: Callable[[str], float]
    read: Callable[[str], float]
    kind: str = "baseline"               # "fio", "aio_handle" or "baseline"
    status: str = "ok"
    writes: list = field(default_factory=list)
    reads: list = field(default_factory=list)
    loads: list = field(default_factory=list)          # 1-min load average after each round
    write_req_kib: list = field(default_factory=list)  # average request at the disk
    read_req_kib: list = field(default_factory=list)

    @staticmethod
    def median(samples: list) -> float | None:
        return statistics.median(samples) / GIB if samples else None


class Unsupported(Exception):
    """The contender cannot run here; its row says why and it is skipped."""


def timed(nbytes: int, fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0)


def fsync_write(path: str, dump: Callable[[object], None]) -> None:
    with open(path, "wb") as f:
        dump(f)
        f.flush()
        os.fsync(f.fileno())


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.device != want.device:
        got = got.to(want.device)
    if got.numel() != want.numel() or not torch.equal(got.view(-1), want.view(-1)):
        raise AssertionError(f"{what}: the bytes read back differ from those written")


def fio_contender(job_write: fio.FioJob, job_read: fio.FioJob, name: str = "fio") -> Contender:
    def run(job: fio.FioJob, path: str) -> float:
        try:
            return fio.run(job, path)
        except fio.FioError as e:
            raise Unsupported(str(e)) from None

    settings = job_write.label() + ("" if job_write.fallocate else ", fallocate=none")
    return Contender(name, settings, lambda p: run(job_write, p), lambda p: run(job_read, p), "fio")


def aio_contender(src: torch.Tensor, dst: torch.Tensor, backend: str, block: int, intra: int,
                  qd: int) -> Contender:
    handle = nvmeio.aio_handle(block_size=block, queue_depth=qd, intra_op_parallelism=intra,
                               backend=backend)
    nbytes = src.numel() * src.element_size()

    def read(path: str) -> float:
        dst.zero_()
        bps = timed(nbytes, lambda: handle.sync_pread(dst, path))
        check_equal(dst, src, f"aio_handle {backend} bs {block} intra {intra} qd {qd}")
        return bps

    return Contender(f"aio_handle {backend}", f"bs {block >> 20}M, intra {intra}, qd {qd}",
                     lambda p: timed(nbytes, lambda: handle.sync_pwrite(src, p)), read,
                     "aio_handle")


def torch_contender(src: torch.Tensor) -> Contender:
    def read(path: str) -> float:
        out = {}
        bps = timed(src.numel(), lambda: out.setdefault("t", torch.load(path, weights_only=True)))
        check_equal(out["t"], src, "torch.load")
        return bps

    def write(path: str) -> float:
        return timed(src.numel(), lambda: fsync_write(path, lambda f: torch.save(src, f)))

    return Contender("torch.save / torch.load", "buffered, write + fsync", write, read)


def numpy_contender(src: torch.Tensor) -> Contender:
    arr = src.numpy()

    def read(path: str) -> float:
        out = {}
        bps = timed(arr.nbytes, lambda: out.setdefault("a", np.fromfile(path, dtype=np.uint8)))
        check_equal(torch.from_numpy(out["a"]), src, "numpy.fromfile")
        return bps

    return Contender("numpy tofile / fromfile", "buffered, write + fsync",
                     lambda p: timed(arr.nbytes, lambda: fsync_write(p, arr.tofile)), read)


def gpu_contenders(src: torch.Tensor, backend: str, intra: int, qd: int,
                   device: str = "cuda") -> list[Contender]:
    gsrc = src.to(device)
    gdst = torch.empty_like(gsrc)
    nbytes = gsrc.numel()
    handle = nvmeio.aio_handle(queue_depth=qd, intra_op_parallelism=intra, backend=backend)

    def refusal(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            try:
                fn()
            except (TypeError, ValueError, NotImplementedError) as e:
                raise Unsupported(f"unsupported: aio_handle refuses CUDA tensors ({e})") from None
            torch.cuda.synchronize()
        return call

    def aio_read(path: str) -> float:
        gdst.zero_()
        torch.cuda.synchronize()
        bps = timed(nbytes, refusal(lambda: handle.sync_pread(gdst, path)))
        check_equal(gdst, gsrc, "aio_handle CUDA read")
        return bps

    def naive_read(path: str) -> float:
        out = {}
        def load() -> None:
            out["t"] = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to(device)
            torch.cuda.synchronize()
        bps = timed(nbytes, load)
        check_equal(out["t"], gsrc, "naive CUDA read")
        return bps

    def naive_write(path: str) -> float:
        return timed(nbytes, lambda: fsync_write(path, gsrc.cpu().numpy().tofile))

    return [
        Contender(f"aio_handle {backend} (CUDA tensor)", f"intra {intra}, qd {qd}",
                  lambda p: timed(nbytes, refusal(lambda: handle.sync_pwrite(gsrc, p))), aio_read,
                  "aio_handle"),
        Contender("CUDA .cpu() + numpy tofile/fromfile", "buffered, write + fsync",
                  naive_write, naive_read),
    ]


# -- the run -----------------------------------------------------------------------------

def one(c: Contender, path: str, disk: DiskStats, which: str, new_file: bool) -> None:
    """Times one write or read of ``c`` on ``path`` (page cache dropped first)."""
    if c.status != "ok":
        return
    try:
        if which == "write" and new_file and os.path.exists(path):
            os.unlink(path)
        fio.drop_page_cache(path)
        s0 = disk.sample()
        bps = c.write(path) if which == "write" else c.read(path)
        s1 = disk.sample()
    except Unsupported as e:
        c.status = str(e)
        print(f"  {c.name} [{c.settings}]: {e}", file=sys.stderr)
        return
    except AssertionError as e:
        c.status = f"WRONG DATA: {e}"
        print(f"  {c.name} [{c.settings}]: {c.status}", file=sys.stderr)
        return
    (c.writes if which == "write" else c.reads).append(bps)
    kib = DiskStats.avg_kib(s0, s1, which == "write")
    if kib is not None:
        (c.write_req_kib if which == "write" else c.read_req_kib).append(kib)


def alternate(contenders: list, rounds: int, path: str, disk: DiskStats, which: str,
              new_file: bool, verbose: bool, label: str) -> None:
    """``rounds`` rounds, each contender once per round, the order rotating."""
    for r in range(rounds):
        n = len(contenders)
        for k in range(n):
            c = contenders[(r + k) % n]
            if new_file:  # each contender writes its own file and reads it back
                own = f"{path}.{id(c)}"
                one(c, own, disk, "write", True)
                one(c, own, disk, "read", False)
                if os.path.exists(own):
                    os.unlink(own)
            else:
                one(c, path, disk, which, False)
            c.loads.append(os.getloadavg()[0])
        if verbose:
            print(f"  {label} round {r + 1}/{rounds} done (load {os.getloadavg()[0]:.2f})",
                  flush=True)


def best(contenders: list, samples: str):
    ok = [c for c in contenders if getattr(c, samples)]
    return max(ok, key=lambda c: statistics.median(getattr(c, samples)), default=None)


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def spread(samples: list) -> str:
    return f"{min(samples) / GIB:.2f}–{max(samples) / GIB:.2f}" if samples else "—"


def mean_kib(samples: list) -> str:
    return f"{sum(samples) / len(samples):.0f}" if samples else "?"


def sweep_table(contenders: list, rounds: int) -> str:
    lines = [f"| contender | settings | write GiB/s (median of {rounds}) | read GiB/s (median of "
             f"{rounds}) | disk request KiB (w / r) |", "|---|---|---:|---:|---:|"]
    for c in contenders:
        if c.status != "ok" and not c.writes and not c.reads:
            lines.append(f"| {c.name} | {c.settings} | {c.status[:120]} | | |")
            continue
        lines.append(f"| {c.name} | {c.settings} | {fmt(c.median(c.writes))} | "
                     f"{fmt(c.median(c.reads))} | {mean_kib(c.write_req_kib)} / "
                     f"{mean_kib(c.read_req_kib)} |")
    return "\n".join(lines)


def headline(pairs: dict, rounds: int) -> tuple:
    """(table, lines, numbers) for the best fio vs the best aio_handle, per direction."""
    table = ["| direction | fio at its best | GiB/s median (range) | aio_handle at its best | "
             "GiB/s median (range) | aio_handle / fio (medians) | load average during rounds |",
             "|---|---|---:|---|---:|---:|---|"]
    numbers, lines = {}, []
    for which, (f, a) in pairs.items():
        fs, as_ = getattr(f, which + "s"), getattr(a, which + "s")
        if not fs or not as_:
            table.append(f"| {which} | {f.settings} | {f.status} | {a.settings} | {a.status} | — | |")
            continue
        fm, am = statistics.median(fs) / GIB, statistics.median(as_) / GIB
        loads = f.loads[-rounds:] + a.loads[-rounds:]
        table.append(f"| {which} | {f.name}: {f.settings} | {fm:.2f} ({spread(fs)}) | "
                     f"{a.settings} | {am:.2f} ({spread(as_)}) | **{am / fm:.2f}** | "
                     f"{min(loads):.1f}–{max(loads):.1f} |")
        numbers[which] = {"fio_gibs": fm, "aio_gibs": am, "ratio": am / fm,
                          "fio": f.settings, "aio": a.settings,
                          "fio_samples": [x / GIB for x in fs], "aio_samples": [x / GIB for x in as_],
                          "load_min": min(loads), "load_max": max(loads)}
    return "\n".join(table), lines, numbers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test (a temp dir is made inside it; "
                    "default: /tmp)")
    ap.add_argument("--size", type=parse_size, default=GIB,
                    help="bytes per file: 1G, 256M (default 1G)")
    ap.add_argument("--sweep-rounds", type=int, default=2,
                    help="rounds of the configuration sweep (default 2)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="alternating rounds of the headline and of the new-file table (default 7)")
    ap.add_argument("--json", default=os.path.join(harness.ROOT, "bench", "out", "io_throughput.json"),
                    help="where to write all results (default bench/out/io_throughput.json)")
    ap.add_argument("--results-md", help="also replace the I/O throughput section of this file "
                    "(e.g. bench/RESULTS.md) with this run's tables and chart")
    ap.add_argument("--gpu", action="store_true", help="add CUDA-tensor rows (needs CUDA)")
    ap.add_argument("--quiet", action="store_true", help="no per-round lines")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.sweep_rounds < 1:
        ap.error("--rounds and --sweep-rounds must be at least 1")
    if args.gpu and not torch.cuda.is_available():
        print(f"--gpu: torch.cuda.is_available() is False (torch {torch.__version__}); there is no "
              "CUDA device to time here. Run without --gpu for the CPU rows.", file=sys.stderr)
        return 2
    if not fio.available():
        print("fio is not installed (apt-get install -y fio): there is nothing to compare with.",
              file=sys.stderr)
        return 2
    bench_dir = tempfile.mkdtemp(prefix="nvmeio-io-throughput-", dir=args.dir or "/tmp")
    huge = None
    try:
        try:
            huge = fio.reserve_huge_pages(fio.buffer_bytes(fio.sweep_jobs("read", args.size)))
        except (OSError, RuntimeError) as e:
            print(f"note: no huge pages for fio --mem=mmaphuge ({e}); those rows will say so",
                  file=sys.stderr)
        return run(args, bench_dir, huge is not None)
    finally:
        if huge is not None:
            fio.restore_huge_pages(huge)
        for f in os.listdir(bench_dir):
            os.unlink(os.path.join(bench_dir, f))
        os.rmdir(bench_dir)


def run(args: argparse.Namespace, bench_dir: str, huge: bool) -> int:
    info = machine_info(bench_dir)
    backend = nvmeio.available_backends()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alloc = nvmeio.aio_handle()
        src = alloc.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
        dst = alloc.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
    locked = alloc.is_pinned(src)
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    src.random_(0, 256)  # incompressible, and every block differs
    dst.zero_()          # touch the pages now, not inside a timing
    disk = DiskStats(info["disk"])
    disturb = Disturbance()
    verbose = not args.quiet

    # 1. the sweep, on one existing file
    existing = os.path.join(bench_dir, "existing.bin")
    alloc.sync_pwrite(src, existing)
    fio_rows = [fio_contender(w, r) for w, r in zip(fio.sweep_jobs("write", args.size),
                                                     fio.sweep_jobs("read", args.size))]
    aio_rows = [aio_contender(src, dst, backend, bs, intra, qd)
                for bs in AIO_BLOCKS for intra, qd in AIO_THREADS]
    sweep = fio_rows + aio_rows
    for which in ("write", "read"):
        if which == "read":
            alloc.sync_pwrite(src, existing)  # fio's writes left fio's bytes; ours are checked
        alternate(sweep, args.sweep_rounds, existing, disk, which, False, verbose, f"sweep {which}")

    # 2. the headline: the winners, alternating
    pairs = {}
    for which in ("write", "read"):
        f, a = best(fio_rows, which + "s"), best(aio_rows, which + "s")
        if f is None or a is None:
            print(f"no {which} result for fio or aio_handle; see the sweep", file=sys.stderr)
            return 1
        pair = [dataclass_copy(f), dataclass_copy(a)]
        if which == "read":
            alloc.sync_pwrite(src, existing)
        alternate(pair, args.rounds, existing, disk, which, False, verbose, f"headline {which}")
        pairs[which] = tuple(pair)
    head_table, _, numbers = headline(pairs, args.rounds)

    # 3. new files: the usual ways to save a tensor
    others = [fio_contender(fio.FioJob("write", args.size), fio.FioJob("read", args.size),
                            "fio default job"),
              aio_contender(src, dst, backend, _best_block(pairs),
                            *_best_threads(pairs)),
              torch_contender(src), numpy_contender(src)]
    if args.gpu:
        others += gpu_contenders(src, backend, 8, 32)
    alternate(others, args.rounds, os.path.join(bench_dir, "new"), disk, "write", True, verbose,
              "new files")
    disturbance = disturb.finish()

    d = disturbance
    conditions = (
        f"{fmt_size(args.size)} per op; GiB/s = 1024³ bytes/s. Page cache dropped (sync; echo 3 > "
        "drop_caches) before every timing. Buffers: "
        + ("page-locked" if locked else "page-aligned, NOT locked (memlock limit)")
        + " tensors from new_cpu_locked_tensor for aio_handle; fio allocates its own "
        + ("(huge pages reserved for --mem=mmaphuge)." if huge else "(no huge pages could be "
                                                                    "reserved).")
        + f" Machine: {info['nproc']} CPUs, kernel {info['kernel']}, {info['disk']} "
        f"({info['fstype']}), nvmeio {info['commit']}, {info['fio']}. Load average "
        f"{d['load_avg_start'][0]:.2f} at the start, {d['load_avg_end'][0]:.2f} at the end; "
        f"other processes used {d['other_cores_avg']} cores on average over {d['wall_s']} s "
        "(the machine is shared: compare within this run only).")
    lines = [
        "**Headline** — aio_handle against fio, each in its best configuration found by the "
        f"sweep below, on the same existing {fmt_size(args.size)} file, {args.rounds} "
        "alternating rounds, medians:", "", head_table, "",
        conditions, "",
        f"**Sweep** (existing file, {args.sweep_rounds} alternating rounds, medians; fio's "
        "block size x memory x engine, aio_handle's block_size x threads x queue depth, backend "
        f"{backend}):", "", sweep_table(sweep, args.sweep_rounds), "",
        f"**New files** — writing a tensor to a new file and reading it back ({args.rounds} "
        "rounds, medians; buffered writes include os.fsync; fio's default job is 1 MiB blocks "
        "in 4 KiB-page memory, into a file it preallocates):", "",
        sweep_table(others, args.rounds),
    ]
    text = "\n".join(lines)
    print()
    print(text)

    result = {"machine": info, "disturbance": disturbance, "huge_pages": huge,
              "config": {"size": args.size, "rounds": args.rounds,
                         "sweep_rounds": args.sweep_rounds, "backend": backend,
                         "buffer_locked": locked, "gpu": args.gpu},
              "headline": numbers,
              "rows": [{"name": c.name, "settings": c.settings, "kind": c.kind,
                        "status": c.status, "table": table_name,
                        "write_samples_gibs": [x / GIB for x in c.writes],
                        "read_samples_gibs": [x / GIB for x in c.reads], "loads": c.loads,
                        "write_request_kib": c.write_req_kib, "read_request_kib": c.read_req_kib}
                       for table_name, rows in (("sweep", sweep), ("new files", others))
                       for c in rows]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")

    if args.results_md:
        md = Path(args.results_md)
        png = bar_chart(md.parent / "io_throughput.png",
                        f"{fmt_size(args.size)}, existing file, medians of {args.rounds} rounds",
                        ["write", "read"],
                        {"fio at its best": [numbers[k]["fio_gibs"] for k in ("write", "read")],
                         "aio_handle at its best": [numbers[k]["aio_gibs"]
                                                    for k in ("write", "read")]})
        cmd = " ".join(["flock /tmp/bench.lock python -m bench.io_throughput"] + sys.argv[1:])
        body = "\n".join([f"Latest run: {info['started']} on {info['host']}, commit {info['commit']}.", "", text, "",
                          chart_link(png, md, "aio_handle vs fio at their best")])
        figures = [harness.Figure(f"{which}: aio_handle / fio, each at its best ({n['aio_gibs']:.2f} / "
                                  f"{n['fio_gibs']:.2f} GiB/s, {fmt_size(args.size)} existing file)",
                                  f"**{n['ratio']:.2f}x**", when=info["when"]) for which, n in numbers.items()]
        harness.write_section(args.results_md, SECTION, figures, cmd, body)
        print(f"updated the section in {args.results_md}")
    bad = [c for c in sweep + others if c.status.startswith("WRONG DATA")]
    return 1 if bad else 0


def dataclass_copy(c: Contender) -> Contender:
    """The same contender with fresh sample lists (the headline's own)."""
    return Contender(c.name, c.settings, c.write, c.read, c.kind)


def _best_threads(pairs: dict) -> tuple:
    m = re.search(r"intra (\d+), qd (\d+)", pairs["write"][1].settings)
    return int(m.group(1)), int(m.group(2))


def _best_block(pairs: dict) -> int:
    return int(re.search(r"bs (\d+)M", pairs["write"][1].settings).group(1)) << 20


if __name__ == "__main__":
    sys.exit(main())
