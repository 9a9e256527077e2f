"""One call verifies nvmeio on a GPU machine: built from this tree, its CUDA tests, the 311M GPT
trained with parameters and optimizer on NVMe, and aio_handle / gds_handle with CUDA tensors.

    bash tools/gpu_kit.sh                               # here, where PyPI and Debian are reachable
    python -m bench.gpu_check --out $OUT                # there, gpu_kit/ carried along: <= 8 minutes
    python -m bench.gpu_check --rehearse --out /tmp/gc  # anywhere, on the CPU, tiny sizes, < 1 minute

It writes gpu_check.json, gpu_check.md and gpu_check.log (every command's output) to --out.

[Note: stages, budgets and what survives a failure]
Eight stages run in order (--stages picks some; install always runs; sanitize only when named), each within a time budget
of its own, all within --total-s (training has what is left but the later stages' budgets):
``install`` (the kit's wheels that are missing or older here, then nvmeio from this tree without
build isolation or network, liburing from the kit so that the io_uring backend builds;
tools/gpu_kit.sh makes the kit), ``tests`` (pytest on tests/test_cuda_paths.py,
tests/test_gds_handle.py and the tests marked cuda elsewhere), ``sanitize`` (the engine's CUDA
tests again under torch's CUDA stream sanitizer, bench/_gpu_sanitize.py), ``disk`` (nvme_tune's best read
and write GiB/s: the disk's time for a byte count, fio being absent there; fio's own when it is
on PATH, as a kit can carry it), ``aio`` (GiB/s of locked host buffers, CUDA tensors through
aio_handle and through gds_handle), ``train`` (bench/io_bound.py's children: plain torch on the
GPU in memory, and ours at k = 1, 4, 16 in fp32 and bf16), ``lora`` (bench/lora.py's LoRA
stand-in without and with quantized frozen weights, then a wider model in fp32 whose quantized
iteration stays I/O-bound, bench/_gpu_lora.py) and ``infer`` (ZeRO-Inference: bench/inference.py's
generate from NVMe at batch 1 and 32, bench/_gpu_infer.py). Whatever imports torch
or nvmeio runs in a child process with a timeout, so a crash, a hang or a failed build ends one
stage, recorded with its error, and the next stage runs; the JSON and the markdown are rewritten
after every stage, so a run stopped from outside keeps what had finished.

Children import nvmeio from the tree when it imports there (a native module built in place),
else from the installed package (the install stage's, built from this tree) through a folder
holding only bench/ and tools/ (the JSON's ``nvmeio_from``).

--rehearse runs the same stages on the CPU with tiny sizes (its children see no GPU, even on a GPU
machine, so that the suite's rehearsal test holds there): the install stage checks the kit
and the commands without running them, pytest runs the tests marked cuda (they skip), and the
CUDA parts run with the CPU device, each such stage noting "no CUDA: rehearsed on CPU"; all
training runs share one child process there (on a GPU each has its own).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

from bench import _gpu_infer, _gpu_install, _gpu_lora, _gpu_report, _gpu_sanitize, harness, io_bound
from bench._gpu_install import Kit, find_kit
from tools import fio

ROOT = harness.ROOT
GiB = harness.GiB
STAGES = ("install", "tests", "sanitize", "disk", "aio", "train", "lora", "infer")
DEFAULT_STAGES = tuple(n for n in STAGES if n != "sanitize")  # bench/_gpu_sanitize.py: only when named
NO_CUDA = "no CUDA: rehearsed on CPU"
TINY_MODEL = dict(vocab=256, d_model=32, heads=2, layers=2, seq=16, tie=True)
WIDE_LORA_MODEL = dict(vocab=8192, d_model=2048, heads=16, layers=8, seq=128, tie=True)  # 420M parameters


@dataclass(frozen=True)
class Sizes:
    """What a run on a GPU and a rehearsal differ in."""

    total_s: float  # all stages together
    budgets: dict  # seconds per stage; train has what is left
    model: dict
    ks: tuple
    dtypes: tuple
    warmup: int
    iters: int  # measured iterations of ours (the median is reported)
    torch_iters: int  # measured iterations of plain torch per k
    min_run_s: float  # a training run is not started with less left
    run_cap_s: float  # the longest a training run may take
    tune_io_size: str
    tune_budget_s: float
    aio_bytes: int
    aio_rounds: int
    one_process_per_run: bool
    use_fio: bool
    lora_wide: Optional[dict] = None  # the lora stage's second model (bench/_gpu_lora.py [Note: the wide model])
    infer_model: str = "medium"  # bench/inference.py's MODELS (bench/_gpu_infer.py [Note: what the infer stage measures])
    infer_batches: tuple = (1, 32)
    infer_prompt_len: int = 64
    infer_new_tokens: int = 8


REAL = Sizes(total_s=470, budgets={"install": 180, "tests": 240, "sanitize": 90, "disk": 45, "aio": 45, "lora": 170, "infer": 75},
             model=io_bound.MODEL,
             ks=(1, 4, 16), dtypes=("fp32", "bf16"), warmup=1, iters=2, torch_iters=3, min_run_s=30, run_cap_s=200,
             tune_io_size="1G", tune_budget_s=25, aio_bytes=1 * GiB, aio_rounds=3, one_process_per_run=True,
             use_fio=True, lora_wide=WIDE_LORA_MODEL)
# The rehearsal's lora stage starts six children (about 33 s on a quiet 2-core machine, past 40 s on CI's),
# so its budgets leave twice that.
REHEARSAL = Sizes(total_s=330, budgets={"install": 60, "tests": 90, "sanitize": 60, "disk": 40, "aio": 40, "lora": 90, "infer": 60},
                  model=TINY_MODEL,
                  ks=(1, 4), dtypes=("fp32", "bf16"), warmup=1, iters=1, torch_iters=1, min_run_s=0, run_cap_s=120,
                  tune_io_size="8M", tune_budget_s=2, aio_bytes=8 << 20, aio_rounds=1, one_process_per_run=False,
                  use_fio=False,  # fio would reserve huge pages on a shared machine, for nothing a rehearsal needs
                  lora_wide=dict(TINY_MODEL, d_model=64), infer_model="tiny", infer_batches=(1, 2),
                  infer_prompt_len=8, infer_new_tokens=3)

PROBE = """
import json
import nvmeio
out = {"nvmeio": nvmeio.__file__, "version": nvmeio.__version__, "backends": nvmeio.available_backends()}
import torch
out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda=torch.cuda.is_available())
if out["cuda"]:
    out["gpu"] = torch.cuda.get_device_name(0)
