"""What a reliability case is: a report's rows and sections, the context a section runs in, and
running one case so that a hang, an error or a leak is counted instead of stopping the report."""
from __future__ import annotations

import gc
import os
import shutil
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from nvmeio import resources

HANG_LIMIT_S = 60
BLOCK = 64 << 10  # the block size of the I/O cases' handles: a few requests per op


@dataclass
class Row:
    name: str
    cases: int = 0
    failed: int = 0
    bytes_lost: int = 0
    leaks: Dict[str, int] = field(default_factory=dict)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.bytes_lost == 0 and not self.leaks


@dataclass
class Section:
    key: str
    title: str
    about: str
    rows: List[Row] = field(default_factory=list)
    figures: Dict[str, object] = field(default_factory=dict)   # extra numbers worth a line
    seconds: float = 0.0


@dataclass
class Context:
    scratch: str
    quick: bool
    backends: List[str]

    def fresh_dir(self, name: str) -> str:
        d = os.path.join(self.scratch, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def lost(actual: bytes, expected: bytes) -> int:
    n = min(len(actual), len(expected))
    diff = np.count_nonzero(np.frombuffer(actual[:n], np.uint8) != np.frombuffer(expected[:n], np.uint8))
    return int(diff) + abs(len(actual) - len(expected))


def settled_snapshot() -> resources.Resources:
    """A case's "before": after garbage collection (its "after" is resources.grown_since)."""
    gc.collect()
    return resources.snapshot()


def run_guarded(fn: Callable[[], None]) -> Optional[str]:
    """Runs fn in a thread; returns None, the error text, or 'hang' after HANG_LIMIT_S."""
    box: Dict[str, str] = {}

    def target():
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported as the case's failure
            box["error"] = traceback.format_exc(limit=4).strip().splitlines()[-1]

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_LIMIT_S)
    if t.is_alive():
        return f"hang: still running after {HANG_LIMIT_S} s"
    return box.get("error")



class Expectation(AssertionError):
    """A case saw something other than what it expects."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Expectation(what)
