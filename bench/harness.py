"""What every benchmark shares: child processes with a JSON result, provenance, fio's
reference, this process's counters and the RESULTS.md section.

    from bench import harness
    result = harness.run_child("bench.train_step", ["--child", "torch"], timeout=900)
    meta = harness.provenance(nvme_dir)           # date, commit, machine, load average
    ref = harness.fio_reference(read_bytes, write_bytes, work)
    harness.write_section("bench/RESULTS.md", SECTION, figures, command, details)

[Note: which nvmeio a benchmark measures]
A benchmark measures the tree it is run from. ``python -m bench.NAME`` puts the
repository root first on sys.path, and each child gets the root first on PYTHONPATH
(with PYTHONSAFEPATH, so that its working directory, a temporary one, adds nothing):
nvmeio, swapper and zero come from the working tree, whose native module must be built
in place (``pip install -e . --no-build-isolation``). A DeepSpeed child runs in a venv
without nvmeio; it loads the example model from its file (bench/training.py).

Only the standard library is imported here: DeepSpeed's venv imports this module too.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from tools import fio
from tools.results_md import Figure, replace_section, section_body

__all__ = ["ROOT", "GiB", "Figure", "run_child", "print_result", "provenance", "commit", "load_average",
           "fio_reference", "status_bytes", "proc_io", "settled_io", "free_port", "save_json", "write_section",
           "publish", "pyplot"]

ROOT = str(Path(__file__).resolve().parent.parent)
GiB = 1 << 30


# -- child processes ---------------------------------------------------------------------------------------

def run_child(module: str, args: Sequence[str], python: Optional[str] = None,
              timeout: Optional[float] = None, first_on_path: str = ROOT) -> dict:
    """Runs ``python -m module *args`` (see [Note: which nvmeio a benchmark measures]) and
    returns its result: the last line of its stdout that is a JSON object (with ``returncode``
    added when the child failed after printing it, in its teardown). A child that printed none
    (it failed, or ran past ``timeout`` s) gives ``{"error": the line saying why, "returncode",
    "tail": its last lines}``. ``first_on_path``: what goes first on its PYTHONPATH (the root;
    bench/gpu_check.py may name a folder of bench and tools alone, for the installed nvmeio)."""
    env = dict(os.environ, PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join(p for p in (first_on_path, os.environ.get("PYTHONPATH")) if p))
    cmd = [python or sys.executable, "-m", module, *map(str, args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                             cwd=tempfile.gettempdir())
        stdout, text, rc = out.stdout, out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        text, rc = f"{stdout}{stderr}\ntimed out after {timeout} s", None
        stdout = ""  # whatever it printed, it did not finish
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            if rc:
                result["returncode"] = rc
            return result
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    error = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln or "timed out" in ln),
                 lines[-1] if lines else "no output")
    return {"error": error.strip()[:300], "returncode": rc, "tail": lines[-15:]}


def print_result(result: dict) -> None:
    """The child's side of :func:`run_child`: its result, the last line it prints."""
    print(json.dumps(result), flush=True)


# -- provenance ---------------------------------------------------------------------------------------------