out["gds_unavailable"] = nvmeio.gds_unavailable_reason()
print(json.dumps(out))
"""


# -- the run ---------------------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    deadline: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass
class Run:
    """One gpu_check: its sizes and clock, its files, its scratch folder on the disk, the kit, and
    where children import nvmeio from (decided by the install stage)."""

    sizes: Sizes
    out: str
    scratch: str
    kit: Kit
    rehearse: bool
    t0: float = field(default_factory=time.monotonic)
    first_on_path: str = ROOT
    installed_only: Optional[str] = None  # the folder of bench/ and tools/ alone, when it is used
    cuda: bool = False
    record: dict = field(default_factory=dict)
    stages: tuple = STAGES  # the stages this run runs, in STAGES' order

    @property
    def log_path(self) -> str:
        return os.path.join(self.out, "gpu_check.log")

    def say(self, text: str) -> None:
        line = f"[gpu_check {time.monotonic() - self.t0:6.1f} s] {text}"
        print(line, flush=True)
        self.log(line)

    def log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text.rstrip("\n") + "\n")

    def env(self) -> dict:
        """A child's environment: nvmeio from where the install stage decided (harness.run_child's)."""
        path = os.pathsep.join(p for p in (self.first_on_path, os.environ.get("PYTHONPATH")) if p)
        return dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=path)

    def child(self, module: str, args: list, timeout: float) -> dict:
        return harness.run_child(module, [str(a) for a in args], None, round(max(1.0, timeout)), self.first_on_path)

    def command(self, title: str, cmd: list, timeout: float, cwd: str = ROOT, env: Optional[dict] = None) -> dict:
        """Runs ``cmd`` (its output into the log; ``env`` added to the children's environment):
        returncode, seconds, and its last lines."""
        self.say(f"{title}: " + " ".join(a if "\n" not in a else "'...'" for a in cmd))
        t = time.monotonic()
        # A session of its own: on timeout its whole process group goes (pip's compilers, pytest's
        # children), and none is left holding the pipe that communicate() reads to its end.
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                             env={**self.env(), **(env or {})}, start_new_session=True)
        try:
            text, rc = p.communicate(timeout=max(1.0, timeout))[0], p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            try:
                text = p.communicate(timeout=10)[0]
            except subprocess.TimeoutExpired:  # a process of another session still holds the pipe
                text = ""
            rc, text = None, text + f"\ntimed out after {timeout:.0f} s"
        self.log(f"----- {title} (exit {rc}) -----\n{text}\n----- end of {title} -----")
        return {"command": cmd, "returncode": rc, "seconds": round(time.monotonic() - t, 1),
                "tail": text.strip().splitlines()[-12:], "output": text}

    def write(self) -> None:
        harness.save_json(self.record, os.path.join(self.out, "gpu_check.json"), indent=1)
        with open(os.path.join(self.out, "gpu_check.md"), "w") as f:
            f.write(_gpu_report.markdown(self.record))


def run_stage(run: Run, name: str, fn: Callable[[Run, Stage], dict]) -> None:
    left = run.sizes.total_s - (time.monotonic() - run.t0)
    # A stage without a budget of its own (train) has what is left but the later stages' budgets.
    later = run.stages[run.stages.index(name) + 1:]
    reserved = sum(run.sizes.budgets.get(n, 0) for n in later)
    budget = max(0.0, min(run.sizes.budgets.get(name, left - reserved), left))
    run.say(f"{name}: start, budget {budget:.0f} s")
    t = time.monotonic()
    if budget < 1:
        result = {"status": "skipped", "error": f"no time left of the run's {run.sizes.total_s:.0f} s"}
    else:
        try:
            result = fn(run, Stage(name, t + budget))
        except Exception as e:  # noqa: BLE001 - a stage's failure is its record, and the next stage runs
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result.update(seconds=round(time.monotonic() - t, 1), budget_s=round(budget))
    run.record["stages"][name] = result
    why = result.get("error") or result.get("note") or ""
    run.say(f"{name}: {result['status']} in {result['seconds']} s" + (f" ({why})" if why else ""))
    run.write()


# -- install ---------------------------------------------------------------------------------------

def stage_install(run: Run, stage: Stage) -> dict:
    plan = _gpu_install.install_plan(run.kit, ROOT)
    out = {"kit": asdict(run.kit), "plan": plan, "steps": [], "warnings": plan["warnings"]}
    failures = []
    if run.rehearse:  # dry: the kit and the commands are checked, nothing is run
        step = run.command("pip (dry run: its version)", [sys.executable, "-m", "pip", "--version"], stage.left())
        out["steps"].append(step)
        out["note"] = "dry run: the kit and the commands were checked, not run"
    else:
        for title, cmd in plan["commands"]:
            step = run.command(title, cmd, stage.left())
            step["io_uring"] = _gpu_install.io_uring_line(step["output"])
            out["steps"].append(step)
            if step["returncode"] != 0:
                failures.append(f"{title}: exit {step['returncode']}: {step['tail'][-1] if step['tail'] else ''}")
                break
    for step in out["steps"]:
        step.pop("output")
    out["probe"] = probe(run, stage)
    if "error" in out["probe"]:
        failures.append(f"nvmeio does not import in a child: {out['probe']['error']}")
    out["status"] = "failed" if failures else "dry" if run.rehearse else "ok"
    if failures:
        out["error"] = "; ".join(failures)
    return out


def probe(run: Run, stage: Stage) -> dict:
    """nvmeio's and CUDA's state in a child: from the tree if nvmeio imports there, else the installed one."""
    tried = []
    for where in ("tree", "installed"):
        if where == "installed":
            run.installed_only = _gpu_install.bench_and_tools_only(ROOT)
            run.first_on_path = run.installed_only
        cmd = [sys.executable, "-c", PROBE]
        step = run.command(f"probe ({where})", cmd, min(stage.left() + 30, 120), cwd=tempfile.gettempdir())
        lines = [ln for ln in step["output"].splitlines() if ln.startswith("{")]
        if step["returncode"] == 0 and lines:
            found = json.loads(lines[-1])
            run.cuda = bool(found.get("cuda"))
            run.record["meta"]["nvmeio_from"] = where
            return {**found, "nvmeio_from": where, "first_on_path": run.first_on_path}
        tried.append(f"{where}: {step['tail'][-1] if step['tail'] else 'no output'}")
    run.first_on_path = ROOT
    return {"error": "; ".join(tried)}


# -- tests -----------------------------------------------------------------------------------------

def stage_tests(run: Run, stage: Stage) -> dict:
    out = run_pytest(run, stage, pytest_runs(os.path.join(ROOT, "tests"), whole_files=run.cuda))
    if not run.cuda:
        out["note"] = f"{NO_CUDA}: the tests marked cuda, which skip without a GPU"
    return out


def run_pytest(run: Run, stage: Stage, pytest_args: list, env: Optional[dict] = None,
               inspect: Optional[Callable[[str], dict]] = None) -> dict:
    """Each (title, arguments) of ``pytest_args`` run by pytest, with ``env`` added to its
    environment: the counts of every run and together, and the verdict. ``inspect(output)``: more
    to keep of a run's output."""
    runs = []
    for title, args in pytest_args:
        xml = os.path.join(run.scratch, f"junit-{stage.name}-{len(runs)}.xml")
        # -v: each test's outcome is in the log as it ends, so a run stopped at the budget (no JUnit
        # file then) still says which tests passed and failed
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
        step = run.command(f"pytest: {title}", cmd, stage.left(), env=env)
        output = step.pop("output")
        step.update(title=title, **(junit_counts(xml) if os.path.exists(xml) else outcome_counts(output)))
        if inspect is not None:
            step.update(inspect(output))
        runs.append(step)
    failed = sum(r.get("failed", 0) + r.get("errors", 0) for r in runs)
    out = {"runs": runs, **{k: sum(r.get(k, 0) for r in runs) for k in ("passed", "failed", "errors", "skipped")}}
    if any(r["returncode"] is None for r in runs):
        out["status"], out["error"] = "timed out", "pytest ran past the stage's budget"
    elif failed or any(r["returncode"] not in (0, 5) for r in runs):  # 5: pytest collected nothing
        out["status"] = "failed"
        out["error"] = f"{failed} failed" if failed else f"pytest exit {[r['returncode'] for r in runs]}"
    else:
        out["status"] = "ok"
    return out


CUDA_FILES = ("test_cuda_paths.py", "test_gds_handle.py")


def pytest_runs(tests_dir: str, whole_files: bool) -> list:
    """(title, pytest arguments) of each run: with a GPU, tests/test_cuda_paths.py and
    tests/test_gds_handle.py whole, then the tests marked cuda in the other files; without one,
    the marked tests of them all (they skip)."""
    def marked(name: str) -> bool:
        with open(os.path.join(tests_dir, name)) as f:
            return "pytest.mark.cuda" in f.read()

    files = sorted(f for f in os.listdir(tests_dir) if f.startswith("test_") and f.endswith(".py") and marked(f))
    rel = os.path.relpath(tests_dir, ROOT)
    if not whole_files:
        return [("the tests marked cuda", ["-m", "cuda", *(os.path.join(rel, f) for f in files)])]
    others = [os.path.join(rel, f) for f in files if f not in CUDA_FILES]
    return [(" and ".join(CUDA_FILES) + ", whole", [os.path.join(rel, f) for f in CUDA_FILES]),
            ("the tests marked cuda in the other files", ["-m", "cuda", *others])]


_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def outcome_counts(output: str) -> dict:
    """Passed, failed, errors and skipped from the lines ``pytest -v`` printed as each test ended
    (a run stopped before its JUnit file was written), and the failed tests' names."""
    out = {"report": "pytest -v's lines: it did not finish", "passed": 0, "failed": 0, "errors": 0,
           "skipped": 0, "failures": []}
    kinds = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
             "XFAIL": "skipped"}
    for test, outcome in _OUTCOME.findall(output):
        out[kinds[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            out["failures"].append({"test": test, "kind": outcome.lower(), "message": ""})
    return out


def junit_counts(path: str) -> dict:
    """Passed, failed, errors and skipped from pytest's JUnit XML, and each failure's first line."""
    import xml.etree.ElementTree as ET

    if not os.path.exists(path):
        return {"report": "none: pytest did not finish"}
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error")]
        kind = ("failed" if any(c.tag == "failure" for c in bad) else "errors" if bad
                else "skipped" if case.find("skipped") is not None else "passed")
        out[kind] += 1
        for c in bad:
            text = (c.get("message") or c.text or "").strip()
            out["failures"].append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": c.tag,
                                    "message": text.splitlines()[0][:300] if text else ""})
    return out


