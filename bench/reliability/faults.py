"""Every injected fault of nvmeio.faults on every backend: the error surfaces from the op that hit
it, wait() never hangs, nothing leaks, the handle stays usable, no byte of a surviving file is lost."""
from __future__ import annotations

import errno
import os
from typing import Callable

import numpy as np

import nvmeio
from nvmeio import faults, resources

from .cases import (BLOCK, HANG_LIMIT_S, Context, Expectation, Row, Section, expect, file_bytes, lost,
                    random_bytes, run_guarded, settled_snapshot)


def _handle(backend: str, **kw) -> nvmeio.aio_handle:
    kw.setdefault("queue_depth", 4)
    kw.setdefault("intra_op_parallelism", 1)
    return nvmeio.aio_handle(block_size=BLOCK, backend=backend, **kw)


def _usable(h, d: str) -> None:
    src = random_bytes(300_001, 77)
    h.sync_pwrite(src, os.path.join(d, "after.bin"))
    dst = np.zeros_like(src)
    h.sync_pread(dst, os.path.join(d, "after.bin"))
    expect(np.array_equal(dst, src), "the handle is not usable after the fault")


def _raises(fn, check: Callable[[BaseException], bool], what: str) -> None:
    try:
        fn()
    except nvmeio.AioError as e:
        expect(check(e), f"{what}: wrong error {e}")
        return
    raise Expectation(f"{what}: no error raised")


def sc_fail_nth_write(backend, d, row):
    h = _handle(backend)
    a, b = random_bytes(1 << 20, 1), random_bytes(1 << 20, 2)
    with faults.inject(fail_nth=2, errno="ENOSPC", path_contains="b.bin"):
        h.async_pwrite(a, os.path.join(d, "a.bin"))
        h.async_pwrite(b, os.path.join(d, "b.bin"))
        _raises(h.wait, lambda e: e.errno == errno.ENOSPC and e.filename.endswith("b.bin")
                and e.offset == BLOCK, "the failed write")
    row.bytes_lost += lost(file_bytes(os.path.join(d, "a.bin")), a.tobytes())
    expect(not os.path.exists(os.path.join(d, "b.bin")), "the failed new file was left behind")
    _usable(h, d)
    h.close()


def sc_fail_nth_read(backend, d, row):
    h = _handle(backend)
    src = random_bytes(1 << 20, 3)
    path = os.path.join(d, "r.bin")
    h.sync_pwrite(src, path)
    with faults.inject(fail_nth=3, errno="EIO", op="read"):
        _raises(lambda: h.sync_pread(np.zeros_like(src), path),
                lambda e: e.errno == errno.EIO and e.filename == path, "the failed read")
    row.bytes_lost += lost(file_bytes(path), src.tobytes())     # a failed read changes no byte
    _usable(h, d)
    h.close()


def sc_fail_byte_exact(backend, d, row):
    h = _handle(backend)
    path = os.path.join(d, "f.bin")
    old = random_bytes(400_000, 4).tobytes()
    with open(path, "wb") as f:
        f.write(old)
    with faults.inject(fail_nth=1, errno="EIO", op="write"):
        _raises(lambda: h.sync_pwrite(np.zeros(200_000, np.uint8), path, file_offset=1000),
                lambda e: e.offset == 1000 and e.length == 4096 - 1000, "the failed head")
    row.bytes_lost += lost(file_bytes(path)[:1000], old[:1000])  # outside the op: untouched
    _usable(h, d)
    h.close()


def _short(backend, d, row, op, unaligned):
    h = _handle(backend)
    n = 8 * BLOCK + 777
    data = random_bytes(n, 5)
    src = data
    if unaligned:
        base = np.empty(n + 4097, np.uint8)
        start = (-base.__array_interface__["data"][0]) % 4096 + 1
        src = base[start:start + n]
        src[:] = data
    path = os.path.join(d, "s.bin")
    with faults.inject(short_nth=3, short_bytes=4196, op=op) as fired:
        if op == "write":
            h.sync_pwrite(src, path)
            row.bytes_lost += lost(file_bytes(path), data.tobytes())
        else:
            with open(path, "wb") as f:
                f.write(data.tobytes())
            dst = np.zeros_like(data)
            h.sync_pread(dst, path)
            row.bytes_lost += lost(dst.tobytes(), data.tobytes())
    expect(fired()["shortened"] == 1, "the short transfer was not injected")
    h.close()


def sc_delay(backend, d, row):
    h = _handle(backend)
    src = random_bytes(6 * BLOCK, 6)
    with faults.inject(delay_us=2000):
        for i in range(3):
            h.async_pwrite(src, os.path.join(d, f"d{i}.bin"))
        expect(h.wait() == 3, "not every delayed op completed")
    for i in range(3):
        row.bytes_lost += lost(file_bytes(os.path.join(d, f"d{i}.bin")), src.tobytes())
    h.close()


def sc_eagain(backend, d, row):
    h = _handle(backend)
    src = random_bytes(8 * BLOCK, 7)
    with faults.inject(submit_refusals=5) as fired:
        h.sync_pwrite(src, os.path.join(d, "e.bin"))
    expect(fired()["submit_refusals"] == 5, "the refusals were not injected")
    row.bytes_lost += lost(file_bytes(os.path.join(d, "e.bin")), src.tobytes())
    h.close()


def sc_eagain_forever(backend, d, row):
    h = _handle(backend)
    with faults.inject(submit_refusals=-1):
        h.async_pwrite(random_bytes(4 * BLOCK), os.path.join(d, "never.bin"))
        _raises(h.wait, lambda e: "Resource temporarily unavailable" in str(e), "EAGAIN forever")
    expect(not os.path.exists(os.path.join(d, "never.bin")), "the failed new file was left")
    _usable(h, d)
    h.close()


