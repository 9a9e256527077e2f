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
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = ["FioError", "FioJob", "available", "version", "run", "sweep_jobs", "best_fio", "Sweep",
           "reserve_huge_pages",
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

    def label(self) -> str:
        jobs = f", numjobs {self.numjobs}{' (split)' if self.split else ''}" if self.numjobs > 1 else ""
        return f"{self.engine}, bs {self.bs >> 20}M, mem {self.mem}, iodepth {self.iodepth}{jobs}"

    def argv(self, path: str) -> list:
        size = self.size
        split = self.split and self.numjobs > 1
        if split:
            size = int(self.size) // self.numjobs // self.bs * self.bs
        cmd = ["fio", "--name=nvmeio-bench", f"--filename={path}", f"--rw={self.rw}",
               f"--ioengine={self.engine}", "--direct=1", f"--bs={self.bs}",
               f"--iodepth={self.iodepth}", f"--size={size}", f"--mem={self.mem}",
               f"--numjobs={self.numjobs}", "--group_reporting", "--output-format=json"]
        if split:
            cmd.append(f"--offset_increment={size}")
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