# -- disk and aio (their children) ---------------------------------------------------------------------

def stage_disk(run: Run, stage: Stage) -> dict:
    spec = {"dir": run.scratch, "io_size": run.sizes.tune_io_size, "budget_s": run.sizes.tune_budget_s,
            "log_dir": os.path.join(run.scratch, "tune-logs")}
    res = run.child("bench.gpu_check", ["--child", "tune", json.dumps(spec)], stage.left())
    res["fio"] = fio.version() if fio.available() else None
    if "error" in res or res.get("read_gbps") is None or res.get("write_gbps") is None:
        res.setdefault("error", "nvme_tune measured no read or no write")
        res["status"] = "failed"
    else:
        res["status"] = "ok"
    return res


def child_tune(spec: dict) -> dict:
    """nvme_tune (its Python entry, --json) on the scratch folder: best read and write GiB/s."""
    import contextlib
    import io

    from nvmeio import tune

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = tune.main(["--nvme_dir", spec["dir"], "--io_size", spec["io_size"], "--budget", str(spec["budget_s"]),
                        "--json", "--log_dir", spec["log_dir"]])
    if rc != 0:
        return {"error": f"nvme_tune exit {rc}", "output": text.getvalue()[-2000:]}
    return json.loads(text.getvalue())


def stage_aio(run: Run, stage: Stage) -> dict:
    disk = run.record["stages"].get("disk", {})
    spec = {"dir": run.scratch, "bytes": run.sizes.aio_bytes, "rounds": run.sizes.aio_rounds,
            "aio": disk.get("aio") or {k: v for k, v in io_bound.AIO.items()}, "device": "cuda" if run.cuda else "cpu"}
    res = run.child("bench.gpu_check", ["--child", "aio", json.dumps(spec)], stage.left())
    res["status"] = "failed" if "error" in res else "ok"
    if not run.cuda:
        res["note"] = f"{NO_CUDA}: a plain CPU tensor stands in for the CUDA one; gds_handle needs CUDA"
    return res


