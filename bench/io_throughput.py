"""I/O throughput: nvmeio.aio_handle against fio, torch.save/load and numpy tofile/fromfile.

A plain script, run on purpose on an idle machine (not in CI):

    python3 bench/io_throughput.py                          # 1 GiB, best of 3, in /tmp
    python3 bench/io_throughput.py --dir /local_nvme --size 256M --repeats 5
    python3 bench/io_throughput.py --results-md bench/RESULTS.md   # also refresh that section
    python3 bench/io_throughput.py --gpu                    # + CUDA rows (exit 2 without CUDA)

Every contender writes one buffer of --size bytes to a new file and reads it
back. Rows are printed as a markdown table and written, with machine info and
every sample, to --json. The goal on our dev machine: the best aio_handle read
and write each at least 0.9x fio's (libaio) of the same run.

[Note: what a timing measures]
Each write goes to a file that does not exist yet (unlinked first), as
``torch.save`` or a fresh swap file would. O_DIRECT writes (aio_handle, fio)
are timed until the last request completes; the buffered ones (torch.save,
numpy.tofile) include a final ``os.fsync`` so that they, too, count bytes that
reached the disk, not bytes copied into the page cache. Before every write and
every read, untimed: ``sync`` and a page-cache drop (root; otherwise
``posix_fadvise(DONTNEED)`` on the file), so no read is served from memory.
fio's ``bw_bytes`` is its own measurement, without process start-up. Note that
fio by default ``fallocate``s its file before timing; the "no prealloc" fio row
writes like everyone else here, into a growing file, which on ext4 is much
slower for O_DIRECT. Rounds go round-robin (a different first contender each
repeat) so that drift of a noisy disk hits all contenders alike; a row shows
the best of --repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import replace_section  # noqa: E402

GIB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
SECTION = "## I/O throughput (bench/io_throughput.py)"
# (intra_op_parallelism, queue_depth) of the aio_handle rows
GRID = [(intra, qd) for intra in (1, 4, 8) for qd in (32, 128)]
BEST_SETTING = (8, 32)  # where every backend gets a row


# -- sizes, cache, machine -----------------------------------------------------------

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


class PageCache:
    """Flushes dirty pages and evicts the file's clean ones before a timing."""

    def __init__(self) -> None:
        self.can_drop = False
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            self.can_drop = True
        except OSError:
            pass

    def settle(self, path: str | None = None) -> None:
        os.sync()
        if self.can_drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
        elif path and os.path.exists(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def describe(self) -> str:
        if self.can_drop:
            return "page cache dropped (sync; echo 3 > drop_caches) before every write and read"
        return ("page cache NOT dropped (not root): sync + posix_fadvise(DONTNEED) on the file "
                "instead, which evicts only its clean pages")


def run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def machine_info(bench_dir: str) -> dict:
    df = run_text(["df", "-P", "-T", bench_dir]).splitlines()
    source, fstype = (df[-1].split()[:2] if len(df) > 1 else ("?", "?"))
    commit = run_text(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = bool(run_text(["git", "-C", str(REPO), "status", "--porcelain", "-uno"]))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(), "nproc": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "nvmeio": nvmeio.__version__, "commit": commit + ("+dirty" if dirty else ""),
        "fio": run_text(["fio", "--version"]) if shutil.which("fio") else None,
        "dir": bench_dir, "disk": source, "fstype": fstype, "df": "\n".join(df),
        "root": os.geteuid() == 0,
        "memlock_soft_bytes": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
    }


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
    name: str
    settings: str
    write: Callable[[str], float]       # path -> bytes/s
    read: Callable[[str], float]        # path -> bytes/s
    kind: str = "baseline"              # "aio_handle" rows get ratios vs fio
    in_goal: bool = False               # counts for "best aio_handle vs fio" (same work as fio)
    status: str = "ok"
    writes: list[float] = field(default_factory=list)
    reads: list[float] = field(default_factory=list)
    write_req_kib: list[float] = field(default_factory=list)  # average request at the disk
    read_req_kib: list[float] = field(default_factory=list)

    def best(self, samples: list[float]) -> float | None:
        return max(samples) / GIB if samples else None


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


def fio_contender(engine: str, size: int, prealloc: bool = True) -> Contender:
    def job(path: str, rw: str) -> float:
        cmd = ["fio", "--name=nvmeio-bench", f"--filename={path}", f"--rw={rw}",
               f"--ioengine={engine}", "--direct=1", "--bs=1M", "--iodepth=32", f"--size={size}",
               "--numjobs=1", "--output-format=json"]
        if not prealloc:
            cmd.append("--fallocate=none")
        p = subprocess.run(cmd, capture_output=True, text=True)
        out = p.stdout[p.stdout.find("{"):] if "{" in p.stdout else ""
        try:
            result = json.loads(out)["jobs"][0]
        except (ValueError, KeyError, IndexError):
            raise Unsupported(f"fio {engine} failed (rc {p.returncode}): "
                              f"{(p.stderr or p.stdout).strip()[-300:]}") from None
        if result.get("error"):
            raise Unsupported(f"fio {engine} job error {result['error']}: "
                              f"{p.stderr.strip()[-300:]}")
        return float(result[rw]["bw_bytes"])

    settings = "direct, bs 1M, iodepth 32" + ("" if prealloc else ", fallocate=none")
    name = f"fio {engine}" + ("" if prealloc else " (no prealloc)")
    return Contender(name, settings, lambda p: job(p, "write"), lambda p: job(p, "read"), "fio")


def aio_contender(src: torch.Tensor, dst: torch.Tensor, backend: str, intra: int, qd: int,
                  overwrite: bool = False) -> Contender:
    handle = nvmeio.aio_handle(block_size=1 << 20, queue_depth=qd, intra_op_parallelism=intra,
                               backend=backend)
    nbytes = src.numel() * src.element_size()

    def write(path: str) -> float:
        if overwrite:  # untimed first pass, so the timed one rewrites allocated blocks
            handle.sync_pwrite(src, path)
            os.sync()
        return timed(nbytes, lambda: handle.sync_pwrite(src, path))

    def read(path: str) -> float:
        dst.zero_()
        bps = timed(nbytes, lambda: handle.sync_pread(dst, path))
        check_equal(dst, src, f"aio_handle {backend} intra {intra} qd {qd}")
        return bps

    name = f"aio_handle {backend}" + (" (overwrite)" if overwrite else "")
    settings = f"intra {intra}, qd {qd}" + (", existing file" if overwrite else "")
    return Contender(name, settings, write, read, "aio_handle", in_goal=not overwrite)


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

def run_round(contenders: list[Contender], order: list[int], bench_dir: str, cache: PageCache,
              disk: DiskStats, verbose: bool) -> None:
    for i in order:
        c = contenders[i]
        if c.status != "ok":
            continue
        path = os.path.join(bench_dir, f"c{i}.bin")
        try:
            cache.settle()
            s0 = disk.sample()
            w = c.write(path)
            s1 = disk.sample()
            cache.settle(path)
            s2 = disk.sample()
            r = c.read(path)
            s3 = disk.sample()
        except Unsupported as e:
            c.status = str(e)
            print(f"  {c.name} [{c.settings}]: {e}", file=sys.stderr)
            continue
        except AssertionError as e:
            c.status = f"WRONG DATA: {e}"
            print(f"  {c.name} [{c.settings}]: {c.status}", file=sys.stderr)
            continue
        finally:
            if os.path.exists(path):
                os.unlink(path)
        c.writes.append(w)
        c.reads.append(r)
        for samples, kib in ((c.write_req_kib, DiskStats.avg_kib(s0, s1, True)),
                             (c.read_req_kib, DiskStats.avg_kib(s2, s3, False))):
            if kib is not None:
                samples.append(kib)
        if verbose:
            print(f"  {c.name:<36} {c.settings:<42} "
                  f"write {w / GIB:6.2f}  read {r / GIB:6.2f} GiB/s", flush=True)


def ratios(contenders: list[Contender]) -> dict:
    by_name = {c.name: c for c in contenders}
    fio, fio_np = by_name.get("fio libaio"), by_name.get("fio libaio (no prealloc)")
    out: dict = {}
    fresh = [c for c in contenders if c.in_goal and c.writes]
    for key, samples in (("write", "writes"), ("read", "reads")):
        best = max(fresh, key=lambda c: max(getattr(c, samples)), default=None)
        ref = fio.best(getattr(fio, samples)) if fio else None
        ref_np = fio_np.best(getattr(fio_np, samples)) if fio_np else None
        if best is None:
            continue
        gibs = best.best(getattr(best, samples))
        out[key] = {"aio_gibs": gibs, "aio_row": f"{best.name}, {best.settings}", "fio_gibs": ref,
                    "ratio": gibs / ref if ref else None,
                    "ratio_vs_no_prealloc": gibs / ref_np if ref_np else None}
    return out


def row_ratio(c: Contender, fio: Contender | None, samples: str) -> str:
    if c.kind != "aio_handle" or fio is None:
        return "—"
    if not getattr(c, samples) or not getattr(fio, samples):
        return "—"
    return f"{max(getattr(c, samples)) / max(getattr(fio, samples)):.2f}"


def table(contenders: list[Contender]) -> str:
    fio = next((c for c in contenders if c.name == "fio libaio"), None)
    lines = ["| contender | settings | write GiB/s | read GiB/s | write / fio | read / fio "
             "| disk request KiB (w / r) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for c in contenders:
        w, r = c.best(c.writes), c.best(c.reads)
        if w is None:
            lines.append(f"| {c.name} | {c.settings} | {c.status} | | | | |")
            continue
        lines.append(f"| {c.name} | {c.settings} | {w:.2f} | {r:.2f} | "
                     f"{row_ratio(c, fio, 'writes')} | {row_ratio(c, fio, 'reads')} | "
                     f"{mean_kib(c.write_req_kib)} / {mean_kib(c.read_req_kib)} |")
    return "\n".join(lines)


def mean_kib(samples: list[float]) -> str:
    return f"{sum(samples) / len(samples):.0f}" if samples else "?"


def ratio_lines(r: dict, fio_missing: bool) -> list[str]:
    if fio_missing:
        return ["- ratios vs fio: n/a (fio is not installed)"]
    lines = []
    for key in ("write", "read"):
        x = r.get(key)
        if not x or x["ratio"] is None:
            lines.append(f"- best aio_handle {key} / fio libaio {key}: n/a")
            continue
        verdict = "meets" if x["ratio"] >= 0.9 else "MISSES"
        extra = (f"; vs fio without prealloc {x['ratio_vs_no_prealloc']:.2f}"
                 if x["ratio_vs_no_prealloc"] else "")
        lines.append(f"- best aio_handle {key} / fio libaio {key}: **{x['ratio']:.2f}** "
                     f"({x['aio_gibs']:.2f} / {x['fio_gibs']:.2f} GiB/s, {x['aio_row']}; "
                     f"{verdict} the 0.9 goal{extra})")
    return lines


def header_lines(args: argparse.Namespace, info: dict, cache: PageCache, locked: bool) -> list[str]:
    return [
        f"{fmt_size(args.size)} per file, best of {args.repeats}, round-robin order; "
        "GiB/s = 1024³ bytes per second.",
        f"{cache.describe()}. torch.save and numpy.tofile timings include a final os.fsync; "
        "O_DIRECT writes (aio_handle, fio) are timed to the last completion. Every write makes "
        "a new file (but the overwrite row); fio preallocates it (fallocate) unless marked "
        "no prealloc.",
        "Buffer: " + ("page-locked" if locked else "page-aligned but NOT locked (memlock limit)") +
        f" tensor from new_cpu_locked_tensor. Machine: {info['nproc']} CPUs, kernel "
        f"{info['kernel']}, --dir on {info['disk']} ({info['fstype']}), nvmeio {info['commit']}.",
        "Ratios are against fio libaio of this run. Disk request KiB: the average request size "
        "that reached the device after the block layer merged or split ours (whole-disk "
        "counters, so other processes' I/O mixes in).",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to test (a temp dir is made inside it; "
                    "default: /tmp)")
    ap.add_argument("--size", type=parse_size, default=GIB,
                    help="bytes per file: 1G, 256M (default 1G)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N rounds (default 3)")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "io_throughput.json"),
                    help="where to write all results (default bench/out/io_throughput.json)")
    ap.add_argument("--results-md", help="also replace the I/O throughput section of this file "
                    "(e.g. bench/RESULTS.md) with this run's table")
    ap.add_argument("--gpu", action="store_true", help="add CUDA-tensor rows (needs CUDA)")
    ap.add_argument("--quiet", action="store_true", help="no per-round lines")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.gpu and not torch.cuda.is_available():
        print(f"--gpu: torch.cuda.is_available() is False (torch {torch.__version__}); there is no "
              "CUDA device to time here. Run without --gpu for the CPU rows.", file=sys.stderr)
        return 2

    bench_dir = tempfile.mkdtemp(prefix="nvmeio-io-throughput-", dir=args.dir or "/tmp")
    try:
        return run(args, bench_dir)
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)


