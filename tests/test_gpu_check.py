"""bench/gpu_check.py, the one call that verifies nvmeio on a GPU machine, and tools/gpu_kit.sh, the kit
it installs from: the rehearsal on the CPU runs every stage, and the kit the script lays out is found."""

import json
import os
import subprocess
import sys

from helpers import run_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ and tools/ are not installed: the root goes after the installed packages (test_tools.py's reason).
sys.path.append(REPO)

from bench import _gpu_report, gpu_check
from bench._gpu_install import Kit, find_kit, fits, install_plan

SCRIPT = os.path.join(REPO, "tools", "gpu_kit.sh")


def test_rehearsal_runs_every_stage_and_writes_json_and_markdown(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # -m from the root finds bench/
    r = run_process([sys.executable, "-m", "bench.gpu_check", "--rehearse", "--stages", ",".join(gpu_check.STAGES),
                     "--out", str(out)], timeout=400, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((out / "gpu_check.json").read_text())
    assert list(record["stages"]) == list(gpu_check.STAGES)
    statuses = {name: st["status"] for name, st in record["stages"].items()}
    assert statuses == {"install": "dry", "tests": "ok", "sanitize": "ok", "disk": "ok", "aio": "ok", "train": "ok",
                        "lora": "ok", "infer": "ok"}, \
        json.dumps({name: {k: st.get(k) for k in ("status", "error", "seconds", "budget_s")}
                    for name, st in record["stages"].items()}, indent=1)
    assert record["stages"]["install"]["probe"]["cuda"] is False  # its children see no GPU, even on a GPU machine
    for name in ("tests", "aio", "train", "lora", "infer"):  # the CUDA parts say they ran on the CPU
        assert gpu_check.NO_CUDA in record["stages"][name]["note"]
    sanitize = record["stages"]["sanitize"]  # one CUDA-suite test, on the CPU, without the sanitizer (it needs CUDA)
    assert (sanitize["passed"], sanitize["failed"], sanitize["skipped"]) == (1, 0, 0) and "sanitizer off" in sanitize["note"]
    assert "TORCH_CUDA_SANITIZER" not in " ".join(sanitize["runs"][0]["command"])
    train = record["stages"]["train"]
    assert [(row["dtype"], row["k"]) for row in train["runs"]] == [(d, k) for d in gpu_check.REHEARSAL.dtypes
                                                                   for k in gpu_check.REHEARSAL.ks]
    assert all(row["median_s"] > 0 and row["disk"]["seconds"] > 0 for row in train["runs"])
    # where each iteration's time went: one figure per iteration, the busiest thread's CPU within the process's
    for row in train["runs"]:
        n = len(row["times_s"])
        assert len(row["busiest_thread"]) == len(row["cpu_s"]) == len(row["blocked_s"]) == n
        assert all(0 <= t <= c + 0.02 for (_, t), c in zip(row["busiest_thread"], row["cpu_s"]))
    lora = record["stages"]["lora"]
    assert [(row["lora_model"], row["dtype"], row["flag"]) for row in lora["runs"]] == [
        ("stand-in", d, f) for d in gpu_check.REHEARSAL.dtypes for f in (False, True)] + [
        ("wide", "fp32", False), ("wide", "fp32", True)]  # bench/_gpu_lora.py [Note: the wide model]
    assert lora["models"]["wide"]["d_model"] == 2 * lora["models"]["stand-in"]["d_model"]
    for row in lora["runs"]:
        assert row["median_s"] > 0 and row["disk"]["seconds"] > 0 and row["swap_read_bytes"] > 0, row
        assert (row["quantized_units"] > 0) == row["flag"], row
        assert {"forward", "backward", "step", "flush", "blocked", "busiest_thread"} <= set(row["phases"]), row
    for model in ("stand-in", "wide"):
        off, on = ({r["flag"]: r for r in lora["runs"] if r["dtype"] == "fp32" and r["lora_model"] == model}[f]
                   for f in (False, True))
        assert on["swap_read_bytes"] < 0.5 * off["swap_read_bytes"]  # int8 codes and scales against fp32
    wide = [r for r in lora["runs"] if r["lora_model"] == "wide"]
    assert wide[0]["swap_read_bytes"] > lora["runs"][0]["swap_read_bytes"]  # the wider base reads more
    md = (out / "gpu_check.md").read_text()
    for name in gpu_check.STAGES:
        assert f"| {name} | {statuses[name]} |" in md
    assert "wide fp32: bytes" in md and "| wide | fp32 | yes |" in md
    infer = record["stages"]["infer"]  # bench/_gpu_infer.py: generate from NVMe at each batch size
    assert [row["batch"] for row in infer["rows"]] == list(gpu_check.REHEARSAL.infer_batches)
    first = infer["rows"][0]
    for row in infer["rows"]:  # a decode forward reads the same bytes whatever the batch
        assert row["read_bytes_per_forward"] == first["read_bytes_per_forward"] > 0
        assert row["decode_s"] > 0 and row["disk_s"] > 0 and row["to_disk"] > 0
    assert "## ZeRO-Inference" in md and "## Tests under the CUDA sanitizer" in md
    assert "[gpu_check" in r.stdout and (out / "gpu_check.log").stat().st_size > 0


def test_stages_picks_some_and_install_always_runs(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    r = run_process([sys.executable, "-m", "bench.gpu_check", "--rehearse", "--stages", "disk", "--out", str(out)],
                    timeout=200, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(json.loads((out / "gpu_check.json").read_text())["stages"]) == ["install", "disk"]
    bad = run_process([sys.executable, "-m", "bench.gpu_check", "--rehearse", "--stages", "disk,lroa", "--out",
                       str(out)], timeout=60, cwd=REPO, env=env)
    assert bad.returncode == 2 and "--stages takes install,tests,sanitize,disk,aio,train,lora,infer, got disk,lroa" in bad.stderr


def test_a_stage_without_a_budget_leaves_the_later_stages_theirs(tmp_path):
    run = gpu_check.Run(gpu_check.REAL, str(tmp_path), str(tmp_path), Kit(None), rehearse=True)
    got = {}

    def record(r, stage):
        got["train"] = stage.deadline - stage.start
        return {"status": "ok"}
    run.record = {"meta": {}, "stages": {}}
    run.write = lambda: None
    gpu_check.run_stage(run, "train", record)
    left = gpu_check.REAL.total_s - gpu_check.REAL.budgets["lora"] - gpu_check.REAL.budgets["infer"]
    assert left - 5 < got["train"] <= left
    run.stages = ("install", "train")
    gpu_check.run_stage(run, "train", record)
    assert got["train"] > left


def test_kit_script_is_valid_bash():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def fake_kit(root):
    """A tiny kit laid out as tools/gpu_kit.sh lays one out (its header), with empty files."""
    wheels = ["pydantic-2.13.4-py3-none-any.whl",
              "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
              "kvikio_cu13-26.10.0-cp311-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
              "nvmeio_kit_test_only-1.0-py3-none-any.whl"]  # a distribution installed nowhere
    for rel in [*(f"wheels/{w}" for w in wheels), "liburing/include/liburing.h",
                "liburing/include/liburing/io_uring.h", "liburing/lib/liburing.a", "fio/bin/fio", "MANIFEST.txt"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    return wheels


def test_kit_detection_finds_a_kit_laid_out_as_the_script_lays_it_out(tmp_path):
    script = open(SCRIPT).read()
    for path in ('"$KIT/wheels"', "$KIT/liburing/include/", "$KIT/liburing/lib/", '"$KIT/fio"', "$KIT/MANIFEST.txt"):
        assert path in script  # the layout this test fakes is the script's
    wheels = fake_kit(tmp_path)
    kit = find_kit(str(tmp_path))
    assert [os.path.basename(w) for w in kit.wheels] == sorted(wheels)
    assert kit.liburing_include == str(tmp_path / "liburing" / "include")
    assert kit.liburing_library == str(tmp_path / "liburing" / "lib" / "liburing.a")
    assert kit.fio_bin == str(tmp_path / "fio" / "bin") and kit.manifest
    plan = install_plan(kit, REPO)
    (_, pip_wheels), (_, build) = plan["commands"]
    assert str(tmp_path / "wheels" / "nvmeio_kit_test_only-1.0-py3-none-any.whl") in pip_wheels
    assert "--no-index" in build and "--no-build-isolation" in build and build[-1] == REPO
    assert f"--config-settings=cmake.define.LIBURING_LIBRARY={kit.liburing_library}" in build
    assert f"--config-settings=cmake.define.LIBURING_INCLUDE_DIR={kit.liburing_include}" in build


def test_no_kit_is_the_empty_kit_and_the_build_takes_the_systems_liburing(tmp_path):
    kit = find_kit(str(tmp_path / "absent"))
    assert kit == Kit()
    plan = install_plan(kit, REPO)
    assert [title for title, _ in plan["commands"]] == ["pip install nvmeio from the tree"]
    assert not any("LIBURING" in a for a in plan["commands"][0][1])
    assert any("no kit" in w for w in plan["warnings"])


def test_wheel_tags_for_cpython_3_12_on_manylinux_x86_64():
    assert fits("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert fits("kvikio_cu13-26.10.0-cp311-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")  # abi3 from 3.11
    assert fits("rapids_logger-0.3.0-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert not fits("pydantic_core-2.46.4-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not fits("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_aarch64.whl")
    assert not fits("kvikio_cu13-26.10.0-cp313-abi3-manylinux_2_28_x86_64.whl")


def test_junit_counts_passed_failed_errors_skipped(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="a"/>'
                   '<testcase classname="t" name="b"><failure message="assert 1 == 2&#10;more"/></testcase>'
                   '<testcase classname="t" name="c"><skipped/></testcase>'
                   '<testcase classname="t" name="d"><error message="fixture broke"/></testcase></testsuite></testsuites>')
    got = gpu_check.junit_counts(str(xml))
    assert {k: got[k] for k in ("passed", "failed", "errors", "skipped")} == {"passed": 1, "failed": 1, "errors": 1,
                                                                             "skipped": 1}
    assert got["failures"] == [{"test": "t::b", "kind": "failure", "message": "assert 1 == 2"},
                               {"test": "t::d", "kind": "error", "message": "fixture broke"}]
    assert gpu_check.junit_counts(str(tmp_path / "none.xml")) == {"report": "none: pytest did not finish"}


def test_a_tests_run_stopped_before_its_junit_file_is_counted_from_its_verbose_lines():
    output = "\n".join([
        "tests/test_cuda_engine.py::test_training_equals_plain_torch_on_the_same_device[3-nvme-nvme] PASSED [  1%]",
        "tests/test_cuda_engine.py::test_gathered_parameters_modified_on_rank_0_in_training FAILED [  2%]",
        "tests/test_gpu_copies.py::test_on_cuda_staged_writes_queued_behind_kernels_land_exactly[dtype0] SKIPPED (x) [ 3%]",
        "tests/test_cuda_paths.py::test_staging ERROR [  4%]",
        "some captured line that mentions PASSED",
        "timed out after 150 s"])
    counts = gpu_check.outcome_counts(output)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert [f["test"] for f in counts["failures"]] == [
        "tests/test_cuda_engine.py::test_gathered_parameters_modified_on_rank_0_in_training",
        "tests/test_cuda_paths.py::test_staging"]
    assert "did not finish" in counts["report"]


def csan_output() -> str:
    """pytest's output around a report printed by torch's own sanitizer class (its format): each stack
    outermost first, pytest's frames and then ours."""
    import traceback

    from torch.cuda._sanitizer import Access, AccessType, UnsynchronizedAccessError

    def stack(*ours):
        frames = [("/usr/lib/python3.12/runpy.py", 198, "_run_module_as_main", "return _run_code(code)"),
                  ("/usr/lib/python3/site-packages/_pytest/python.py", 159, "pytest_pyfunc_call", "result = f()")]
        frames += [(f"/root/repo/{path}", line, name, code) for path, line, name, code in ours]
        return traceback.StackSummary.from_list(
            [traceback.FrameSummary(f, n, name, line=code) for f, n, name, code in frames])

    now = Access(AccessType.READ, 9, 94, "aten::add.Tensor(Tensor self, Tensor other) -> Tensor", ["self"], False,
                 stack(("zero/runtime/unit.py", 207, "gather", "out = shard + 0")))
    before = Access(AccessType.WRITE, 8, 93, "aten::copy_(Tensor(a!) self, Tensor src) -> Tensor(a!)", ["self"], True,
                    stack(("zero/runtime/host_to_device.py", 54, "start_copy", "out.copy_(shard, non_blocking=True)")))
    report = str(UnsynchronizedAccessError(139823, None, now, before))
    return "tests/test_cuda_engine.py::test_x[a] PASSED\n" + report + "\ntests/test_cuda_engine.py::test_x[b] FAILED\n"


def test_the_sanitizers_reports_are_kept_from_pytests_output_and_fail_the_stage(tmp_path):
    from bench import _gpu_sanitize

    tests = os.path.join(REPO, "tests")
    for name in _gpu_sanitize.FILES + _gpu_sanitize.DELIBERATE + (_gpu_sanitize.REHEARSAL_TEST,):
        file, _, test = name.partition("::")
        assert os.path.exists(os.path.join(tests, file))
        assert not test or f"def {test.split('[')[0]}(" in open(os.path.join(tests, file)).read()

    output = csan_output()
    found = _gpu_sanitize.races(output + output)  # printed twice (as raised, and in pytest's summary): kept once
    assert len(found) == 1
    report = found[0].splitlines()
    assert report[0] == "CSAN detected a possible data race on tensor with data pointer 139823"
    for line in ("Access by stream 94 during kernel:", "reading from argument(s) self",
                 '  File "/root/repo/zero/runtime/unit.py", line 207, in gather', "    out = shard + 0",
                 "Previous access by stream 93 during kernel:", "writing to argument(s) self, and to the output",
                 '  File "/root/repo/zero/runtime/host_to_device.py", line 54, in start_copy'):
        assert line in report, (line, report)
    assert not any("_pytest" in line or "runpy" in line or "return _run_code" in line for line in report), report
    assert not any("::test_x" in line for line in report)
    assert _gpu_sanitize.races("tests/x.py::y PASSED\n") == []
    assert "sanitize" in gpu_check.STAGES and "sanitize" not in gpu_check.DEFAULT_STAGES  # only when named

    class FakeRun:
        cuda = True

    calls = []

    def run_pytest(run, stage, runs, env, inspect):
        calls.append((runs, env))
        step = {"title": runs[0][0], "returncode": 1, "seconds": 3.0, "passed": 1, "failed": 1, **inspect(output)}
        return {"status": "failed", "runs": [step], "passed": 1, "failed": 1}

    out = _gpu_sanitize.stage_sanitize(FakeRun(), None, run_pytest, "tests")
    (runs, env), = calls
    assert env == {"TORCH_CUDA_SANITIZER": "1"} and runs[0][1][:2] == ["-m", "cuda"]
    assert runs[0][1][2:] == ["--capture=tee-sys", "--deselect", f"tests/{_gpu_sanitize.DELIBERATE[0]}"] + [
        f"tests/{f}" for f in _gpu_sanitize.FILES]
    assert out["status"] == "failed" and "1 unordered access" in out["error"] and len(out["races"]) == 1
    assert "races" not in out["runs"][0]
    md = _gpu_report.markdown({"meta": {"started": "t", "commit": "c", "host": "h", "nproc": 1, "ram_bytes": 1 << 30,
                                        "kernel": "k", "python": "3", "command": "x"},
                               "stages": {"sanitize": {**out, "seconds": 1, "budget_s": 2, "skipped": 0, "errors": 0}}})
    assert "## Sanitizer reports" in md and "CSAN detected a possible data race" in md
