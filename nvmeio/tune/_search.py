"""Which configurations to measure: the full grid, or a smarter search.

Both take a ``measure(config, phase) -> Sample`` callback and return a
:class:`SearchResult`; the pick maximises read + write GB/s, as
ds_nvme_tune's does.

[Note: the smart search]
The disk is noisy (run-to-run differences of tens of percent), and the
grid's pick is the luckiest single sample among 64 or more. The smart search
spends at most a quarter of the grid's measurements (``len(space) // 4``,
at least 8; a space of at most 8 points is swept in full) and at most a
quarter of the grid's time, estimated after step 1 as ``len(space)`` times
the median wall time of a coarse run (handle set-up and teardown included),
less a 20% margin:

1. coarse: per backend, the lowest and the highest ``intra_op_parallelism``
   at an anchor point (upper-median block size and queue depth,
   ``single_submit`` false, ``overlap_events`` true: the settings DeepSpeed
   recommends).
2. coordinate descent from the best so far: one key at a time (backend,
   parallelism, queue depth, block size, overlap_events, single_submit),
   every other value of that key is measured once. A challenger that beats
   the incumbent is measured again, alternating with the incumbent, until
   both have two samples; it takes over only if its mean is still higher.
   Passes repeat while something changed. A fifth of the budget is kept for
   step 3.
3. confirm: the three best are re-measured round-robin (fewest samples
   first) until each has three samples or the budget is spent; the pick is
   the best mean among configurations measured at least twice. When that is
   not where the descent ended, the descent resumes from it (measured
   neighbours are not measured again), then confirms again.

Repetitions go only to contenders, so noise cannot crown a configuration on
one lucky run, and the measurements concentrate on fast configurations,
which take less time than the grid's average one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ._measure import Sample
from ._space import Config, SweepSpace

__all__ = ["Results", "SearchResult", "grid_search", "smart_search", "planned_evals",
           "SMALL_SPACE", "METHODS"]

Measure = Callable[[Config, str], Sample]
Clock = Callable[[], float]
METHODS = ("smart", "grid")
SMALL_SPACE = 8          # spaces this small are swept in full
MIN_EVALS = 8            # the smart search's smallest budget
DESCENT_REPS = 2         # samples each of challenger and incumbent before a move
CONFIRM_REPS = 3         # samples each of the final contenders
CONTENDERS = 3
TIME_SHARE = 0.25        # of the grid's estimated time
TIME_SAFETY = 0.8        # margin on the estimate of the grid's time
DESCENT_ORDER = ("backend", "intra_op_parallelism", "queue_depth", "block_size",
                 "overlap_events", "single_submit")


class Results:
    """Every sample of every configuration measured, in order."""

    def __init__(self) -> None:
        self.samples: dict[Config, list[Sample]] = {}

    def add(self, config: Config, sample: Sample) -> None:
        self.samples.setdefault(config, []).append(sample)

    def count(self, config: Config) -> int:
        return len(self.samples.get(config, ()))

    def mean(self, config: Config, what: str) -> Optional[float]:
        """Mean of ``read_gbps`` or ``write_gbps`` over the successful samples."""
        values = [getattr(s, what) for s in self.samples.get(config, ())
                  if not s.error and getattr(s, what) is not None]
        return statistics.fmean(values) if values else None

    def score(self, config: Config) -> float:
        """Mean read + mean write GB/s; a failed sample counts as 0; -1 if unmeasured."""
        samples = self.samples.get(config)
        if not samples:
            return -1.0
        return statistics.fmean(s.score for s in samples)

    def ranked(self) -> list[Config]:
        return sorted(self.samples, key=self.score, reverse=True)

    def errors(self) -> list[tuple[Config, str]]:
        return [(c, s.error) for c, ss in self.samples.items() for s in ss if s.error]

    def total(self) -> int:
        return sum(len(v) for v in self.samples.values())


@dataclass
class SearchResult:
    method: str                  # "smart" or "grid"
    best: Optional[Config]       # None when every measurement failed
    results: Results
    grid_size: int
    budget_evals: int
    elapsed_s: float
    stopped: Optional[str] = None  # why the search ended before its plan
    phases: dict = field(default_factory=dict)

    @property
    def evals(self) -> int:
        return self.results.total()


class _OutOfBudget(Exception):
    pass


class _Runner:
    """Counts measurements against the run budget, the time cap and --budget.

    ``time_cap`` (seconds since ``t0``) is set by the smart search once the
    coarse runs give an estimate of the grid's time; ``left()`` is the number
    of runs that still fit in both budgets at the mean run time so far.
    """

    def __init__(self, measure: Measure, max_evals: int, budget_s: Optional[float],
                 clock: Clock = time.monotonic):
        self.measure = measure
        self.max_evals = max_evals
        self.clock = clock
        self.t0 = clock()
        self.deadline = None if budget_s is None else self.t0 + budget_s
        self.time_cap: Optional[float] = None
        self.results = Results()
        self.phases: dict[str, int] = {}
        self.stopped: Optional[str] = None
        self.run_s: list[float] = []  # wall time of every run, handle set-up and teardown in

    @property
    def used(self) -> int:
        return self.results.total()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def typical_run_s(self) -> float:
        """Median wall time of a run: one stalled run must not stretch the time cap."""
        return statistics.median(self.run_s) if self.run_s else 0.0

    def left(self) -> int:
        runs = self.max_evals - self.used
        if self.time_cap is not None and self.run_s:
            runs = min(runs, int((self.time_cap - self.elapsed()) / self.typical_run_s()))
        return runs

    def run(self, config: Config, phase: str) -> Sample:
        if self.used >= self.max_evals:
            raise _OutOfBudget()
        now = self.clock()
        if self.deadline is not None and self.used and now >= self.deadline:
            self.stopped = "time budget (--budget) spent"
            raise _OutOfBudget()
        if self.time_cap is not None and self.elapsed() + self.typical_run_s() > self.time_cap:
            self.stopped = "time cap (a quarter of the grid's estimated time) reached"
            raise _OutOfBudget()
        sample = self.measure(config, phase)
        self.run_s.append(self.clock() - now)
        self.results.add(config, sample)
        self.phases[phase] = self.phases.get(phase, 0) + 1
        return sample


def planned_evals(space: SweepSpace, method: str, max_evals: Optional[int] = None) -> int:
    """How many measurements a search plans at most (the progress bar's total)."""
    n = len(space)
    if method == "grid" or n <= SMALL_SPACE:
        return n
    if max_evals is not None:
        return max(1, max_evals)
    return min(n, max(n // 4, MIN_EVALS))


def _best_pick(results: Results, min_samples: int = 1) -> Optional[Config]:
    ranked = [c for c in results.ranked() if results.score(c) > 0]
    repeated = [c for c in ranked if results.count(c) >= min_samples]
    pool = repeated or ranked
    return pool[0] if pool else None


def grid_search(space: SweepSpace, measure: Measure, budget_s: Optional[float] = None,
                phase: str = "grid", clock: Clock = time.monotonic) -> SearchResult:
    """Every configuration once, in order; the pick is the best single sample.

    ``clock``: seconds, monotonic (tests pass a simulated one).
    """
    runner = _Runner(measure, len(space), budget_s, clock)
    try:
        for config in space:
            runner.run(config, phase)
    except _OutOfBudget:
        pass
    return SearchResult("grid", _best_pick(runner.results), runner.results, len(space),
                        len(space), runner.elapsed(), runner.stopped, runner.phases)


def _anchor(space: SweepSpace) -> dict:
    values = space.values
    anchor = {}
    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        vs = values[key]
        anchor[key] = vs[len(vs) // 2]
    anchor["single_submit"] = False if False in values["single_submit"] else \
        values["single_submit"][0]
    anchor["overlap_events"] = True if True in values["overlap_events"] else \
        values["overlap_events"][0]
    return anchor


def coarse_points(space: SweepSpace, limit: int) -> list[Config]:
    """Step 1 of [Note: the smart search]: backend x {lowest, highest parallelism}."""
    anchor = _anchor(space)
    intra = space.values["intra_op_parallelism"]
    levels = [intra[-1], intra[0]] if len(intra) > 1 else [intra[0]]
    points = []
    for level in levels:  # highest parallelism of every backend first
        for backend in space.values["backend"]:
            points.append(Config(backend=backend, **{**anchor, "intra_op_parallelism": level}))
    return points[:max(1, limit)]


def smart_search(space: SweepSpace, measure: Measure, max_evals: Optional[int] = None,
                 budget_s: Optional[float] = None,
                 clock: Clock = time.monotonic) -> SearchResult:
    """Coarse grid, coordinate descent, confirmation; see [Note: the smart search].

    ``max_evals`` replaces the default run budget (and lifts the time cap).
    """
    n = len(space)
    if n <= SMALL_SPACE:
        result = grid_search(space, measure, budget_s, clock=clock)
        result.method = "smart (small space: every configuration once)"
        return result
    budget = planned_evals(space, "smart", max_evals)
    runner = _Runner(measure, budget, budget_s, clock)
    results = runner.results
    reserve = max(2, budget // 5)
    try:
        for config in coarse_points(space, budget // 3):
            runner.run(config, "coarse")
        if max_evals is None:
            runner.time_cap = TIME_SHARE * TIME_SAFETY * n * runner.typical_run_s()
        current = _best_pick(results) or next(iter(results.samples))
        starts = set()
        while current not in starts:
            starts.add(current)
            current = _descend(space, runner, current, reserve)
            _confirm(runner)
            # When the confirmation overturned the descent, descend from its pick.
            current = _best_pick(results, min_samples=2) or current
    except _OutOfBudget:
        pass
    return SearchResult("smart", _best_pick(results, min_samples=2), results, n, budget,
                        runner.elapsed(), runner.stopped, runner.phases)


def _challenge(runner: _Runner, challenger: Config, incumbent: Config) -> bool:
    """Re-measures both, alternately, until each has DESCENT_REPS samples."""
    results = runner.results
    while results.count(challenger) < DESCENT_REPS or results.count(incumbent) < DESCENT_REPS:
        pick = challenger if results.count(challenger) <= results.count(incumbent) else incumbent
        runner.run(pick, "descent")
    return results.score(challenger) > results.score(incumbent)


def _descend(space: SweepSpace, runner: _Runner, current: Config, reserve: int) -> Config:
    results = runner.results
    keys = [k for k in DESCENT_ORDER if len(space.values[k]) > 1]
    changed = True
    while changed:
        changed = False
        for key in keys:
            for value in space.values[key]:
                if value == getattr(current, key):
                    continue
                if runner.left() <= reserve:
                    return current
                candidate = current.with_value(key, value)
                if results.count(candidate) == 0:
                    runner.run(candidate, "descent")
                if results.score(candidate) > results.score(current) and \
                        _challenge(runner, candidate, current):
                    current, changed = candidate, True
    return current


def _confirm(runner: _Runner) -> None:
    results = runner.results
    contenders = [c for c in results.ranked() if results.score(c) > 0][:CONTENDERS]
    while contenders:
        pending = [c for c in contenders if results.count(c) < CONFIRM_REPS]
        if not pending:
            return
        runner.run(min(pending, key=results.count), "confirm")
