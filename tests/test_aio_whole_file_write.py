"""aio_handle.write(): the whole file is replaced atomically through a
temporary file nobody can plant anything at; what open(path, "w") refuses it
refuses; a failure, a refusal or SIGTERM leaves no file behind. A device node
is written in place (a rename would put a regular file where it was); a FIFO
or socket is refused."""

import contextlib
import errno
import itertools
import os
import pathlib
import shutil
import signal
import stat
import sys
import tempfile

import numpy as np
import pytest

import nvmeio
from helpers import (FULL_DEVICE, NULL_DEVICE, char_device_node, fifo_unblocked_after, file_bytes,
                     is_root, loop_device_node, random_bytes, run_process, special_file)
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
    r = run_process([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert "finished" not in r.stdout
    assert os.listdir(nvme_dir) == []


@pytest.mark.filterwarnings("ignore:nvmeio. no O_DIRECT")
def test_a_character_device_is_written_through_in_place_not_replaced(h, nvme_dir):
    null = char_device_node(nvme_dir / "null", NULL_DEVICE)
    full = char_device_node(nvme_dir / "full", FULL_DEVICE)
    assert h.write(random_bytes(100_000), null) == 0
    with pytest.raises(nvmeio.AioError) as e:           # the bytes went to the device itself
        h.write(random_bytes(100_000), full)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(full)
    assert [(stat.S_IFMT(os.stat(p).st_mode), os.stat(p).st_rdev) for p in (null, full)] == [
        (stat.S_IFCHR, NULL_DEVICE), (stat.S_IFCHR, FULL_DEVICE)]
    assert sorted(os.listdir(nvme_dir)) == ["full", "null"]


def test_a_block_device_is_written_in_place_and_not_truncated(h, nvme_dir):
    old = random_bytes(1 << 20, seed=1).tobytes()
    src = random_bytes(300_001, seed=2)
    with loop_device_node(nvme_dir, old) as (node, backing):
        assert h.write(src, node) == 0
        assert stat.S_ISBLK(os.stat(node).st_mode)
        back = np.empty(len(old), np.uint8)
        h.sync_pread(back, node)
    assert back.tobytes() == src.tobytes() + old[src.size:]
    assert file_bytes(backing) == src.tobytes() + old[src.size:]


def test_read_checks_the_buffer_against_a_block_devices_size(h, nvme_dir):
    data = random_bytes(1 << 20, seed=3)
    with loop_device_node(nvme_dir, data.tobytes()) as (node, _):
        back = np.empty_like(data)
        assert h.read(back, node) == 0
        with pytest.raises(ValueError) as e:
            h.read(np.empty(1000, np.uint8), node)
    assert np.array_equal(back, data)
    assert str(e.value) == (f"read: {str(node)!r} holds {1 << 20} bytes but the buffer has 1000; "
                            "use pread with file_offset to read part of a file")


@pytest.mark.parametrize("kind,what", [("fifo", "a FIFO (named pipe)"), ("socket", "a socket")])
def test_a_fifo_or_socket_is_refused_and_left_as_it_was(h, nvme_dir, kind, what):
    path = special_file(nvme_dir / kind, kind)
    mode = os.stat(path).st_mode
    with fifo_unblocked_after(path) if kind == "fifo" else contextlib.nullcontext():
        with pytest.raises(nvmeio.AioError) as e:
            h.write(random_bytes(1000), path)
    assert e.value.errno == errno.ESPIPE
    assert str(e.value) == (f"[Errno {errno.ESPIPE}] open for writing refused: {what} has no file "
                            "offsets, and nvmeio reads and writes at offsets (regular files, block "
                            f"and character devices): {str(path)!r} (offset 0, length 1000)")
    assert os.stat(path).st_mode == mode and os.listdir(nvme_dir) == [kind]


def test_a_symlink_to_a_device_is_refused_not_followed_nor_replaced(h, nvme_dir):
    node = char_device_node(nvme_dir / "null")
    (nvme_dir / "link").symlink_to(node)
    with pytest.raises(nvmeio.AioError) as e:
        h.write(random_bytes(1000), nvme_dir / "link")
    assert e.value.errno == errno.ELOOP
    assert e.value.strerror == (f"open for writing refused: it is a symbolic link to a character "
                                f"device ({str(node)!r}); a write neither goes through a symlink "
                                f"nor replaces one to a device, FIFO or socket: name {str(node)!r} "
                                "itself")
    assert (nvme_dir / "link").is_symlink() and sorted(os.listdir(nvme_dir)) == ["link", "null"]
