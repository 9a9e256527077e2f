"""bench/gpu_check.py's ``sanitize`` stage: the engine's CUDA tests under torch's CUDA stream sanitizer.

[Note: what the sanitize stage looks for]
The engine's copies run on streams of their own (zero/runtime/host_to_device.py,
zero/runtime/device_to_host.py, zero/runtime/write_back.py, zero/runtime/activation_spill.py), ordered with the compute stream by events. A missing wait
is a race that a comparison of weights catches only when the GPU happens to lose it, and a CPU
catches never (there is no second stream there). torch's CUDA sanitizer (CSAN, switched on by
the environment variable ``TORCH_CUDA_SANITIZER`` as torch is imported) records every kernel's
reads and writes of device memory per stream, with the events recorded, waited for and
synchronized, and raises at the first access not ordered after the last conflicting one: the
race shows every time, with both accesses' stacks. It sees what runs under the dispatcher in a
thread that has its mode: the main thread and autograd's device threads (the loop of
micro-batches, the step, the crossing of gradients during backward). It does not see the
threads of ``train_batch``'s window (zero/runtime/window.py: their forwards' gathers, copies ahead and
spilled activations) nor nvmeio's staging thread (aio_handle with CUDA tensors, whose tests are
not run here). Host memory is not tracked: the host-side waits (a slab read only after its
copy's event) stay the CPU fakes' to check (tests/test_gpu_copies.py, tests/test_write_back.py).
A report is printed as the sanitizer raises (pytest's ``--capture=tee-sys``), so a run stopped at
its budget keeps the reports made so far; each is kept with the frames of this repository only
(the sanitizer prints the whole stack, pytest's included).

The stage is not in a default run (it would take the training stage's time): ``--stages`` names it.

On the CPU (the rehearsal) the sanitizer cannot run (it asks torch for the current CUDA stream at
every op); the stage runs one CUDA-suite test with the CPU as its device, plainly, to check the
stage itself.
"""
from __future__ import annotations

import os
import re

FILES = ("test_gpu_copies.py", "test_activation_spill.py", "test_cuda_engine.py")  # the protocol first
# Tests whose race is the point: a saved activation changed in place while its copy to the host may
# still read it, which backward then refuses (autograd's version check); the sanitizer would stop
# the change itself.
DELIBERATE = ("test_activation_spill.py::test_on_cuda_saving_waits_for_no_copy_and_an_in_place_change_after_it_is_refused",)
REHEARSAL_TEST = "test_cuda_engine.py::test_training_equals_plain_torch_on_the_same_device[s0-o-none-fp32-k1-loop]"
ENV = {"TORCH_CUDA_SANITIZER": "1"}
_RACE = re.compile(r"^CSAN detected a possible data race")
_FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+')
_OURS = re.compile(r"/(zero|nvmeio|swapper|tests|bench)/")
_END = re.compile(r"^(=====|_____|\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED))")


def pytest_runs(rel: str, cuda: bool) -> list:
    """(title, pytest arguments) of the stage's one run; ``rel``: the tests' folder, from where pytest runs."""
    if not cuda:
        return [("one CUDA-suite test on the CPU, without the sanitizer", ["--cuda-suite-on-cpu",
                                                                            os.path.join(rel, REHEARSAL_TEST)])]
    deselect = [a for t in DELIBERATE for a in ("--deselect", os.path.join(rel, t))]
    return [("the engine's CUDA tests under TORCH_CUDA_SANITIZER=1",
             ["-m", "cuda", "--capture=tee-sys", *deselect, *(os.path.join(rel, f) for f in FILES)])]


def races(output: str, most: int = 5, lines: int = 80) -> list:
    """The sanitizer's reports in pytest's output, each once (pytest may print one twice), at most
    ``most``: every line but the stack frames outside this repository (a frame is its ``File``
    line and the source line under it), at most ``lines`` of each."""
    text, out = output.splitlines(), []
    for start, line in enumerate(text):
        if not _RACE.match(line):
            continue
        kept, skipping = [line], False
        for line in text[start + 1:]:
            if _END.match(line) or _RACE.match(line):
                break
            frame = _FRAME.match(line)
            if frame:
                skipping = not _OURS.search(frame["path"])
            elif not line.startswith("    "):
                skipping = False
            if not skipping:
                kept.append(line)
        report = "\n".join(kept[:lines]).rstrip()
        if report not in out:
            out.append(report)
    return out[:most]


def stage_sanitize(run, stage, run_pytest, tests_rel: str) -> dict:
    """``run_pytest(run, stage, runs, env, inspect)`` is gpu_check's (the tests stage's counting and
    verdict); ``tests_rel``: the tests' folder, from where pytest runs."""
    out = run_pytest(run, stage, pytest_runs(tests_rel, run.cuda), ENV if run.cuda else None,
                     lambda output: {"races": races(output)})
    found = [r for step in out["runs"] for r in step.pop("races")]
    if found:
        out.update(races=found, status="failed",
                   error=f"the sanitizer reported {len(found)} unordered access{'es' if len(found) > 1 else ''}")
    if not run.cuda:
        out["note"] = "no CUDA: one CUDA-suite test on the CPU, the sanitizer off (it needs CUDA)"
    return out


def details(st: dict) -> list:
    """The markdown's section: the reports, verbatim."""
    if not st.get("races"):
        return []
    out = ["## Sanitizer reports", ""]
    for r in st["races"]:
        out += ["```", r, "```", ""]
    return out