def child_aio(spec: dict) -> dict:
    """GiB/s writing and reading ``spec["bytes"]`` from locked host memory and from a CUDA tensor
    through aio_handle, and through gds_handle where it runs; the median of ``rounds`` rounds, the
    buffers taking turns; every read checked against what was written."""
    import statistics

    import torch

    import nvmeio

    n, device = spec["bytes"], torch.device(spec["device"])
    block = {k: v for k, v in spec["aio"].items() if k != "use_gds"}
    aio = nvmeio.new_handle(block)
    src = aio.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    buffers = {"host (locked)": (aio, src, aio.new_cpu_locked_tensor(n, src))}
    on_device = src.to(device) if device.type == "cuda" else src.clone()  # the CPU stand-in: not locked
    name = "CUDA tensor, aio_handle" if device.type == "cuda" else "CPU tensor standing in for CUDA, aio_handle"
    buffers[name] = (aio, on_device, torch.empty_like(on_device))
    out = {"bytes": n, "settings": block, "device": str(device)}
    why_not = "needs CUDA" if device.type != "cuda" else nvmeio.gds_unavailable_reason()
    if why_not is None:
        gds_block = {**{k: v for k, v in block.items() if k != "backend"}, "use_gds": True}
        gds = nvmeio.new_handle(gds_block)
        buffers["CUDA tensor, gds_handle"] = (gds, on_device, torch.empty_like(on_device))
        out["gds_compat_mode"], out["gds_io_mode"] = gds.get_compat_mode(), gds.get_io_mode()
        out["gds_device_path"] = gds.get_device_path()
        if out["gds_device_path"] != "cufile":  # staged (no GPUDirect path): cuFile's own figure beside it
            before = os.environ.get("NVMEIO_GDS_STAGING")
            os.environ["NVMEIO_GDS_STAGING"] = "0"
            try:
                forced = nvmeio.new_handle(gds_block)
            finally:
                if before is None:
                    del os.environ["NVMEIO_GDS_STAGING"]
                else:
                    os.environ["NVMEIO_GDS_STAGING"] = before
            buffers["CUDA tensor, gds_handle, cuFile forced"] = (forced, on_device, torch.empty_like(on_device))
    else:
        out["gds_skipped"] = why_not

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    paths = {b: os.path.join(spec["dir"], f"aio-{i}.bin") for i, b in enumerate(buffers)}
    for b, (h, s, _) in buffers.items():  # the files exist before the timed rounds: overwrites, as swapping does
        h.sync_pwrite(s, paths[b])
    seconds = {b: {"write": [], "read": []} for b in buffers}
    names = list(buffers)
    for r in range(spec["rounds"]):
        for b in names[r % len(names):] + names[:r % len(names)]:
            h, s, d = buffers[b]
            seconds[b]["write"].append(timed(lambda: h.sync_pwrite(s, paths[b])))
            d.zero_()
            seconds[b]["read"].append(timed(lambda: h.sync_pread(d, paths[b])))
            if not torch.equal(d, s):
                raise AssertionError(f"{b}: the bytes read back differ from those written")
    out["gibps"] = {b: {op: n / statistics.median(v) / GiB for op, v in ops.items()} for b, ops in seconds.items()}
    out["samples_s"] = seconds
    for b in paths:
        os.unlink(paths[b])
    return out


