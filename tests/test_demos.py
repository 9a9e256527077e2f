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
