"""The process group zero.initialize makes waits $DEEPSPEED_TIMEOUT minutes for a rank (DeepSpeed's
variable, read as it does), else torch's default: what bounds how long a rank waits for a peer
that died during start-up or hangs (bench/crash_soak.py --ranks 2 measures the rest)."""
from datetime import timedelta

import pytest
import torch.distributed as dist

from zero.runtime import comm


@pytest.fixture
def launched(monkeypatch):
    """A launcher's variables, and init_process_group recording what it is given (no group made)."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    return calls


def test_deepspeed_timeout_minutes_become_the_groups_timeout(monkeypatch, launched):
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2")
    comm.init_distributed("gloo")
    assert launched == [{"backend": "gloo", "timeout": timedelta(minutes=2)}]


def test_without_it_the_group_gets_torchs_default(monkeypatch, launched):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    comm.init_distributed("gloo")
    assert launched == [{"backend": "gloo"}]


@pytest.mark.parametrize("raw, message", [("soon", "is not an integer"), ("0", "must be at least 1")])
def test_a_timeout_that_is_not_whole_minutes_is_an_error_naming_it(monkeypatch, launched, raw, message):
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"DEEPSPEED_TIMEOUT.*{message}"):
        comm.init_distributed("gloo")
    assert launched == []