def _text(cmd: list) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def commit(exclude: Sequence[str] = ()) -> str:
    """The tree's short commit, ``+dirty`` when tracked files (but ``exclude``) have changed."""
    rev = _text(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or "?"
    changed = _text(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--", ".",
                     *(f":!{p}" for p in exclude)])
    return rev + ("+dirty" if changed else "")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def provenance(disk_dir: Optional[str] = None, exclude: Sequence[str] = ()) -> dict:
    """Where and when a run happens: UTC start (``started``, ISO; ``when``, for a headline), host, commit, CPUs, RAM, kernel, Python, fio,
    the load average at the start and, with ``disk_dir``, the disk and file system under it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"started": now.isoformat(timespec="seconds"), "when": now.strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "commit": commit(exclude), "nproc": os.cpu_count(),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "kernel": platform.release(),
            "python": platform.python_version(), "fio": fio.version(), "load_start": load_average(),
            "t0": time.time()}
    if disk_dir:
        df = _text(["df", "-P", "-T", disk_dir]).splitlines()
        meta["disk"], meta["fstype"] = df[-1].split()[:2] if len(df) > 1 else ("?", "?")
    return meta


# -- fio's reference ----------------------------------------------------------------------------------------

def fio_reference(read_bytes: int, write_bytes: int, work: str, runs: int = 3, file_cap: int = 8 << 30,
                  keep_files: bool = False) -> dict:
    """fio reading ``read_bytes`` and writing ``write_bytes`` at once at its best, the fastest of
    ``runs`` (tools/fio.py, [Note: a read job and a write job at once]); ``{"error": why}`` when
    fio is missing or fails. Its files in ``work`` stay for the next call with ``keep_files``."""
    if not fio.available():
        return {"error": "fio is not installed (apt-get install -y fio)"}
    try:
        return fio.read_write_together(read_bytes, write_bytes, work, runs=runs, file_cap=file_cap)
    except fio.FioError as e:
        return {"error": str(e)[:300]}
    finally:
        if not keep_files:
            fio.remove_together_files(work)


# -- this process ---------------------------------------------------------------------------------------------

def status_bytes(key: str) -> int:
    """``/proc/self/status``'s ``key`` (VmHWM, RssAnon, ...) in bytes; 0 where it is absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def proc_io() -> dict:
    """This process's storage counters (/proc/self/io: read_bytes, write_bytes, ...; O_DIRECT and
    the I/O threads' included)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def thread_cpu() -> dict:
    """CPU seconds (user + system) of each of this process's threads: ``{tid: (name, seconds)}``.
    A thread whose CPU seconds over an interval come near the interval's is what bounds it."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime, stime: fields 14, 15
    return out


def busiest_thread(before: dict, after: dict) -> tuple:
    """(name, CPU seconds) of the thread that used most CPU between two :func:`thread_cpu`."""
    used = [(name, s - before.get(tid, (name, 0.0))[1]) for tid, (name, s) in after.items()]
    return max(used, key=lambda u: u[1], default=("", 0.0))


def settled_io(quiet: float = 0.5, timeout: float = 10.0) -> dict:
    """:func:`proc_io` once it has stopped moving (no byte read or written for ``quiet`` s): the
    writes an iteration left in flight have landed."""
    last, still, end = proc_io(), 0, time.monotonic() + timeout
    while still < quiet / 0.05 and time.monotonic() < end:
        time.sleep(0.05)
        now = proc_io()
        moved = (now["read_bytes"], now["write_bytes"]) != (last["read_bytes"], last["write_bytes"])
        still = 0 if moved else still + 1
        last = now
    return last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- results ----------------------------------------------------------------------------------------------------

def save_json(record, path: Optional[str], **dump) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, **dump)


def write_section(results_md: str, heading: str, figures: Sequence[Figure], command: str, details: str) -> None:
    """Replaces ``heading``'s section of ``results_md``: the headline, the command, the details."""
    replace_section(Path(results_md), heading, section_body(figures, command, details))


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def publish(record: dict, results_md: Optional[str], section: str, png: Optional[str], chart, figures,
            markdown) -> None:
    """A benchmark's chart and its section of ``results_md``: ``chart(record, png)`` (False when
    matplotlib is missing: no chart), then ``figures(record)`` and ``markdown(record, png)`` as the
    section. ``png`` None: no chart."""
    if png:
        if chart(record, png):
            print(f"wrote {png}")
        else:
            print("matplotlib is not installed: no chart (pip install matplotlib)")
            png = None
    if results_md:
        write_section(results_md, section, figures(record), record["meta"]["command"], markdown(record, png))
        print(f"updated {section!r} in {results_md}")
