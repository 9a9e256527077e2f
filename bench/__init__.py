"""Benchmarks, run on purpose (never in CI), each a module run from the repository root:

    python -m bench.io_throughput --help
    flock /tmp/bench.lock python -m bench.scale speed --results-md bench/RESULTS.md

Every benchmark goes through :mod:`bench.harness` (child processes, provenance, fio's
reference, its RESULTS.md section); the training benchmarks share one step of plain
torch, of our engine and of DeepSpeed (:mod:`bench.training`). The latest figures are
in bench/RESULTS.md, the reliability report in bench/RELIABILITY.md.
"""
