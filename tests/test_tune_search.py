"""nvme_tune's searches on simulated disks (no I/O): the smart search stays
within a quarter of the grid's runs and time, reaches the optimum of a quiet
disk, and on a noisy one picks a configuration close to the best; the grid
measures everything once; --budget stops both."""

import random
import statistics

import pytest

from nvmeio.tune._measure import Sample
from nvmeio.tune._search import SMALL_SPACE, grid_search, planned_evals, smart_search
from nvmeio.tune._space import build_space

BACKENDS = ["io_uring", "aio", "psync"]
IO_GIB = 400 / 1024  # GiB moved each way by one simulated run
# Relative speed per setting: parallelism and backend matter, the rest a little.
EFFECT = {
    "backend": {"io_uring": 1.05, "aio": 1.0, "psync": 0.88},
    "intra_op_parallelism": {1: 0.9, 2: 0.95, 4: 1.0, 8: 1.03},
    "block_size": {1 << 20: 1.0, 8 << 20: 1.01},
    "queue_depth": {8: 0.98, 32: 1.0, 128: 1.005},
    "single_submit": {False: 1.0, True: 0.99},
    "overlap_events": {False: 0.995, True: 1.0},
}


def true_gbps(config) -> float:
    """read + write GB/s of a configuration on the simulated disk."""
    v = 6.0
    for key, table in EFFECT.items():
        v *= table[getattr(config, key)]
    return v


class Disk:
    """Measures with multiplicative noise in [1 - noise, 1 + noise] and a simulated clock."""

    def __init__(self, seed: int, noise: float):
        self.rng = random.Random(seed)
        self.noise = noise
        self.now = 0.0
        self.measured = []

    def clock(self) -> float:
        return self.now

    def measure(self, config, phase) -> Sample:
        self.measured.append((config, phase))
        v = true_gbps(config) * self.rng.uniform(1 - self.noise, 1 + self.noise)
        read, write = v / 3, 2 * v / 3
        self.now += IO_GIB / read + IO_GIB / write + 0.03  # + handle set-up
        return Sample(read_gbps=read, write_gbps=write, read_s=IO_GIB / read,
                      write_s=IO_GIB / write)


@pytest.fixture(scope="module")
def space():
    return build_space(None, None, BACKENDS)


def test_default_space_is_ds_nvme_tunes_64_per_backend(space):
    assert len(space) == 64 * len(BACKENDS)


def test_grid_measures_every_configuration_once_and_picks_the_best_sample(space):
    disk = Disk(0, 0.4)
    result = grid_search(space, disk.measure, clock=disk.clock)
    assert sorted(c.label() for c, _ in disk.measured) == sorted(c.label() for c in space)
    assert result.best == max(result.results.samples, key=result.results.score)


@pytest.mark.parametrize("seed", range(10))
def test_smart_search_takes_at_most_a_quarter_of_the_grids_runs_and_time(space, seed):
    grid_disk, smart_disk = Disk(seed, 0.4), Disk(seed + 100, 0.4)
    grid = grid_search(space, grid_disk.measure, clock=grid_disk.clock)
    smart = smart_search(space, smart_disk.measure, clock=smart_disk.clock)
    assert smart.evals <= len(space) // 4 == planned_evals(space, "smart")
    assert smart.elapsed_s <= 0.25 * grid.elapsed_s
    assert all(c in space for c, _ in smart_disk.measured)


def test_quiet_disk_smart_search_finds_the_optimum(space):
    disk = Disk(0, 0.0)
    result = smart_search(space, disk.measure, clock=disk.clock)
    assert result.best == max(space, key=true_gbps)


def test_noisy_disk_smart_pick_is_close_to_the_best(space):
    """±40% noise: over 40 simulated tunings, the pick is within 5% of the best on average
    and never worse than 80%."""
    best = max(true_gbps(c) for c in space)
    ratios = []
    for seed in range(40):
        disk = Disk(seed, 0.4)
        ratios.append(true_gbps(smart_search(space, disk.measure, clock=disk.clock).best) / best)
    assert statistics.fmean(ratios) >= 0.93
    assert min(ratios) >= 0.80


def test_the_smart_pick_was_measured_at_least_twice(space):
    disk = Disk(3, 0.4)
    result = smart_search(space, disk.measure, clock=disk.clock)
    assert result.results.count(result.best) >= 2
    assert set(result.phases) <= {"coarse", "descent", "confirm"}


def test_small_space_is_swept_in_full():
    space = build_space({"queue_depth": [8, 32], "intra_op_parallelism": [1, 2]}, ["aio"],
                        BACKENDS)
    assert len(space) <= SMALL_SPACE
    disk = Disk(0, 0.4)
    result = smart_search(space, disk.measure, clock=disk.clock)
    assert sorted(c.label() for c, _ in disk.measured) == sorted(c.label() for c in space)
    assert result.method.startswith("smart (small space")


@pytest.mark.parametrize("search", [grid_search, smart_search])
def test_budget_seconds_stop_the_search_after_the_run_in_progress(space, search):
    disk = Disk(0, 0.4)
    result = search(space, disk.measure, budget_s=2.0, clock=disk.clock)
    run_s = IO_GIB / (true_gbps(max(space, key=true_gbps)) * 1.4 / 3)  # a run's lower bound
    assert 1 <= result.evals <= 2.0 / run_s + 1
    assert "--budget" in result.stopped
    assert result.best is not None


def test_failed_runs_never_become_the_pick(space):
    class Failing(Disk):
        def measure(self, config, phase):
            if config.backend == "io_uring":
                self.measured.append((config, phase))
                return Sample(error="OSError: simulated")
            return super().measure(config, phase)

    disk = Failing(0, 0.1)
    result = smart_search(space, disk.measure, clock=disk.clock)
    assert result.best.backend != "io_uring"
    assert result.results.errors()
