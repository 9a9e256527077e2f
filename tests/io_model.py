"""Random sequences of reads and writes run against a real file and an
in-memory model of it (a bytearray), byte for byte.

Used by tests/test_aio_model.py (a few hundred cases) and by
bench/reliability/fuzzing.py (many more, counted in bench/RELIABILITY.md).

A sequence mixes sync and async pwrite/pread at any offset and size, whole-file
write(), truncation from outside, and wait(). A write never overlaps a
pending read or write (a data race, undefined on any API); a read that
needs a pending write's bytes or the file's size waits first. A read past the
end must raise ShortReadError and touch nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
from hypothesis import strategies as st

import nvmeio

if __package__:  # tests.io_model, imported by bench/reliability (run from the repository root)
    from .helpers import BACKENDS, random_bytes
else:  # the tests' own import (pytest puts tests/ on sys.path)
    from helpers import BACKENDS, random_bytes

MAX_OFFSET = 300_000
MAX_LEN = 200_000


@dataclass(frozen=True)
class Step:
    kind: str            # "write", "read", "whole", "truncate", "wait"
    offset: int = 0
    length: int = 0
    seed: int = 0
    is_async: bool = False


steps = st.one_of(
    st.builds(Step, kind=st.just("write"), offset=st.integers(0, MAX_OFFSET),
              length=st.integers(0, MAX_LEN), seed=st.integers(0, 2**31), is_async=st.booleans()),
    st.builds(Step, kind=st.just("read"), offset=st.integers(0, MAX_OFFSET),
              length=st.integers(0, MAX_LEN), is_async=st.booleans()),
    st.builds(Step, kind=st.just("whole"), length=st.integers(0, MAX_LEN),
              seed=st.integers(0, 2**31)),
    st.builds(Step, kind=st.just("truncate"), length=st.integers(0, MAX_OFFSET)),
    st.builds(Step, kind=st.just("wait")),
)
sequences = st.lists(steps, min_size=1, max_size=12)
handle_settings = st.fixed_dictionaries({
    "block_size": st.sampled_from([4096, 12288, 65536]),
    "queue_depth": st.sampled_from([1, 3, 32]),
    "single_submit": st.booleans(),
    "overlap_events": st.booleans(),
    "intra_op_parallelism": st.integers(1, 4),
    "backend": st.sampled_from(BACKENDS),
})


@dataclass
class Outcome:
    ops: int = 0
    bytes_checked: int = 0
    bytes_lost: int = 0           # bytes of the file or of a read that differ from the model
    first_difference: Optional[str] = None


@dataclass
class _Pending:
    reads: List[tuple] = field(default_factory=list)    # (buffer, offset, expected bytes)
    writes: List[tuple] = field(default_factory=list)   # (start, end)


def _compare(outcome: Outcome, what: str, actual: bytes, expected: bytes) -> None:
    outcome.bytes_checked += len(expected)
    if actual == expected:
        return
    n = min(len(actual), len(expected))
    diff = int(np.count_nonzero(np.frombuffer(actual[:n], np.uint8) != np.frombuffer(expected[:n], np.uint8)))
    diff += abs(len(actual) - len(expected))
    outcome.bytes_lost += diff
    if outcome.first_difference is None:
        outcome.first_difference = f"{what}: {diff} bytes differ (sizes {len(actual)} vs {len(expected)})"


def run_sequence(settings: dict, seq: List[Step], path: str) -> Outcome:
    """Runs ``seq`` on ``path`` (created empty) and on a model; returns what differed."""
    h = nvmeio.aio_handle(**settings)
    model = bytearray()
    out = Outcome()
    pending = _Pending()
    with open(path, "wb"):
        pass

    def wait() -> None:
        h.wait()
        for buf, offset, expected in pending.reads:
            _compare(out, f"async read at {offset}", buf.tobytes(), expected)
        pending.reads.clear()
        pending.writes.clear()

    def overlaps_pending(start: int, end: int) -> bool:
        # A write racing a pending read or write of the same bytes is undefined.
        ranges = pending.writes + [(o, o + len(b)) for b, o, _ in pending.reads]
        return any(s < end and start < e for s, e in ranges)

    try:
        for step in seq:
            out.ops += 1
            start, end = step.offset, step.offset + step.length
            if step.kind == "write":
                if overlaps_pending(start, end) or not step.is_async:
                    wait()
                data = random_bytes(step.length, step.seed)
                if step.is_async:
                    h.async_pwrite(data, path, file_offset=start)
                    pending.writes.append((start, end))
                else:
                    h.sync_pwrite(data, path, file_offset=start)
                if step.length:   # an empty write changes nothing, not even the size
                    model.extend(bytes(max(0, end - len(model))))
                    model[start:end] = data.tobytes()
            elif step.kind == "read":
                wait()            # needs every write's bytes and the final size
                buf = np.full(step.length, 0xA5, np.uint8)
                if step.length and end > len(model):
                    try:
                        h.async_pread(buf, path, file_offset=start)
                    except nvmeio.ShortReadError:
                        _compare(out, "buffer of a refused read", buf.tobytes(), bytes([0xA5]) * step.length)
                        continue
                    h.wait()
                    _compare(out, f"read past the end at {start}", b"ShortReadError", b"not raised")
                    continue
                expected = bytes(model[start:end])
                if step.is_async:
                    h.async_pread(buf, path, file_offset=start)
                    pending.reads.append((buf, start, expected))
                else:
                    h.sync_pread(buf, path, file_offset=start)
                    _compare(out, f"read at {start}", buf.tobytes(), expected)
            elif step.kind == "whole":
                wait()
                data = random_bytes(step.length, step.seed)
                h.write(data, path)
                model[:] = data.tobytes()
            elif step.kind == "truncate":
                wait()
                os.truncate(path, step.length)
                model.extend(bytes(max(0, step.length - len(model))))
                del model[step.length:]
            else:
                wait()
        wait()
        with open(path, "rb") as f:
            _compare(out, "the file at the end", f.read(), bytes(model))
    finally:
        h.close()
    return out
