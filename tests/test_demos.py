"""The two demos run and say OK: the main job (ZeRO-3 with NVMe offload,
losses equal to plain PyTorch) and the I/O demo."""

import nvmeio.demo
import zero.demo


def test_zero_demo_matches_torch_with_nvme_offload(tmp_path, capsys):
    assert zero.demo.main(["--steps", "4", "--nvme_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "max relative difference of the losses" in out and out.rstrip().endswith("OK")
    assert list(tmp_path.iterdir()) == []          # swap files removed afterwards


def test_io_demo_round_trips(tmp_path, capsys):
    assert nvmeio.demo.main(["--dir", str(tmp_path), "--size-mib", "16"]) == 0
    assert "bytes equal: True" in capsys.readouterr().out


def test_main_job_command_runs_from_the_repository_root():
    # The README's main job: the console script, started in the repository
    # root as a newcomer would (a plain `python -m` there would import the
    # unbuilt source tree).
    import os
    import shutil
    import subprocess
    import sys

    script = shutil.which("zero_demo") or os.path.join(os.path.dirname(sys.executable), "zero_demo")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([script, "--steps", "3"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")
