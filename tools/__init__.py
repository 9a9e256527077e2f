"""Repository tooling, not installed (pyproject's wheel.packages leaves it out).

- ``results_md``: the one writer of bench/RESULTS.md sections and their PNG charts;
- ``fio``: fio runs, huge-page reservation and fio's best-configuration sweep, the
  reference every I/O benchmark compares against;
- ``readme_commands``: the README's set-up and test commands (a test checks that ``.ci/run`` runs exactly the test command).

Scripts under ``bench/`` import these with the repository root on ``sys.path``
(``sys.path.insert(0, <repo>)``; ``from tools.results_md import replace_section``).
"""
