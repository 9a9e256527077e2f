"""NVMEIO_* environment variables: one reader, one spelling of booleans, clear errors."""

import pytest

import nvmeio
from nvmeio.cuda_staging import StagingConfig
from nvmeio.env import env_flag, env_int, env_str
from nvmeio.hints import did_you_mean, hint


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False),
])
def test_flags_accept_every_usual_spelling(monkeypatch, raw, expected):
    monkeypatch.setenv("NVMEIO_TEST_FLAG", raw)
    assert env_flag("NVMEIO_TEST_FLAG", not expected) is expected


def test_unset_or_empty_is_the_default(monkeypatch):
    monkeypatch.delenv("NVMEIO_TEST_FLAG", raising=False)
    assert env_flag("NVMEIO_TEST_FLAG", True) is True
    monkeypatch.setenv("NVMEIO_TEST_FLAG", "")
    assert env_flag("NVMEIO_TEST_FLAG", False) is False and env_str("NVMEIO_TEST_FLAG") is None
    assert env_int("NVMEIO_TEST_FLAG", 7, 1) == 7


@pytest.mark.parametrize("name", ["NVMEIO_DIRECT_IO", "NVMEIO_MLOCK"])
def test_a_flag_that_is_not_a_boolean_is_an_error(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}='maybe' is not a boolean; use one of "
                                         "1/true/yes/on or 0/false/no/off"):
        if name == "NVMEIO_DIRECT_IO":
            nvmeio.aio_handle()
        else:
            import torch

            nvmeio.aio_handle().new_cpu_locked_tensor(8, torch.empty(0))


def test_direct_io_off_is_read_with_any_spelling(monkeypatch, tmp_path):
    monkeypatch.setenv("NVMEIO_DIRECT_IO", "off")
    h = nvmeio.aio_handle()
    with pytest.warns(RuntimeWarning, match="buffered"):
        h.sync_pwrite(bytearray(4096), str(tmp_path / "f.bin"))
    assert h.buffered_fallback()


def test_integers_are_checked(monkeypatch):
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "4")
    assert StagingConfig.from_env(1 << 20, 1).num_chunks == 4
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "x")
    with pytest.raises(ValueError, match="NVMEIO_STAGING_CHUNKS='x' is not an integer"):
        StagingConfig.from_env(1 << 20, 1)


def test_did_you_mean_is_shared():
    assert did_you_mean("queue_dept", ["block_size", "queue_depth"]) == "queue_depth"
    assert did_you_mean("IO_URING", ["io_uring", "aio"], ignore_case=True) == "io_uring"
    assert did_you_mean("zzz", ["block_size"]) is None
    assert hint("zzz", ["a", "b"]) == "known keys: a, b"
