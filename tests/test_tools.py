"""tools/ (repository tooling, not installed): the bench/RESULTS.md section writer, the README's
commands that CI runs, and fio's job lines."""

import os
import sys

import pytest

from helpers import run_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tools/ is not installed: the root goes after the installed packages, never before them (it
# holds the source tree of nvmeio, without the native module CI builds only into the install).
sys.path.append(REPO)

from tools import fio, readme_commands
from tools.results_md import Figure, bar_chart, chart_link, replace_section, section_body


def test_replace_section_replaces_only_its_own(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\n## A\n\nold a\n\n## B\n\nold b\n")
    replace_section(md, "## A", "new a\nline 2")
    assert md.read_text() == "# results\n\n## A\n\nnew a\nline 2\n\n## B\n\nold b\n"
    replace_section(md, "## B", "new b")
    replace_section(md, "## C", "c")
    assert md.read_text() == "# results\n\n## A\n\nnew a\nline 2\n\n## B\n\nnew b\n\n## C\n\nc\n"


def test_a_section_leads_with_its_headline_and_new_sections_go_before_the_changelog(tmp_path):
    body = section_body([Figure("x / fio", "**1.10x**", "≤ 1.2x", True, "today"), Figure("y", "3")],
                        "python -m bench.x", "details")
    assert body.splitlines()[2:4] == ["| x / fio | **1.10x** | ≤ 1.2x | yes | today |", "| y | 3 | — | — |  |"]
    assert body.endswith("Reproduce: `python -m bench.x`\n\ndetails")
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\n## A\n\na\n\n## Changelog\n\n- then\n")
    replace_section(md, "## B", "b")
    assert md.read_text() == "# results\n\n## A\n\na\n\n## B\n\nb\n\n## Changelog\n\n- then\n"


def test_bar_chart_writes_a_png_linked_relative_to_the_results(tmp_path):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    png = bar_chart(tmp_path / "charts" / "x.png", "t", ["write", "read"],
                    {"fio": [7.4, 3.4], "aio_handle": [7.3, 3.5]})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart_link(png, tmp_path / "RESULTS.md", "x") == "![x](charts/x.png)"
    assert chart_link(None, tmp_path / "RESULTS.md") == ""


def test_ci_runs_exactly_the_readmes_test_command():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    cmds = readme_commands.commands(readme)
    assert f"```bash\n{cmds['test']}\n```" in readme.split("Tests:", 1)[1]
    assert cmds["test"].endswith('pip install ".[test]" && ruff check . && pytest -q tests')
    assert "pip install" in cmds["setup"]
    out = run_process([sys.executable, os.path.join(REPO, "tools", "readme_commands.py"), "test"],
                      check=True).stdout.strip()
    assert out == cmds["test"]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        last = [line for line in f.read().splitlines() if line.strip()][-1]
    assert last == cmds["test"]


def test_readme_without_a_test_block_is_an_error():
    with pytest.raises(ValueError, match="after a line 'Tests:'"):
        readme_commands.commands("```bash\npip install .\n```\n")


def test_fio_job_line_and_huge_page_need():
    job = fio.FioJob("read", 1 << 30, bs=4 << 20, mem="mmaphuge", engine="io_uring")
    argv = job.argv("/d/f.bin")
    for arg in ("--rw=read", "--bs=4194304", "--mem=mmaphuge", "--ioengine=io_uring", "--direct=1",
                "--size=1073741824", "--filename=/d/f.bin"):
        assert arg in argv
    assert "--fallocate=none" not in argv
    jobs = fio.sweep_jobs("write", 1 << 30, depths=((32, 1), (16, 4)))
    assert len(jobs) == len(fio.ENGINES) * len(fio.MEM_TYPES) * len(fio.BLOCK_SIZES) * 2
    assert {(j.bs, j.mem) for j in jobs} == {(b, m) for b in fio.BLOCK_SIZES for m in fio.MEM_TYPES}
    assert fio.buffer_bytes(jobs) == max(fio.BLOCK_SIZES) * 64
    split = fio.FioJob("write", 1 << 30, bs=4 << 20, numjobs=4, split=True).argv("/d/f.bin")
    assert "--size=268435456" in split and "--offset_increment=268435456" in split  # 1 GiB in all
    assert "--offset_increment" not in " ".join(fio.FioJob("write", 1 << 30, numjobs=4).argv("/d/f.bin"))


def test_fio_io_size_wraps_a_smaller_file_and_jobs_run_together_in_one_process(tmp_path):
    job = fio.FioJob("read", 8 << 20, bs=4 << 20, io_size=32 << 20)
    assert "--io_size=33554432" in job.argv("/d/f.bin") and "--size=8388608" in job.argv("/d/f.bin")
    assert "--io_size" not in " ".join(fio.FioJob("read", 8 << 20).argv("/d/f.bin"))
    if not fio.available():
        pytest.skip("fio is not installed")
    out = fio.read_write_together(20 << 20, 6 << 20, str(tmp_path), runs=2, mem="malloc", file_cap=8 << 20)
    # byte counts rounded up to the block; the read wraps around a file of file_cap bytes
    assert (out["read_bytes"], out["write_bytes"]) == (20 << 20, 8 << 20)
    assert os.path.getsize(tmp_path / "fio-read.bin") == 8 << 20
    assert len(out["runs"]) == 2 and out["seconds"] == min(r["seconds"] for r in out["runs"])
    for run in out["runs"]:
        assert {j["rw"]: j["bytes"] for j in run["jobs"]} == {"read": 20 << 20, "write": 8 << 20}
        assert run["seconds"] == max(j["seconds"] for j in run["jobs"])
