"""Hostile-but-realistic input to the I/O layer: NUL paths, planted symlinks, read-only targets,
killed writers, lazy (conjugate / negative) views, out-of-range integers."""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import torch

import nvmeio
from nvmeio import atomic_file, resources

from .cases import (Context, Expectation, Row, Section, expect, file_bytes, random_bytes, run_guarded,
                    settled_snapshot)


def sec_nul(ctx, d):
    calls = {
        "async_pread": lambda h, b, p: h.async_pread(b, p),
        "async_pwrite": lambda h, b, p: h.async_pwrite(b, p),
        "sync_pread": lambda h, b, p: h.sync_pread(b, p),
        "sync_pwrite": lambda h, b, p: h.sync_pwrite(b, p),
        "pread": lambda h, b, p: h.pread(b, p),
        "pwrite": lambda h, b, p: h.pwrite(b, p),
        "read": lambda h, b, p: h.read(b, p),
        "write": lambda h, b, p: h.write(b, p),
    }
    h = nvmeio.aio_handle()
    n = 0
    for name, call in calls.items():
        for path in (f"{d}/victim\0.ignored", os.fsencode(f"{d}/victim\0.ignored")):
            try:
                call(h, np.zeros(100, np.uint8), path)
                raise Expectation(f"{name}: a NUL path was accepted")
            except ValueError as e:
                expect("NUL byte" in str(e), f"{name}: unclear message {e}")
            expect(os.listdir(d) == [], f"{name}: a file was created")
            n += 1
    with contextlib.suppress(ValueError):
        atomic_file.write_atomically(f"{d}/victim\0.x", b"x")
        raise Expectation("atomic_file accepted a NUL path")
    expect(os.listdir(d) == [], "atomic_file created a file")
    h.close()
    return n + 1


def _predictable_names():
    names = itertools.chain(["guessed"], (f"fresh{i}" for i in itertools.count()))
    return lambda n: next(names)


@contextlib.contextmanager
def named_temporaries_with_a_guessable_name():
    """The attacker's best case: no O_TMPFILE, and the first random name known."""
    saved_flag = getattr(os, "O_TMPFILE", None)
    saved_token = atomic_file.secrets.token_hex
    if saved_flag is not None:
        del os.O_TMPFILE
    atomic_file.secrets.token_hex = _predictable_names()
    try:
        yield
    finally:
        if saved_flag is not None:
            os.O_TMPFILE = saved_flag
        atomic_file.secrets.token_hex = saved_token


