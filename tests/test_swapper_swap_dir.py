"""SwapDirectory: <nvme_path>/<job>/rank<r>/<name>/, 0600 files, dead jobs reported, cleanup."""
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from swapper import InsufficientSwapSpaceError, StaleSwapDirectoryError, SwapDirectoryInUseError
from swapper._swap_dir import SwapDirectory, disk_free_bytes
from helpers import wait_for_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


# Loads swapper._swap_dir without the package __init__ (and so without torch, slow to import).
_PREAMBLE = f"""
import sys, types
package = types.ModuleType("swapper")
package.__path__ = [{os.path.join(REPO, "swapper")!r}]
sys.modules["swapper"] = package
"""


def _python(code, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-c", _PREAMBLE + textwrap.dedent(code)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kwargs,
    )


def test_layout_and_modes_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        d = SwapDirectory(tmp_path, "job-7", 3, "params")
        path = d.create("param_w.swp")
    finally:
        os.umask(old)
    assert d.path == str(tmp_path / "job-7" / "rank3" / "params")
    assert path == os.path.join(d.path, "param_w.swp")
    assert _mode(path) == 0o600 and os.path.getsize(path) == 0
    assert _mode(d.path) == 0o700 and _mode(d.rank_dir) == 0o700
    d.cleanup()


def test_swappers_of_one_rank_share_the_rank_directory_under_their_own_names(tmp_path):
    a = SwapDirectory(tmp_path, "job", 0, "params")
    b = SwapDirectory(tmp_path, "job", 0, "optimizer")
    assert a.rank_dir == b.rank_dir
    with pytest.raises(SwapDirectoryInUseError, match="already used by another swapper in this process"):
        SwapDirectory(tmp_path, "job", 0, "params")
    a.create("x.swp")
    a.cleanup()
    assert not os.path.exists(a.path) and os.path.isdir(b.path)
    b.cleanup()
    assert os.listdir(tmp_path) == []


def test_cleanup_keeps_the_job_directory_while_another_rank_uses_it(tmp_path):
    r0 = SwapDirectory(tmp_path, "job", 0, "params")
    r1 = SwapDirectory(tmp_path, "job", 1, "params")
    r0.create("a.swp")
    r0.cleanup()
    assert os.listdir(tmp_path / "job") == ["rank1"]
    r1.cleanup()
    assert os.listdir(tmp_path) == []


def test_directory_of_a_dead_job_is_reported_and_left_alone(tmp_path):
    child = _python(f"""
        import os
        from swapper._swap_dir import SwapDirectory
        d = SwapDirectory({str(tmp_path)!r}, "job", 0, "params")
        d.create("param_1.swp")
        print(os.getpid(), flush=True)
        os._exit(0)  # dies without cleaning up, like a killed job
    """)
    pid = int(wait_for_line(child))
    child.wait()
    with pytest.raises(StaleSwapDirectoryError) as info:
        SwapDirectory(tmp_path, "job", 0, "params")
    message = str(info.value)
    assert f"process {pid} on host {socket.gethostname()}, which is no longer running" in message
    assert "holds 1 files" in message and "remove_stale=True" in message
    assert os.path.exists(tmp_path / "job" / "rank0" / "params" / "param_1.swp")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_remove_stale_deletes_a_dead_jobs_directory_with_a_warning(tmp_path):
    (tmp_path / "job" / "rank0" / "params").mkdir(parents=True)
    (tmp_path / "job" / "rank0" / f".owner@{socket.gethostname()}@{_dead_pid()}").mkdir()
    (tmp_path / "job" / "rank0" / "params" / "old.swp").write_bytes(b"x" * 10)
    with pytest.raises(StaleSwapDirectoryError, match="which is no longer running"):
        SwapDirectory(tmp_path, "job", 0, "params")
    with pytest.warns(UserWarning, match="removing stale swap directory"):
        d = SwapDirectory(tmp_path, "job", 0, "params", remove_stale=True)
    assert os.listdir(d.path) == []
    d.cleanup()