def run(args: argparse.Namespace, bench_dir: str) -> int:
    info = machine_info(bench_dir)
    cache = PageCache()
    backends = nvmeio.available_backends()
    default_backend = backends[0]
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

    fio_ok = shutil.which("fio") is not None
    contenders: list[Contender] = []
    if fio_ok:
        contenders += [fio_contender("libaio", args.size),
                       fio_contender("libaio", args.size, prealloc=False),
                       fio_contender("io_uring", args.size)]
    contenders += [aio_contender(src, dst, default_backend, i, q) for i, q in GRID]
    contenders += [aio_contender(src, dst, b, *BEST_SETTING)
                   for b in backends if b != default_backend]  # the default one is in GRID
    contenders.append(aio_contender(src, dst, default_backend, *BEST_SETTING, overwrite=True))
    contenders += [torch_contender(src), numpy_contender(src)]
    if args.gpu:
        contenders += gpu_contenders(src, default_backend, *BEST_SETTING)

    head = header_lines(args, info, cache, locked)
    print("\n".join(head))
    if not fio_ok:
        print("fio is not installed: no fio rows and no ratios.")
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"warning: load average {load1:.2f} before the run; the machine is not idle.")

    disk = DiskStats(info["disk"])
    disturb = Disturbance()
    for rep in range(args.repeats):
        n = len(contenders)
        order = [(rep + k) % n for k in range(n)]
        if not args.quiet:
            print(f"round {rep + 1}/{args.repeats}", flush=True)
        run_round(contenders, order, bench_dir, cache, disk, not args.quiet)
    disturbance = disturb.finish()

    r = ratios(contenders)
    tbl = table(contenders)
    d = disturbance
    quiet_line = (f"Load average {d['load_avg_start'][0]:.2f} at start, "
                  f"{d['load_avg_end'][0]:.2f} at end (our own I/O wait counts); other processes "
                  f"used {d['other_cpu_s']} CPU-s (avg {d['other_cores_avg']} cores) over "
                  f"{d['wall_s']} s; steal {d['steal_pct']}%.")
    if d["other_cores_avg"] > 0.2 or d["load_avg_start"][0] > 0.5:
        quiet_line += " **Disturbed run: the machine was not idle; compare rows only within it.**"
    rlines = ratio_lines(r, not fio_ok)
    print()
    print(tbl)
    print()
    print("\n".join(rlines))
    print(quiet_line)

    result = {
        "machine": info, "disturbance": disturbance,
        "config": {"size": args.size, "repeats": args.repeats, "block_size": 1 << 20,
                   "page_cache_dropped": cache.can_drop, "buffer_locked": locked,
                   "backends": backends, "gpu": args.gpu},
        "rows": [{"name": c.name, "settings": c.settings, "kind": c.kind, "in_goal": c.in_goal,
                  "status": c.status, "write_gibs": c.best(c.writes), "read_gibs": c.best(c.reads),
                  "write_samples_gibs": [x / GIB for x in c.writes],
                  "read_samples_gibs": [x / GIB for x in c.reads],
                  "write_request_kib": c.write_req_kib, "read_request_kib": c.read_req_kib}
                 for c in contenders],
        "ratios": r,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")

    if args.results_md:
        cmd = " ".join(["python3 bench/io_throughput.py"] + (sys.argv[1:] if sys.argv[1:] else []))
        body = "\n".join([f"Latest run: {info['date']} on {info['hostname']}, `{cmd}`.", "",
                          "\n\n".join(head), "", tbl, "", *rlines, "", quiet_line])
        replace_section(Path(args.results_md), SECTION, body)
        print(f"updated the section in {args.results_md}")
    return 1 if any(c.status.startswith("WRONG DATA") for c in contenders) else 0


if __name__ == "__main__":
    sys.exit(main())
