"""nvmeio.atomic_file: a temporary file nobody can plant anything at, published
over its target atomically; a failure leaves the target as it was and no
temporary file behind. A device node is written in place; a FIFO or socket is
refused."""

import errno
import itertools
import os
import stat

import pytest

import nvmeio
from helpers import FULL_DEVICE, NULL_DEVICE, char_device_node, fifo_unblocked_after, special_file
from nvmeio import atomic_file


@pytest.fixture(params=["anonymous", "named"])
def temp_kind(request, monkeypatch):
    """Both ways of making the temporary file: O_TMPFILE, and the exclusive
    random name used where a file system has no O_TMPFILE."""
    if request.param == "named":
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    elif not hasattr(os, "O_TMPFILE"):
        pytest.skip("this Python has no os.O_TMPFILE")
    return request.param


def test_write_atomically_replaces_the_file_0600_and_leaves_nothing_else(tmp_path, temp_kind):
    target = tmp_path / "latest"
    target.write_bytes(b"global_step1")
    os.chmod(target, 0o644)
    atomic_file.write_atomically(target, b"global_step2")
    assert target.read_bytes() == b"global_step2"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["latest"]
    atomic_file.write_atomically(tmp_path / "new", b"x")   # a new target: linked in one step
    assert sorted(os.listdir(tmp_path)) == ["latest", "new"]


def test_a_symlink_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch):
    # The named form with a predictable name (the attacker's best case): the
    # planted link makes O_EXCL fail, a fresh name is drawn, the victim is untouched.
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    names = itertools.chain(["predictable"], (f"fresh{i}" for i in itertools.count()))
    monkeypatch.setattr(atomic_file.secrets, "token_hex", lambda n: next(names))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / ".latest.predictable.tmp"
    planted.symlink_to(victim)
    atomic_file.write_atomically(tmp_path / "latest", b"global_step7")
    assert victim.read_bytes() == b"precious"
    assert (tmp_path / "latest").read_bytes() == b"global_step7"
    assert planted.is_symlink()                      # somebody else's file: left alone
    assert sorted(os.listdir(tmp_path)) == [".latest.predictable.tmp", "latest", "victim"]


def test_an_anonymous_temporary_file_has_no_name_to_plant_at(tmp_path):
    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("this Python has no os.O_TMPFILE")
    with atomic_file.replacing(tmp_path / "t") as tmp:
        os.write(tmp.fd, b"data")
        assert tmp.name is None and os.listdir(tmp_path) == []
        assert open(tmp.io_path, "rb").read() == b"data"   # io_path opens this very file
    assert (tmp_path / "t").read_bytes() == b"data"


def test_a_target_that_is_a_symlink_is_replaced_not_written_through(tmp_path, temp_kind):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "latest").symlink_to(victim)
    atomic_file.write_atomically(tmp_path / "latest", b"new")
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "latest").is_symlink()
    assert (tmp_path / "latest").read_bytes() == b"new"


def test_an_exception_leaves_the_target_and_no_temporary_file(tmp_path, temp_kind):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file.replacing(target) as tmp:
            os.write(tmp.fd, b"half")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.bin"]


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="NUL byte"):
        atomic_file.write_atomically(f"{tmp_path}/victim\0.ignored", b"x")
    with pytest.raises(FileNotFoundError):
        atomic_file.write_atomically(tmp_path / "missing" / "latest", b"x")
    assert os.listdir(tmp_path) == []
    with atomic_file.replacing(tmp_path / "once") as tmp:
        tmp.publish()
        with pytest.raises(ValueError, match="already published"):
            tmp.publish()


def test_a_device_node_is_written_in_place_not_replaced(tmp_path):
    null = char_device_node(tmp_path / "null", NULL_DEVICE)
    full = char_device_node(tmp_path / "full", FULL_DEVICE)
    atomic_file.write_atomically(null, b"global_step2")    # fsync's EINVAL is no error
    with pytest.raises(OSError) as e:                     # the bytes went to the device itself
        atomic_file.write_atomically(full, b"global_step2")
    assert e.value.errno == errno.ENOSPC
    assert [(stat.S_IFMT(os.stat(p).st_mode), os.stat(p).st_rdev) for p in (null, full)] == [
        (stat.S_IFCHR, NULL_DEVICE), (stat.S_IFCHR, FULL_DEVICE)]
    assert sorted(os.listdir(tmp_path)) == ["full", "null"]


def test_a_fifo_is_refused_naming_what_it_is(tmp_path):
    fifo = special_file(tmp_path / "latest", "fifo")
    with fifo_unblocked_after(fifo), pytest.raises(nvmeio.AioError) as e:
        atomic_file.write_atomically(fifo, b"global_step2")
    assert e.value.errno == errno.ESPIPE
    assert e.value.strerror == ("open for writing refused: a FIFO (named pipe) has no file offsets, "
                                "and nvmeio reads and writes at offsets (regular files, block and "
                                "character devices)")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["latest"]
