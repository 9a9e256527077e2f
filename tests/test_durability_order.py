"""Durability by order, checked on the system calls (strace): every byte of a checkpoint
(hard-linked swap files included) is fsync'ed before `latest` names it, every name is
made durable by an fsync of its directory before that, and the same holds for
aio_handle.write() and FastFileWriter. Order bugs, not torn pages, are what lose data
in a crash (the crash-consistency studies of applications, such as ALICE)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import PROCESS_TIMEOUT_S

STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(STRACE is None, reason="needs strace (the README's test command installs it)")

_CALL = re.compile(r"^\d+ +(\w+)\((.*)\) += (-?\d+)(?:<([^>]*)>)?")
_FD = re.compile(r"^(-?\d+)<([^>]*)>")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')


def trace(tmp_path, code: str, *args: str) -> list:
    """Run ``code`` in a child under strace; its file system calls, in order, as
    (call, [string arguments], first fd's path, result fd's path, result, raw arguments)."""
    script, out = tmp_path / "child.py", tmp_path / "trace.txt"
    script.write_text(code)  # it finds helpers on the PYTHONPATH tests/conftest.py sets
    run = subprocess.run([STRACE, "-f", "-y", "-qq", "-s", "4096", "-o", str(out), "-e",
                          "trace=fsync,fdatasync,rename,renameat,renameat2,link,linkat,openat",
                          sys.executable, str(script), *args],
                         capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    calls = []
    for line in out.read_text().splitlines():
        m = _CALL.match(line)
        if m is None or m.group(3).startswith("-"):
            continue
        name, body, _, result = m.groups()
        fd = _FD.match(body)
        calls.append((name, _STR.findall(body), fd.group(2) if fd else None, result, int(m.group(3)), body))
    return calls


def calls_flags(call) -> str:
    return call[5]


class Durability:
    """Replays the calls: which file contents were synced, which names exist and which of
    them an fsync of their directory made durable, and when."""

    def __init__(self, calls: list):
        self.synced = set()        # paths (or an unnamed file's "#inode" path) whose data was synced
        self.content = {}          # name -> index at which its data was known synced when it appeared
        self.made = {}             # name -> index at which it appeared (link / rename / create)
        self.dir_synced = {}       # directory -> indexes of its fsyncs
        self.fds = {}              # fd number -> path (one process: threads share the table)
        self.events = []
        for i, (name, strings, fd_path, result, ret, _) in enumerate(calls):
            self.events.append((name, strings))
            if name == "openat":
                self.fds[ret] = result.replace("(deleted)", "")
                if "O_CREAT" in calls_flags(calls[i]):  # a name made in place: its data synced later
                    self.made.setdefault(strings[0], i)
            elif name in ("fsync", "fdatasync"):
                path = fd_path.replace("(deleted)", "")
                self.synced.add(path)
                self.dir_synced.setdefault(path, []).append(i)
                if path in self.made:
                    self.content.setdefault(path, i)
            elif name in ("link", "linkat"):
                if name == "link":
                    src, dst = strings
                elif strings[0].isdigit():  # linkat(/proc/<pid>/fd, "<n>", ..., dst): an unnamed file
                    src, dst = self.fds.get(int(strings[0]), ""), strings[1]
                else:
                    src, dst = strings
                self._appear(dst, i, src in self.synced)
            elif name.startswith("rename"):
                src, dst = strings[0], strings[-1]
                self._rename(src, dst, i)

    def _appear(self, path: str, i: int, synced: bool) -> None:
        self.made[path] = i
        if synced:
            self.content[path] = i

    def _rename(self, src: str, dst: str, i: int) -> None:
        for path in list(self.made):
            if path == src or path.startswith(src + "/"):
                new = dst + path[len(src):]
                self.made[new] = i if path == src else self.made[path]
                if path in self.content:
                    self.content[new] = self.content[path]
        for path in list(self.dir_synced):
            if path == src or path.startswith(src + "/"):
                self.dir_synced.setdefault(dst + path[len(src):], []).extend(self.dir_synced[path])
        self.made[dst] = i

    def index_of(self, call: str, dst: str) -> int:
        return max(i for i, (name, strings) in enumerate(self.events) if name == call and strings[-1] == dst)

    def assert_durable_before(self, path: str, limit: int, named_when_synced: bool = False) -> None:
        """``path``'s data was synced before ``limit`` (``named_when_synced``: before its name
        appeared, as an atomic replacement must), and its directory was synced after the name
        appeared and before ``limit``."""
        assert path in self.content and self.content[path] < limit, f"{path}: its data was not fsync'ed in time"
        made = self.made[path]
        if named_when_synced:
            assert self.content[path] <= made, f"{path}: its name appeared before its data was fsync'ed"
        parent = os.path.dirname(path)
        assert any(made < j < limit for j in self.dir_synced.get(parent, [])), \
            f"{path}: its directory was not fsync'ed between the name's creation and the publish"


SAVE = """
import os, sys, torch, zero
from zero.examples import GPT, GPTConfig, make_batches
from helpers import base_config
d = sys.argv[1]
os.makedirs(d + "/swap")
engine, *_ = zero.initialize(model=GPT(GPTConfig()), config=base_config("nvme", "nvme", d + "/swap"))
x, y = make_batches(GPTConfig(), 1, 4)[0]
engine.backward(engine(x, y)); engine.step()
engine.save_checkpoint(d + "/ckpt", tag="t1")
engine.destroy()
"""


def test_a_checkpoint_is_durable_before_latest_names_it(tmp_path):
    calls = trace(tmp_path, SAVE, str(tmp_path))
    replay = Durability(calls)
    ckpt = str(tmp_path / "ckpt")
    latest = replay.index_of("linkat", f"{ckpt}/latest") if any(
        n == "linkat" and s and s[-1] == f"{ckpt}/latest" for n, s in replay.events) else replay.index_of(
        "rename", f"{ckpt}/latest")
    files = [os.path.join(d, f) for d, _, fs in os.walk(f"{ckpt}/t1") for f in fs]
    assert len(files) >= 4 and any("subgroup" in f for f in files)
    for f in files:
        replay.assert_durable_before(f, latest)
    published = replay.made[f"{ckpt}/t1"]
    assert published < latest
    assert any(published < j < latest for j in replay.dir_synced[ckpt]), "the tag's rename was not made durable"
    assert f"{ckpt}/latest" in replay.content and any(j > latest for j in replay.dir_synced[ckpt])
    # the swap files the shards are hard links of were synced before the links were made
    links = [s for n, s in replay.events if n == "link" and "subgroup" in s[-1]]
    assert links and all(src in replay.synced for src, _ in links)


WRITERS = """
import sys, numpy as np, torch, nvmeio
d = sys.argv[1]
t = torch.arange(1 << 18, dtype=torch.float32)
h = nvmeio.aio_handle()
h.write(t, d + "/written.bin")
h.write(t, d + "/written.bin")  # a replacement
with nvmeio.FastFileWriter(d + "/fast.bin") as f:
    f.write(np.arange(1 << 20, dtype=np.uint8).tobytes())
"""


def test_write_and_the_fast_writer_sync_data_before_the_name_and_the_directory_after(tmp_path):
    calls = trace(tmp_path, WRITERS, str(tmp_path))
    replay = Durability(calls)
    for name in ("written.bin", "fast.bin"):
        path = str(tmp_path / name)
        replay.assert_durable_before(path, len(calls), named_when_synced=True)
    assert (tmp_path / "written.bin").stat().st_size == 4 << 18
