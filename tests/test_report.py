"""nvmeio_report (python -m nvmeio.report): every piece is reported, each
missing one with its fix, --dir says whether O_DIRECT works there."""

import json
import os
import subprocess
import sys

import pytest

import nvmeio
from helpers import is_root, run_process


def report(*args):
    return run_process([sys.executable, "-m", "nvmeio.report", *map(str, args)], timeout=60)


def checks(*args):
    r = report("--json", *args)
    return r.returncode, {(c["section"], c["name"]): c for c in json.loads(r.stdout)["checks"]}


@pytest.fixture(scope="module")
def found():
    """The checks of one plain ``--json`` report."""
    rc, result = checks()
    assert rc == 0
    return result


def test_text_report_names_version_backends_memlock_and_gpu_pieces():
    r = report()
    assert r.returncode == 0, r.stderr
    for text in (nvmeio.__version__, "io_uring", "aio", "psync", "memlock limit", "CUDA",
                 "cuFile", "kvikio", "gds_handle", "pass --dir DIR"):
        assert text in r.stdout


def test_available_backends_are_ok_and_the_others_have_a_fix(found):
    available = nvmeio.available_backends()
    for name in ("io_uring", "aio", "psync"):
        c = found[("backends", name)]
        assert (c["status"] == "ok") == (name in available)
        if name not in available:
            assert c["fix"]
    assert "io_uring compiled in" in found[("backends", "build")]["detail"]


def test_every_missing_piece_has_one_fix(found):
    for c in found.values():
        if c["status"] in ("warn", "no") and c["name"] != "gds_handle":
            assert c["fix"], c


def test_version_matches_the_package(found):
    assert found[("nvmeio", "version")]["detail"] == nvmeio.__version__


def test_cuda_missing_says_how_to_get_it(found):
    import torch

    c = found[("gpu", "CUDA")]
    if torch.cuda.is_available():
        assert c["status"] == "ok"
    else:
        assert c["status"] == "no" and "torch" in c["fix"]


def test_dir_with_o_direct_is_ok_and_left_clean(tmp_path):
    rc, found = checks("--dir", tmp_path)
    assert rc == 0
    c = found[("directories", str(tmp_path))]
    assert c["status"] == "ok" and "O_DIRECT works" in c["detail"]
    assert os.listdir(tmp_path) == []


def test_missing_dir_exits_1_with_mkdir_fix(tmp_path):
    missing = tmp_path / "missing"
    r = report("--dir", missing)
    assert r.returncode == 1
    assert "does not exist" in r.stdout and f"fix: mkdir -p {missing}" in r.stdout


def test_dir_without_o_direct_is_a_warning(tmp_path):
    d = tmp_path / "ramfs"
    d.mkdir()
    if not is_root() or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)],
                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here (needs root and mount rights)")
    try:
        rc, found = checks("--dir", d)
        assert os.listdir(d) == []  # the refused O_DIRECT probe file is removed too
    finally:
        subprocess.run(["umount", str(d)], check=True)
    c = found[("directories", str(d))]
    assert rc == 0 and c["status"] == "warn"
    assert "no O_DIRECT on ramfs" in c["detail"] and c["fix"]


def test_memlock_line_reports_the_limit_and_a_lock_attempt(found):
    c = found[("memory", "locked memory")]
    assert "memlock limit soft" in c["detail"] and "locking 64 MiB" in c["detail"]
    assert c["status"] == "ok" or "ulimit" in c["fix"] or "limits.conf" in c["fix"]
