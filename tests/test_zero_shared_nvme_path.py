"""Two jobs sharing one nvme_path (a shared mount): the swap directory of a job on another host
is never deleted, the error says how to give each job its own job id, and the job id set in the
config or the environment puts the swap files under it.
"""

import pytest
import torch

import zero
from swapper import SwapDirectoryInUseError
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config, train_engine

CFG = GPTConfig()


def config(nvme, **zero_extra):
    return base_config("nvme", "nvme", nvme, **zero_extra)


def plant_other_hosts_job(nvme, job):
    """What a job on another host leaves under the shared nvme_path while it runs."""
    rank = nvme / job / "rank0"
    (rank / "params").mkdir(parents=True)
    (rank / ".owner@node-b@4242").mkdir()
    (rank / "params" / "param_unit0.root.swp").write_bytes(b"live state" * 100)
    return rank / "params" / "param_unit0.root.swp"


def test_another_hosts_job_is_refused_with_how_to_set_the_job_id(tmp_path):
    live = plant_other_hosts_job(tmp_path, "shared")
    torch.manual_seed(0)
    with pytest.raises(SwapDirectoryInUseError) as info:
        zero.initialize(model=GPT(CFG), config=config(tmp_path, nvme_job_id="shared"))
    message = str(info.value)
    assert "process 4242 on host node-b, which cannot be checked from" in message
    assert "never deleted automatically" in message
    assert "zero_optimization.nvme_job_id" in message and "NVMEIO_JOB_ID" in message
    assert live.read_bytes() == b"live state" * 100


@pytest.mark.parametrize("how", ["config", "environment"])
def test_the_job_id_puts_the_swap_files_under_it(tmp_path, monkeypatch, how):
    live = plant_other_hosts_job(tmp_path, "zero_stage_3")
    cfg = config(tmp_path)
    if how == "config":
        cfg["zero_optimization"]["nvme_job_id"] = "job-b"
    else:
        monkeypatch.setenv("NVMEIO_JOB_ID", "job-b")
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=cfg)
    assert engine.parts.param_store.swap_dir == str(tmp_path / "job-b" / "rank0" / "params")
    assert engine.parts.optimizer_store.swap_dir == str(tmp_path / "job-b" / "rank0" / "optimizer")
    losses = train_engine(engine, make_batches(CFG, 2, 4), 2)
    assert all(map(lambda x: x == x, losses))
    engine.destroy()
    assert not (tmp_path / "job-b").exists()
    assert live.read_bytes() == b"live state" * 100


def test_a_job_id_that_is_not_a_plain_name_is_refused(tmp_path):
    with pytest.raises(zero.ConfigError, match="nvme_job_id: expected a plain directory name"):
        zero.load_config(config(tmp_path, nvme_job_id="../elsewhere"))
