"""fio, the reference every I/O benchmark here compares against, at its best.

[Note: fio's best configuration]
fio's numbers depend on its own settings as much as ours do. With 1 MiB
blocks in ordinary 4 KiB-page memory, a virtio disk receives each request
split at page boundaries into many small segments; with huge-page memory
(``--mem=mmaphuge``, which needs huge pages reserved) and larger blocks
(``--bs=4M``) the same disk runs at its limit. A claim "faster than fio"
against fio's default is a claim against a handicapped fio, so benchmarks
sweep fio's block size, memory type and engine (:func:`best_fio`) and
compare with the best, measured in the same conditions: page cache dropped
before each run, an existing (already allocated) file, the same size.
:func:`sweep_jobs` lists the jobs, :func:`best_fio` runs them.

Huge pages: :func:`reserve_huge_pages` raises ``vm.nr_hugepages`` (root
only) for the run and :func:`restore_huge_pages` gives them back. fio's
buffer is ``bs x iodepth`` bytes (:func:`buffer_bytes`), not the file size;
without that many huge pages a ``mmaphuge`` job dies with SIGSEGV.

[Note: a read job and a write job at once]
A training iteration from NVMe reads and writes at the same time, so its
reference is one fio process running a read job and a write job together
(:func:`run_together`; no ``stonewall``), each on its own existing, fully
written file, and its time is the slower job's runtime.
:func:`read_write_together` prepares the files, reserves huge pages for both
buffers, runs the pair ``runs`` times (page cache dropped before each) and
keeps the fastest; where huge pages cannot be had it runs in ``malloc`` memory
and says why. Byte counts larger than ``file_cap`` wrap around a file of that
size (fio's ``io_size``), so tens of GB need not sit on a shared disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

__all__ = ["FioError", "FioJob", "available", "version", "run", "run_together", "read_write_together",
           "sweep_jobs", "best_fio", "Sweep", "reserve_huge_pages",
           "restore_huge_pages", "huge_page_bytes", "buffer_bytes", "drop_page_cache"]

MEM_TYPES = ("malloc", "mmaphuge")
BLOCK_SIZES = (1 << 20, 4 << 20)
ENGINES = ("libaio", "io_uring")
_NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class FioError(RuntimeError):
    """fio could not run this job (not installed, refused an option, job error)."""


def available() -> bool:
    return shutil.which("fio") is not None


def version() -> Optional[str]:
    if not available():
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


@dataclass(frozen=True)
class FioJob:
    """One fio job: ``rw`` ("read"/"write") of ``size`` bytes of ``path`` with O_DIRECT."""

    rw: str
    size: int
    bs: int = 1 << 20
    mem: str = "malloc"
    engine: str = "libaio"
    iodepth: int = 32
    numjobs: int = 1
    fallocate: bool = True  # fio's default: the file is preallocated before timing
    # numjobs > 1: each job its own 1/numjobs of the file (--offset_increment), so a new file
    # gets ``size`` bytes in all; fio's default has every job write the whole file, and the
    # jobs after the first rewrite blocks already allocated (faster) while counted 4x.
    split: bool = False
    # bytes of I/O to do within the first ``size`` bytes, wrapping around (fio's io_size); None: ``size``
    io_size: Optional[int] = None

    def label(self) -> str:
        jobs = f", numjobs {self.numjobs}{' (split)' if self.split else ''}" if self.numjobs > 1 else ""
        return f"{self.engine}, bs {self.bs >> 20}M, mem {self.mem}, iodepth {self.iodepth}{jobs}"

    def argv(self, path: str) -> list:
        return ["fio", *self.job_args(path), "--group_reporting", "--output-format=json"]

    def job_args(self, path: str, name: str = "nvmeio-bench") -> list:
        """This job's section of a fio command line (from ``--name`` on)."""
        size = self.size
        split = self.split and self.numjobs > 1
        if split:
            size = int(self.size) // self.numjobs // self.bs * self.bs
        cmd = [f"--name={name}", f"--filename={path}", f"--rw={self.rw}",
               f"--ioengine={self.engine}", "--direct=1", f"--bs={self.bs}",
               f"--iodepth={self.iodepth}", f"--size={size}", f"--mem={self.mem}",
               f"--numjobs={self.numjobs}"]
        if split:
            cmd.append(f"--offset_increment={size}")
        if self.io_size is not None:
            cmd.append(f"--io_size={self.io_size}")
        if not self.fallocate:
            cmd.append("--fallocate=none")
        return cmd


