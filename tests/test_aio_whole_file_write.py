"""aio_handle.write(): the whole file is replaced atomically through a
temporary file nobody can plant anything at; what open(path, "w") refuses it
refuses; a failure, a refusal or SIGTERM leaves no file behind."""

import itertools
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import nvmeio
from helpers import file_bytes, is_root, random_bytes
from nvmeio import atomic_file, faults


@pytest.fixture
def h():
    return nvmeio.aio_handle(block_size=1 << 16)


def test_write_replaces_the_file_and_leaves_nothing_else(h, nvme_dir):
    path = nvme_dir / "model.bin"
    path.write_bytes(b"old")
    src = random_bytes(300_001)
    assert h.write(src, path) == 0
    assert file_bytes(path) == src.tobytes()
    assert os.listdir(nvme_dir) == ["model.bin"]


def test_a_symlink_planted_at_the_temporary_name_cannot_redirect_the_write(h, nvme_dir,
                                                                             monkeypatch):
    # Worst case for the defender: no O_TMPFILE, and the attacker guessed the name.
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    names = itertools.chain(["guessed"], (f"fresh{i}" for i in itertools.count()))
    monkeypatch.setattr(atomic_file.secrets, "token_hex", lambda n: next(names))
    victim = nvme_dir / "victim"
    victim.write_bytes(b"precious")
    (nvme_dir / ".model.bin.guessed.tmp").symlink_to(victim)
    src = random_bytes(200_000)
    h.write(src, nvme_dir / "model.bin")
    assert victim.read_bytes() == b"precious"
    assert file_bytes(nvme_dir / "model.bin") == src.tobytes()


def test_the_temporary_file_has_no_name_while_it_is_written(h, nvme_dir):
    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("this Python has no os.O_TMPFILE")
    seen = []
    real_pwrite = h.pwrite

    def pwrite(*args, **kwargs):                  # looks at the directory mid-write
        seen.append(os.listdir(nvme_dir))
        return real_pwrite(*args, **kwargs)

    h.pwrite = pwrite
    h.write(random_bytes(100_000), nvme_dir / "model.bin")
    assert seen == [[]]
    assert os.listdir(nvme_dir) == ["model.bin"]


def test_a_failed_write_keeps_the_old_file_and_names_the_users_path(h, nvme_dir):
    path = nvme_dir / "model.bin"
    path.write_bytes(b"old")
    with faults.inject(fail_nth=2, errno="EIO", op="write"):
        with pytest.raises(nvmeio.AioError) as e:
            h.write(random_bytes(1 << 20), path)
    assert e.value.filename == str(path) and str(path) in str(e.value)
    assert "/proc/self/fd" not in str(e.value)
    assert file_bytes(path) == b"old" and os.listdir(nvme_dir) == ["model.bin"]


def test_a_nul_in_the_path_is_refused_and_leaves_no_file(h, nvme_dir):
    with pytest.raises(ValueError, match="filename contains a NUL byte, which would cut the path "
                                         "short"):
        h.write(random_bytes(1000), f"{nvme_dir}/victim\0.ignored")
    assert os.listdir(nvme_dir) == []


def test_a_directory_is_refused(h, nvme_dir):
    (nvme_dir / "d").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        h.write(random_bytes(1000), nvme_dir / "d")
    assert e.value.filename == str(nvme_dir / "d")
    assert os.listdir(nvme_dir / "d") == []


def test_a_missing_directory_is_named(h, nvme_dir):
    with pytest.raises(FileNotFoundError, match="directory '.*no_dir' does not exist") as e:
        h.write(random_bytes(1000), nvme_dir / "no_dir" / "x.bin")
    assert e.value.filename == str(nvme_dir / "no_dir" / "x.bin")


def as_user_nobody(fn):
    """Runs fn with the effective uid of 'nobody' when root (root may write anything)."""
    if not is_root():
        return fn()
    os.seteuid(65534)
    try:
        return fn()
    finally:
        os.seteuid(0)


@pytest.fixture
def shared_dir():
    """A directory anyone may write in (pytest's tmp_path is private to its owner)."""
    d = tempfile.mkdtemp(prefix="nvmeio-shared-")
    os.chmod(d, 0o777)
    yield pathlib.Path(d)
    shutil.rmtree(d)


def test_a_read_only_file_is_not_replaced(shared_dir):
    shared = shared_dir                           # writable directory: a rename would succeed
    path = shared / "ro.bin"
    path.write_bytes(b"keep me")
    os.chmod(path, 0o444)
    h = nvmeio.aio_handle(backend="psync")

    def attempt():
        with pytest.raises(PermissionError) as e:
            h.write(random_bytes(1000), path)
        return e.value

    err = as_user_nobody(attempt)
    assert err.filename == str(path)
    assert "read-only for this user; write() does not replace it" in str(err)
    assert file_bytes(path) == b"keep me" and os.listdir(shared) == ["ro.bin"]


def test_sigterm_during_write_leaves_no_temporary_file(nvme_dir):
    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("this Python has no os.O_TMPFILE: a named temporary file can be left")
    # The write is slowed by injected delays; SIGTERM (default action: the
    # process dies at once, no Python cleanup) arrives in the middle of it.
    code = ("import os, signal, threading, numpy, nvmeio\n"
            "from nvmeio import faults\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the launcher set\n"
            "h = nvmeio.aio_handle(block_size=1 << 20, backend='psync')\n"
            "faults.arm(delay_us=20000)\n"
            "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
            f"h.write(numpy.ones(200 << 20, numpy.uint8), {str(nvme_dir / 'big.bin')!r})\n"
            "print('finished')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert "finished" not in r.stdout
    assert os.listdir(nvme_dir) == []
