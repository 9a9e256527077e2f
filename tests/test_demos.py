"""The two demos run and say OK: the main job (ZeRO-3 with NVMe offload on the standard
library's source, losses equal to plain PyTorch; ``--big`` beyond RAM) and the I/O demo."""
import os
import shutil
import sys

import nvmeio.demo
import zero.demo
from helpers import run_process
from zero.demo.stdlib_corpus import ByteBatches, stdlib_source_bytes


def test_zero_demo_matches_torch_with_nvme_offload(tmp_path, capsys):
    assert zero.demo.main(["--steps", "4", "--nvme_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert float(out.split("max relative difference of the losses ")[1].split()[0]) <= 1e-6
    before, after = (float(x.strip(" ,").split()[0]) for x in
                     out.split("held-out loss: ")[1].splitlines()[0].split("before"))
    assert after < before
    assert f"swap files under {tmp_path}" in out and out.rstrip().endswith("OK")
    assert list(tmp_path.iterdir()) == []          # swap files removed afterwards


def test_zero_demo_default_folder_is_made_and_removed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert zero.demo.main(["--steps", "2", "--check_steps", "2"]) == 0
    assert f"swap files under {tmp_path / 'nvmeio'}" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []          # the folder it made is gone too


def test_zero_demo_big_trains_states_larger_than_the_given_ram(tmp_path, capsys):
    ram_gib = 0.03
    assert zero.demo.main(["--big", "--ram_gib", str(ram_gib), "--nvme_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "built under zero.Init straight to NVMe" in out
    assert out.rstrip().endswith("OK: model states larger than RAM trained from NVMe")
    states_gib = float(out.split("model states ")[1].split(" GiB")[0])
    assert states_gib > ram_gib
    assert list(tmp_path.iterdir()) == []


def test_zero_demo_big_refuses_without_disk_space(tmp_path, capsys):
    free_gib = shutil.disk_usage(tmp_path).free / 2**30
    assert zero.demo.main(["--big", "--ram_gib", str(2 * free_gib), "--nvme_dir", str(tmp_path)]) == 2
    assert f"not enough disk space under {tmp_path}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_stdlib_corpus_is_deterministic_and_held_out_apart():
    data = stdlib_source_bytes(1 << 20)
    assert len(data) == 1 << 20 and data == stdlib_source_bytes(1 << 20)
    assert b"def " in data and b"import " in data
    a, b = ByteBatches(data, 32, 4, seed=3), ByteBatches(data, 32, 4, seed=3)
    x, y = a.next_batch()
    assert x.shape == (4, 32) and (x[:, 1:] == y[:, :-1]).all()
    assert all((u == v).all() for u, v in zip(b.next_batch(), (x, y)))
    for hx, hy in a.held_out_batches(2):
        assert hx.shape == (4, 32)
        assert bytes(hx[0].tolist()) in data[len(a.train):]


def test_io_demo_round_trips(tmp_path, capsys):
    assert nvmeio.demo.main(["--dir", str(tmp_path), "--size-mib", "16"]) == 0
    assert "bytes equal: True" in capsys.readouterr().out


def test_main_job_command_runs_from_the_repository_root(tmp_path):
    # The README's main job: the console script of the installed package, started in the
    # repository root as a newcomer would (a plain `python -m` there would import the
    # unbuilt source tree).
    script = shutil.which("zero_demo") or os.path.join(os.path.dirname(sys.executable), "zero_demo")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}  # not a rank of an earlier test's job
    env["XDG_CACHE_HOME"] = str(tmp_path)
    out = run_process([script, "--steps", "3"], cwd=root, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")
    assert "zero-3 nvme" in out.stderr and "tok_s=" in out.stderr     # the progress bar
    assert list(tmp_path.iterdir()) == []