def run(job: FioJob, path: str) -> float:
    """Bytes per second fio measured (its own ``bw_bytes``, without start-up)."""
    if not available():
        raise FioError("fio is not installed (apt-get install -y fio)")
    p = subprocess.run(job.argv(path), capture_output=True, text=True)
    out = p.stdout[p.stdout.find("{"):] if "{" in p.stdout else ""
    try:
        result = json.loads(out)["jobs"][0]
    except (ValueError, KeyError, IndexError):
        raise FioError(f"fio {job.label()} failed (rc {p.returncode}): "
                       f"{(p.stderr or p.stdout).strip()[-300:]}") from None
    if result.get("error"):
        raise FioError(f"fio {job.label()} job error {result['error']}: {p.stderr.strip()[-300:]}")
    return float(result[job.rw]["bw_bytes"])


def run_together(jobs: Sequence[tuple]) -> list:
    """Runs ``(job, path)`` pairs at once in one fio process (see [Note: a read job and a write
    job at once]); returns one dict per job: ``rw``, ``bytes``, ``seconds`` (fio's runtime of
    that job, start-up excluded) and ``bytes_per_s``."""
    if not available():
        raise FioError("fio is not installed (apt-get install -y fio)")
    cmd = ["fio", "--output-format=json"]
    for i, (job, path) in enumerate(jobs):
        cmd += job.job_args(path, f"{job.rw}{i}")
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout[p.stdout.find("{"):] if "{" in p.stdout else ""
    labels = " + ".join(job.rw + " " + job.label() for job, _ in jobs)
    try:
        results = json.loads(out)["jobs"]
    except (ValueError, KeyError):
        raise FioError(f"fio {labels} failed (rc {p.returncode}): "
                       f"{(p.stderr or p.stdout).strip()[-300:]}") from None
    if len(results) != len(jobs) or p.returncode != 0 or any(r.get("error") for r in results):
        raise FioError(f"fio {labels} failed (rc {p.returncode}, job errors "
                       f"{[r.get('error') for r in results]}): {p.stderr.strip()[-300:]}")
    rows = []
    for (job, _), r in zip(jobs, results):
        d = r[job.rw]
        rows.append({"rw": job.rw, "bytes": int(d["io_bytes"]), "seconds": d["runtime"] / 1000.0,
                     "bytes_per_s": float(d["bw_bytes"])})
    return rows


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def _ensure_written(path: str, nbytes: int, bs: int) -> None:
    """``path`` holds at least ``nbytes`` of written data (not a sparse or preallocated range,
    which reads from no disk at all): fio writes it once, sequentially, with O_DIRECT."""
    if os.path.exists(path) and os.path.getsize(path) >= nbytes:
        return
    run(FioJob("write", nbytes, bs=bs, iodepth=32), path)


def _together_paths(work_dir: str) -> dict:
    return {"read": os.path.join(work_dir, "fio-read.bin"), "write": os.path.join(work_dir, "fio-write.bin")}


def remove_together_files(work_dir: str) -> None:
    """Remove the files :func:`read_write_together` keeps in ``work_dir`` for its next call."""
    for path in _together_paths(work_dir).values():
        if os.path.exists(path):
            os.remove(path)


def read_write_together(read_bytes: int, write_bytes: int, work_dir: str, runs: int = 3,
                        bs: int = 4 << 20, iodepth: int = 32, engine: str = "io_uring",
                        mem: str = "mmaphuge", file_cap: int = 8 << 30) -> dict:
    """fio's time to read ``read_bytes`` and write ``write_bytes`` at once (see [Note: a read job
    and a write job at once]), the fastest of ``runs``. Both counts are rounded up to ``bs``.
    Files ``fio-read.bin`` / ``fio-write.bin`` in ``work_dir`` are kept for the next call (the
    caller removes them). Returns a dict: ``seconds`` (the fastest run's slower job), ``runs``
    (every run's jobs), ``mem`` actually used and ``mem_note`` (why not huge pages)."""
    read_bytes, write_bytes = _round_up(read_bytes, bs), _round_up(write_bytes, bs)
    paths = _together_paths(work_dir)
    regions = {"read": min(read_bytes, _round_up(file_cap, bs)), "write": min(write_bytes, _round_up(file_cap, bs))}
    wanted = {"read": read_bytes, "write": write_bytes}
    for rw in ("read", "write"):
        if wanted[rw]:
            _ensure_written(paths[rw], regions[rw], bs)

    def jobs(memory: str) -> list:
        return [(FioJob(rw, regions[rw], bs=bs, mem=memory, engine=engine, iodepth=iodepth,
                        io_size=wanted[rw] if wanted[rw] > regions[rw] else None), paths[rw])
                for rw in ("read", "write") if wanted[rw]]

    out = {"read_bytes": read_bytes, "write_bytes": write_bytes, "bs": bs, "iodepth": iodepth,
           "engine": engine, "mem": mem, "mem_note": "", "file_cap": file_cap, "runs": [], "seconds": None}
    if not jobs(mem):
        out["seconds"] = 0.0
        return out
    reserved = None
    if mem == "mmaphuge":
        try:
            reserved = reserve_huge_pages(sum(j.bs * j.iodepth for j, _ in jobs(mem)) + (8 << 20))
        except (OSError, RuntimeError) as e:
            out.update(mem="malloc", mem_note=f"no huge pages ({e}); ran in malloc memory")
    try:
        for _ in range(runs):
            for path in paths.values():
                drop_page_cache(path)
            try:
                rows = run_together(jobs(out["mem"]))
            except FioError as e:
                if out["mem"] != "mmaphuge":
                    raise
                out.update(mem="malloc", mem_note=f"fio --mem=mmaphuge failed ({e}); ran in malloc memory")
                rows = run_together(jobs("malloc"))
            out["runs"].append({"seconds": max(r["seconds"] for r in rows), "jobs": rows})
    finally:
        if reserved is not None:
            restore_huge_pages(reserved)
    out["seconds"] = min(r["seconds"] for r in out["runs"])
    return out


