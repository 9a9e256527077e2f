"""Repository tooling, not installed (pyproject's wheel.packages leaves it out).

- ``results_md``: the one writer of bench/RESULTS.md sections (headline, command, details) and their PNG charts;
- ``fio``: fio runs, huge-page reservation and fio's best-configuration sweep, the
  reference every I/O benchmark compares against;
- ``readme_commands``: the README's set-up and test commands (a test checks that ``.ci/run`` runs exactly the test command).

The benchmarks (the ``bench`` package, run from the repository root) import these as
``tools.fio`` and ``tools.results_md``, through bench/harness.py.
"""