@pytest.mark.parametrize("owner", ["another host", "no marker"])
def test_a_directory_whose_owner_cannot_be_proven_dead_is_never_deleted(tmp_path, owner):
    rank = tmp_path / "job" / "rank0"
    (rank / "params").mkdir(parents=True)
    (rank / "params" / "live.swp").write_bytes(b"x" * 10)
    if owner == "another host":
        (rank / f".owner@other-node-7@{os.getpid()}").mkdir()
        who = f"process {os.getpid()} on host other-node-7, which cannot be checked from {socket.gethostname()}"
    else:
        who = "an unknown owner (no owner marker)"
    for remove_stale in (False, True):
        with pytest.raises(SwapDirectoryInUseError) as info:
            SwapDirectory(tmp_path, "job", 0, "params", remove_stale=remove_stale)
        message = str(info.value)
        assert who in message and "may still be running" in message and "never deleted" in message
        assert f"rm -r {rank}" in message and "give each its own job_id (now 'job')" in message
    assert (rank / "params" / "live.swp").read_bytes() == b"x" * 10


def test_directory_of_a_running_job_is_in_use(tmp_path):
    child = _python(f"""
        import sys
        from swapper._swap_dir import SwapDirectory
        d = SwapDirectory({str(tmp_path)!r}, "job", 0, "params")
        print("ready", flush=True)
        sys.stdin.readline()
        d.cleanup()
    """)
    try:
        assert wait_for_line(child).strip() == "ready"
        with pytest.raises(SwapDirectoryInUseError, match=f"in use by process {child.pid}"):
            SwapDirectory(tmp_path, "job", 0, "params", remove_stale=True)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
    assert os.listdir(tmp_path) == []


def test_free_space_check_names_both_numbers(tmp_path):
    d = SwapDirectory(tmp_path, "job", 0, "params", free_space_fn=lambda path: 1000)
    d.check_free_space(1000, "3 tensors")
    with pytest.raises(InsufficientSwapSpaceError) as info:
        d.check_free_space(1001, "3 tensors")
    assert "3 tensors need 1001 more bytes" in str(info.value) and "only 1000 bytes" in str(info.value)
    d.cleanup()


def test_default_free_space_is_statvfs(tmp_path):
    st = os.statvfs(tmp_path)
    assert abs(disk_free_bytes(str(tmp_path)) - st.f_bavail * st.f_frsize) < 64 << 20


@pytest.mark.parametrize("job_id, rank, name", [("a/b", 0, "p"), ("..", 0, "p"), ("", 0, "p"), ("j", -1, "p"), ("j", 0, "x/y")])
def test_names_that_would_escape_the_directory_are_refused(tmp_path, job_id, rank, name):
    with pytest.raises(ValueError):
        SwapDirectory(tmp_path, job_id, rank, name)


def test_missing_nvme_path_is_an_error_not_created(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an existing directory"):
        SwapDirectory(tmp_path / "typo", "job", 0, "params")
    assert not (tmp_path / "typo").exists()


def test_swap_file_names_cannot_leave_the_directory(tmp_path):
    d = SwapDirectory(tmp_path, "job", 0, "params")
    with pytest.raises(ValueError):
        d.create("../escape.swp")
    d.cleanup()


def test_a_symlink_planted_at_the_job_directory_or_a_swap_file_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "job")
    with pytest.raises(FileExistsError, match="is not a directory \\(a symbolic link\\?\\)"):
        SwapDirectory(tmp_path, "job", 0, "params")
    assert os.listdir(elsewhere) == []
    d = SwapDirectory(tmp_path, "job2", 0, "params")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    os.symlink(victim, os.path.join(d.path, "param_1.swp"))
    with pytest.raises(FileExistsError, match="is a symbolic link; refusing to write through it"):
        d.create("param_1.swp")
    assert victim.read_text() == "precious" and stat.S_IMODE(os.stat(victim).st_mode) == 0o644
    d.cleanup()