# -- train -----------------------------------------------------------------------------------------

def stage_train(run: Run, stage: Stage) -> dict:
    """Plain torch per dtype, then ours at each (k, dtype), the smallest and largest k first (what a
    short budget keeps); the stage's record is rewritten after every run."""
    s, device = run.sizes, ("cuda" if run.cuda else "cpu")
    jobs = [{"kind": "compute", "spec": {"model": s.model, "dtype": d, "warmup": 3, "iters": 10, "device": device,
                                         "iteration_ks": list(s.ks), "iteration_iters": s.torch_iters}}
            for d in s.dtypes]
    ks = list(dict.fromkeys([s.ks[0], s.ks[-1], *s.ks[1:-1]]))
    jobs += [{"kind": "train", "spec": {"contender": "ours", "dtype": d, "k": k, "model": s.model, "warmup": s.warmup,
                                        "iters": s.iters, "train_batch": "auto"}} for k in ks for d in s.dtypes]
    out = {"model": s.model, "device": device, "compute": {}, "runs": [], "disk_min": {}}
    if not run.cuda:
        out["note"] = f"{NO_CUDA}, a tiny model" if run.rehearse else NO_CUDA
    disk = run.record["stages"].get("disk", {})
    for batch in [[j] for j in jobs] if s.one_process_per_run else [jobs]:
        left = stage.left()
        if left < max(1.0, s.min_run_s):
            results = [{"skipped": "the stage's time ran out"} for _ in batch]
        else:
            for j in batch:
                if j["kind"] == "train":
                    j["spec"]["nvme_path"] = tempfile.mkdtemp(prefix="ours-", dir=run.scratch)
            run.say("train: " + ", ".join(_job_label(j) for j in batch))
            try:
                got = run.child("bench.gpu_check", ["--child", "runs", json.dumps(batch)], min(left, s.run_cap_s))
            finally:
                for j in batch:
                    shutil.rmtree(j["spec"].pop("nvme_path", ""), ignore_errors=True)
            results = got["results"] if "results" in got else [dict(got) for _ in batch]
        for j, r in zip(batch, results):
            run.say(f"train: {_job_label(j)}: " + _gpu_report.run_line(r))
            d = j["spec"]["dtype"]
            if j["kind"] == "compute":
                out["compute"][d] = r
                if "params" in r:
                    out["disk_min"][d] = disk_reference(run, disk, *io_bound.min_bytes(d, r["params"]))
                continue
            row = {"dtype": d, "k": j["spec"]["k"], **r}
            if "median_s" in row:
                row["disk"] = disk_reference(run, disk, row["read_bytes"], row["write_bytes"])
            out["runs"].append(row)
        out["runs"].sort(key=lambda row: (s.dtypes.index(row["dtype"]), row["k"]))
        run.record["stages"]["train"] = {**out, "status": "running", "seconds": round(time.monotonic() - stage.start),
                                         "budget_s": round(stage.deadline - stage.start)}
        run.write()  # what has finished survives a run stopped from outside
    failed = [r for r in [*out["compute"].values(), *out["runs"]] if "error" in r]
    skipped = [r for r in [*out["compute"].values(), *out["runs"]] if "skipped" in r]
    out["status"] = "failed" if failed else "partial" if skipped else "ok"
    problems = []
    if failed:
        problems.append(f"{len(failed)} of {len(jobs)} runs failed, the first: {failed[0]['error']}")
    if skipped:
        problems.append(f"{len(skipped)} of {len(jobs)} skipped: {skipped[0]['skipped']}")
    if problems:
        out["error"] = "; ".join(problems)
    return out