def sec_planted_temp_symlink(ctx, d):
    victim = os.path.join(d, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.symlink(victim, os.path.join(d, ".model.bin.guessed.tmp"))
    h = nvmeio.aio_handle()
    with named_temporaries_with_a_guessable_name():
        h.write(random_bytes(100_000), os.path.join(d, "model.bin"))
    expect(file_bytes(victim) == b"precious", "write() followed the planted symlink")
    os.unlink(os.path.join(d, "model.bin"))
    with named_temporaries_with_a_guessable_name():
        os.replace(os.path.join(d, ".model.bin.guessed.tmp"), os.path.join(d, ".latest.guessed.tmp"))
        atomic_file.write_atomically(os.path.join(d, "latest"), b"step")
    expect(file_bytes(victim) == b"precious", "write_atomically followed the planted symlink")
    h.close()
    return 2


def sec_target_symlink(ctx, d):
    victim = os.path.join(d, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.symlink(victim, os.path.join(d, "model.bin"))
    h = nvmeio.aio_handle()
    h.write(random_bytes(1000), os.path.join(d, "model.bin"))
    expect(file_bytes(victim) == b"precious", "write() wrote through the target symlink")
    expect(not os.path.islink(os.path.join(d, "model.bin")), "the link was not replaced")
    h.close()
    return 1


def sec_read_only(ctx, d):
    shared = tempfile.mkdtemp(prefix="nvmeio-shared-")
    try:
        os.chmod(shared, 0o777)
        path = os.path.join(shared, "ro.bin")
        with open(path, "wb") as f:
            f.write(b"keep me")
        os.chmod(path, 0o444)
        h = nvmeio.aio_handle(backend="psync")
        root = os.geteuid() == 0
        if root:
            os.seteuid(65534)
        try:
            try:
                h.write(random_bytes(1000), path)
                raise Expectation("a read-only file was replaced")
            except PermissionError as e:
                expect(e.filename == path, "the error does not name the file")
        finally:
            if root:
                os.seteuid(0)
        expect(file_bytes(path) == b"keep me", "the read-only file changed")
        h.close()
    finally:
        shutil.rmtree(shared)
    return 1


def sec_directory(ctx, d):
    os.mkdir(os.path.join(d, "dir"))
    h = nvmeio.aio_handle()
    for call in (lambda: h.write(random_bytes(10), os.path.join(d, "dir")),
                 lambda: h.sync_pwrite(random_bytes(10), os.path.join(d, "dir"))):
        try:
            call()
            raise Expectation("a directory was written")
        except IsADirectoryError:
            pass
    expect(os.listdir(os.path.join(d, "dir")) == [], "something was created in the directory")
    h.close()
    return 2


def sec_sigterm(ctx, d):
    code = ("import os, signal, threading, numpy, nvmeio\n"
            "from nvmeio import faults\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the launcher set\n"
            "h = nvmeio.aio_handle(block_size=1 << 20, backend='psync')\n"
            "faults.arm(delay_us=20000)\n"
            "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
            f"h.write(numpy.ones(200 << 20, numpy.uint8), {os.path.join(d, 'big.bin')!r})\n")
    env = dict(os.environ, PYTHONSAFEPATH="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env, cwd=d)
    expect(r.returncode == -signal.SIGTERM, f"the writer was not killed: {r.stderr[-300:]}")
    expect(os.listdir(d) == [], f"SIGTERM left {os.listdir(d)}")
    return 1


def sec_lazy_views(ctx, d):
    h = nvmeio.aio_handle()
    x = torch.randn(1000, dtype=torch.complex64)
    h.write(x.conj(), os.path.join(d, "c.bin"))
    expect(file_bytes(os.path.join(d, "c.bin")) == torch.conj_physical(x).numpy().tobytes(),
           "a conjugate view was written as raw memory")
    y = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128)
    h.sync_pwrite(y.conj().imag, os.path.join(d, "n.bin"))
    expect(np.frombuffer(file_bytes(os.path.join(d, "n.bin")), np.float64).tolist() == [-2.0, 4.0],
           "a negative view was written as raw memory")
    try:
        h.sync_pread(torch.zeros(1000, dtype=torch.complex64).conj(), os.path.join(d, "c.bin"))
        raise Expectation("a read into a conjugate view was accepted")
    except ValueError as e:
        expect("conjugate view" in str(e), f"unclear message {e}")
    h.close()
    return 3


def sec_integers(ctx, d):
    cases = [
        (lambda: nvmeio.aio_handle(block_size=8 << 30), "block_size must be at most"),
        (lambda: nvmeio.aio_handle(queue_depth=1 << 40), "queue_depth must be at most"),
        (lambda: nvmeio.aio_handle(intra_op_parallelism=1 << 33), "intra_op_parallelism must be at most"),
        (lambda: nvmeio.aio_handle().sync_pwrite(np.zeros(10, np.uint8), os.path.join(d, "x"),
                                                 file_offset=1 << 63), "file_offset"),
        (lambda: nvmeio.aio_handle().sync_pwrite(np.zeros(10, np.uint8), 1 << 40), "out of range"),
        (lambda: nvmeio.aio_handle().new_cpu_locked_tensor(1 << 62, torch.empty(0)), "num_elem"),
    ]
    for fn, message in cases:
        try:
            fn()
            raise Expectation(f"accepted: expected ValueError '{message}'")
        except ValueError as e:
            expect(message in str(e), f"unclear message {e}")
    expect(os.listdir(d) == [], "a file was created")
    return len(cases)


SECURITY_CASES = {
    "NUL byte in every path argument (str and bytes)": sec_nul,
    "symlink planted at the temporary name (write, write_atomically)": sec_planted_temp_symlink,
    "target is a symlink: replaced, never written through": sec_target_symlink,
    "read-only target (as an unprivileged user)": sec_read_only,
    "directory as the target": sec_directory,
    "SIGTERM in the middle of write(): nothing left behind": sec_sigterm,
    "conjugate / negative views": sec_lazy_views,
    "integers out of range (settings, offset, fd, num_elem)": sec_integers,
}


def section_security(ctx: Context) -> Section:
    s = Section("security", "Security cases (nvmeio)",
                "Hostile-but-realistic input to the I/O layer. A case fails if anything is "
                "written outside the path the user gave, a refusal is not a clear error naming "
                "the argument, or a file is left behind.")
    for name, fn in SECURITY_CASES.items():
        d = ctx.fresh_dir("security")
        box = {}
        before = settled_snapshot()
        error = run_guarded(lambda: box.setdefault("n", fn(ctx, d)))
        grown = resources.grown_since(before)
        s.rows.append(Row(name, cases=box.get("n", 1), failed=1 if error else 0, leaks=grown,
                          detail=error or "refused or contained, as expected"))
    return s