def drop_page_cache(path: Optional[str] = None) -> bool:
    """``sync`` and drop the page cache (root); otherwise evict ``path``'s clean pages.
    Returns whether the whole cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        if path and os.path.exists(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return False


@dataclass
class Sweep:
    """Every job tried for one direction, its samples (bytes/s) and the best by median."""

    rw: str
    samples: dict = field(default_factory=dict)  # FioJob -> [bytes/s]
    errors: dict = field(default_factory=dict)   # FioJob -> why it could not run

    def median(self, job: FioJob) -> float:
        xs = sorted(self.samples[job])
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def best(self) -> Optional[FioJob]:
        return max(self.samples, key=self.median, default=None)


def sweep_jobs(rw: str, size: int, block_sizes: Iterable[int] = BLOCK_SIZES,
               mems: Iterable[str] = MEM_TYPES, engines: Iterable[str] = ENGINES,
               depths: Iterable[tuple] = ((32, 1),), split: bool = False) -> list:
    """The jobs of fio's best-configuration sweep: every engine x memory x block size x
    (iodepth, numjobs)."""
    return [FioJob(rw, size, bs, mem, engine, iodepth, numjobs, split=split)
            for engine in engines for mem in mems for bs in block_sizes
            for iodepth, numjobs in depths]


def best_fio(path: str, jobs: list, rounds: int = 1, new_file: bool = False) -> Sweep:
    """Runs ``jobs`` ``rounds`` times in alternating order, page cache dropped before each
    (``new_file``: a write first removes ``path``; otherwise ``path`` is read or rewritten
    in place). A job fio refuses (mmaphuge without huge pages, an engine this kernel
    lacks) is recorded in ``errors``, not raised. The best is by median."""
    sweep = Sweep(jobs[0].rw if jobs else "")
    for r in range(rounds):
        for job in (jobs if r % 2 == 0 else jobs[::-1]):
            if job in sweep.errors:
                continue
            if new_file and job.rw == "write" and os.path.exists(path):
                os.unlink(path)
            drop_page_cache(path)
            try:
                sweep.samples.setdefault(job, []).append(run(job, path))
            except FioError as e:
                sweep.samples.pop(job, None)
                sweep.errors[job] = str(e)
    return sweep


def buffer_bytes(jobs: Iterable[FioJob]) -> int:
    """The memory fio allocates for the largest of ``jobs`` (bs x iodepth x numjobs)."""
    return max((j.bs * j.iodepth * j.numjobs for j in jobs), default=0)


def huge_page_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    return 2 << 20


def reserve_huge_pages(nbytes: int) -> tuple:
    """Reserves enough huge pages for ``nbytes`` plus 16 spare ones (fio maps a little more
    than bs x iodepth: 65 pages failed for 4 MiB x 32, 70 worked); returns ``(before, now)``
    page counts for :func:`restore_huge_pages`. Raises PermissionError when not root,
    RuntimeError when the kernel could not find that much contiguous memory."""
    with open(_NR_HUGEPAGES) as f:
        before = int(f.read())
    want = before + -(-nbytes // huge_page_bytes()) + 16
    with open(_NR_HUGEPAGES, "w") as f:
        f.write(str(want))
    with open(_NR_HUGEPAGES) as f:
        now = int(f.read())
    if now < want:
        restore_huge_pages((before, now))
        raise RuntimeError(f"only {now - before} of {want - before} huge pages could be reserved "
                           "(memory too fragmented); fio --mem=mmaphuge will fail")
    return before, now


def restore_huge_pages(reserved: tuple) -> None:
    with open(_NR_HUGEPAGES, "w") as f:
        f.write(str(reserved[0]))