def _job_label(job: dict) -> str:
    sp = job["spec"]
    return f"plain torch {sp['dtype']}" if job["kind"] == "compute" else f"ours {sp['dtype']} k={sp['k']}"


def disk_reference(run: Run, disk: dict, read_bytes: int, write_bytes: int) -> dict:
    """The disk's time for these bytes: nvme_tune's best read and write, one after the other, and
    fio's read and write jobs at once where fio runs (the seconds of the one that ran: fio's first)."""
    out = {}
    if disk.get("read_gbps") and disk.get("write_gbps"):
        out["nvme_tune_s"] = read_bytes / (disk["read_gbps"] * GiB) + write_bytes / (disk["write_gbps"] * GiB)
        out["seconds"], out["source"] = out["nvme_tune_s"], "nvme_tune"
    if run.sizes.use_fio and fio.available():
        f = harness.fio_reference(read_bytes, write_bytes, run.scratch, runs=1, file_cap=2 * GiB, keep_files=True)
        out["fio"] = f
        if f.get("seconds"):
            out["seconds"], out["source"] = f["seconds"], "fio"
    return out


def child_runs(jobs: list) -> dict:
    """bench/io_bound.py's children, one after another in this process; a failed one is its error."""
    import gc

    results = []
    for job in jobs:
        fn = io_bound.child_compute if job["kind"] == "compute" else io_bound.child_train
        try:
            results.append(fn(job["spec"]))
        except Exception as e:  # noqa: BLE001 - one run's failure is its result; the others run
            results.append({"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-2000:]})
        gc.collect()
    return {"results": results}


# -- main ------------------------------------------------------------------------------------------

CHILDREN = {"tune": child_tune, "aio": child_aio, "runs": child_runs}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "gpu_check"),
                   help="folder of gpu_check.json, gpu_check.md and gpu_check.log")
    p.add_argument("--rehearse", action="store_true", help="the CPU, tiny sizes, no install: the check of the check")
    p.add_argument("--kit", help="the kit folder (default gpu_kit/ at the repository root; tools/gpu_kit.sh)")
    p.add_argument("--nvme-dir", help="where swap and test files go (default the temporary folder, unless "
                                      "it is in memory (tmpfs): then the repository's)")
    p.add_argument("--total-s", type=float, help="seconds for all stages (default 470; --rehearse 330)")
    p.add_argument("--ks", help="micro-batches per iteration to train, comma-separated (default 1,4,16)")
    p.add_argument("--dtypes", help="fp32 and / or bf16, comma-separated (default both)")
    p.add_argument("--stages", help=f"the stages to run, comma-separated, of {','.join(STAGES)} (default all but "
                                    "sanitize; install always runs: the others import what it built)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        harness.print_result(CHILDREN[args.child[0]](json.loads(args.child[1])))
        return 0
    # Children find the tree only where the install stage puts it first on their path (Run.env).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != ROOT)
    if args.rehearse:  # the CPU's way on a GPU machine too: no child sees a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sizes = REHEARSAL if args.rehearse else REAL
    if args.total_s:
        sizes = replace(sizes, total_s=args.total_s)
    if args.ks:
        sizes = replace(sizes, ks=tuple(int(k) for k in args.ks.split(",")))
    if args.dtypes:
        dtypes = tuple(args.dtypes.split(","))
        if not set(dtypes) <= {"fp32", "bf16"}:
            p.error(f"--dtypes takes fp32 and bf16, got {args.dtypes}")
        sizes = replace(sizes, dtypes=dtypes)
    stages = DEFAULT_STAGES
    if args.stages:
        chosen = set(args.stages.split(","))
        if not chosen <= set(STAGES):
            p.error(f"--stages takes {','.join(STAGES)}, got {args.stages}")
        stages = tuple(n for n in STAGES if n in chosen or n == "install")
    os.makedirs(args.out, exist_ok=True)
    kit = find_kit(args.kit or os.path.join(ROOT, "gpu_kit"))
    if kit.fio_bin:  # fio from the kit: harness.fio_reference and the children find it on PATH
        os.environ["PATH"] = kit.fio_bin + os.pathsep + os.environ.get("PATH", "")
    scratch = tempfile.mkdtemp(prefix="gpu-check-", dir=_gpu_install.scratch_parent(args.nvme_dir, ROOT))
    run = Run(sizes, args.out, scratch, kit, args.rehearse, stages=stages)
    open(run.log_path, "w").close()
    run.record = {"meta": {**harness.provenance(scratch), "command": "python -m bench.gpu_check " + " ".join(argv),
                           "rehearse": args.rehearse, "sizes": asdict(sizes), "scratch": scratch},
                  "stages": {}}
    run.say(f"{'rehearsal, ' if args.rehearse else ''}scratch {scratch} ({run.record['meta'].get('fstype')}), "
            f"kit {kit.path or 'none'}, out {args.out}")
    fns = {"install": stage_install, "tests": stage_tests,
           "sanitize": lambda r, st: _gpu_sanitize.stage_sanitize(r, st, run_pytest, "tests"),
           "disk": stage_disk, "aio": stage_aio,
           "train": stage_train, "lora": lambda r, st: _gpu_lora.stage_lora(r, st, disk_reference),
           "infer": lambda r, st: _gpu_infer.stage_infer(r, st, disk_reference)}
    try:
        for name in stages:
            run_stage(run, name, fns[name])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if run.installed_only:
            shutil.rmtree(run.installed_only, ignore_errors=True)
        run.record["meta"]["elapsed_s"] = round(time.monotonic() - run.t0, 1)
        run.write()
    statuses = {n: st["status"] for n, st in run.record["stages"].items()}
    run.say(f"done in {run.record['meta']['elapsed_s']} s: {statuses}; wrote {args.out}/gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
