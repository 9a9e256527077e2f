"""Environment variables: one declaration each (nvmeio/env.py), one reader, one spelling of
booleans, clear errors; docs/tuning.md lists them as declared."""

import os
import re

import pytest

import nvmeio
from nvmeio import env
from nvmeio._cuda_staging import StagingConfig
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


# -- the registry: one declaration per variable, every reader through it ---------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READS = re.compile(r"os\.environ|os\.getenv|\bgetenv\(|\benv_(?:flag|int|str)\(")


def _sources():
    for package in ("nvmeio", "swapper", "zero"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    yield os.path.relpath(path, REPO), open(path).read()


def test_tuning_md_lists_the_declared_variables():
    text = open(os.path.join(REPO, "docs", "tuning.md")).read()
    assert env.markdown_table() in text, "paste nvmeio.env.markdown_table() into docs/tuning.md:\n" + \
        env.markdown_table()


def test_no_module_reads_the_environment_but_the_registry():
    readers = [f"{path}:{n}" for path, text in _sources() if path != os.path.join("nvmeio", "env.py")
               for n, line in enumerate(text.splitlines(), 1) if READS.search(line)]
    assert readers == []


def test_every_variable_read_is_declared_and_every_declared_one_is_read():
    named = {m for _, text in _sources() for m in re.findall(r"env\.(?:get|is_set|default)\(\"(\w+)\"\)", text)}
    assert named - set(env.VARIABLES) == set()
    everything = "".join(text for path, text in _sources() if path != os.path.join("nvmeio", "env.py"))
    assert [name for name in env.VARIABLES if f'"{name}"' not in everything] == []


def test_reading_an_undeclared_variable_says_so(monkeypatch):
    with pytest.raises(KeyError, match="NVMEIO_DIRECTIO is not a declared environment variable "
                                       r"\(did you mean 'NVMEIO_DIRECT_IO'\?\)"):
        env.get("NVMEIO_DIRECTIO")
    monkeypatch.setenv("NVMEIO_STAGING_CHUNKS", "1")
    with pytest.raises(ValueError, match="NVMEIO_STAGING_CHUNKS=1 must be at least 2"):
        env.get("NVMEIO_STAGING_CHUNKS")
    monkeypatch.delenv("NVMEIO_STAGING_CHUNKS")
    assert env.get("NVMEIO_STAGING_CHUNKS") == env.default("NVMEIO_STAGING_CHUNKS") == 3
    monkeypatch.setenv("NVMEIO_JOB_ID", "")
    assert env.get("NVMEIO_JOB_ID") == "zero_stage_3" and not env.is_set("NVMEIO_JOB_ID")