def sc_submit_error(backend, d, row):
    h = _handle(backend)
    with faults.inject(submit_refusals=1, submit_errno="EBADF"):
        h.async_pwrite(random_bytes(4 * BLOCK), os.path.join(d, "bad.bin"))
        _raises(h.wait, lambda e: "Bad file descriptor" in str(e), "the submission error")
    _usable(h, d)
    h.close()


def sc_engine_failure(backend, d, row):
    h = _handle(backend, queue_depth=8)
    bufs = [random_bytes(16 * BLOCK, i) for i in range(4)]
    with faults.inject(engine_failure_nth=1):
        for i, b in enumerate(bufs):
            h.async_pwrite(b, os.path.join(d, f"w{i}.bin"))
        _raises(h.wait, lambda e: "I/O engine failure" in str(e), "the engine failure")
    expect(not os.path.exists(os.path.join(d, "w0.bin")), "the failed new file was left")
    for i, b in enumerate(bufs):
        h.async_pwrite(b, os.path.join(d, f"w{i}.bin"))
    h.wait()
    for i, b in enumerate(bufs):
        row.bytes_lost += lost(file_bytes(os.path.join(d, f"w{i}.bin")), b.tobytes())
    h.close()


def sc_engine_cannot_restart(backend, d, row):
    h = _handle(backend)
    src = random_bytes(4 * BLOCK)
    with faults.inject(engine_failure_nth=1, engine_create_failures=1):
        _raises(lambda: h.sync_pwrite(src, os.path.join(d, "a.bin")),
                lambda e: "I/O engine failure" in str(e), "the engine failure")
        _raises(lambda: h.sync_pwrite(src, os.path.join(d, "b.bin")),
                lambda e: "a new engine could not be made" in str(e), "the worker without engine")
    h.close()
    h2 = _handle(backend)
    _usable(h2, d)
    h2.close()


def sc_every_request_fails(backend, d, row):
    h = _handle(backend, queue_depth=8, intra_op_parallelism=2)
    src = random_bytes(3 * BLOCK + 5)
    with faults.inject(fail_nth=1, fail_count=0) as fired:
        for r in range(20):
            for i in range(10):
                h.async_pwrite(src, os.path.join(d, f"x{i}.bin"), file_offset=r)
            _raises(h.wait, lambda e: e.errno == errno.EIO, "200 failing ops")
    expect(fired()["failed"] >= 200 and os.listdir(d) == [], "failed ops left files")
    _usable(h, d)
    h.close()


def sc_whole_file_write_fails(backend, d, row):
    h = _handle(backend)
    path = os.path.join(d, "model.bin")
    old = random_bytes(100_000, 9).tobytes()
    with open(path, "wb") as f:
        f.write(old)
    with faults.inject(fail_nth=2, op="write"):
        _raises(lambda: h.write(random_bytes(1 << 20), path), lambda e: e.filename == path,
                "the failed write()")
    row.bytes_lost += lost(file_bytes(path), old)
    expect(os.listdir(d) == ["model.bin"], "write() left a temporary file")
    h.close()


FAULT_SCENARIOS = {
    "fail the 2nd write request of one op (ENOSPC)": sc_fail_nth_write,
    "fail the 3rd read request (EIO)": sc_fail_nth_read,
    "fail a byte-exact head request (EIO)": sc_fail_byte_exact,
    "short write transfer (user memory)": lambda b, d, r: _short(b, d, r, "write", False),
    "short write transfer (bounce buffer)": lambda b, d, r: _short(b, d, r, "write", True),
    "short read transfer (user memory)": lambda b, d, r: _short(b, d, r, "read", False),
    "short read transfer (bounce buffer)": lambda b, d, r: _short(b, d, r, "read", True),
    "completions delayed 2 ms": sc_delay,
    "submission refused with EAGAIN x5": sc_eagain,
    "submission refused with EAGAIN forever": sc_eagain_forever,
    "submission fails with EBADF": sc_submit_error,
    "engine breaks with requests in flight": sc_engine_failure,
    "engine breaks and cannot restart": sc_engine_cannot_restart,
    "every request fails (200 ops)": sc_every_request_fails,
    "whole-file write() fails midway": sc_whole_file_write_fails,
}


def section_faults(ctx: Context) -> Section:
    s = Section("faults", "Injected faults (nvmeio.faults), every backend",
                "Each scenario runs once per backend (" + ", ".join(ctx.backends) + "). A case "
                "fails if the error is not raised by the op that hit it, wait() hangs "
                f"(> {HANG_LIMIT_S} s), the handle is unusable afterwards, a byte of a file or "
                "buffer that should have survived differs, or fds / threads / VmLck / AIO "
                "contexts grew.")
    for name, fn in FAULT_SCENARIOS.items():
        row = Row(name)
        bad = []
        for backend in ctx.backends:
            d = ctx.fresh_dir("faults")
            before = settled_snapshot()
            error = run_guarded(lambda: fn(backend, d, row))
            faults.disarm()
            grown = resources.grown_since(before)
            row.cases += 1
            if error or grown:
                row.failed += 1
                bad.append(f"{backend}: {error or ''}{' leaked ' + str(grown) if grown else ''}")
            for k, v in grown.items():
                row.leaks[k] = row.leaks.get(k, 0) + v
        row.detail = "; ".join(bad) or "error from the op that hit it, handle usable"
        s.rows.append(row)
    return s
