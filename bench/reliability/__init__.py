"""Reliability report: how nvmeio fails, tried on purpose. Regenerates bench/RELIABILITY.md.

    python -m bench.reliability                      # everything, scratch files under /tmp
    python -m bench.reliability --dir /local_nvme    # scratch files there
    python -m bench.reliability --quick              # fewer cases (a minute or so)
    python -m bench.reliability --only faults,leaks  # some sections; the others are kept from
                                                     # bench/out/reliability.json

Sections (each a function ``(Context) -> Section``, listed in report.SECTIONS):

- faults: every injected fault of nvmeio.faults on every backend: the error
  surfaces from the op that hit it, wait() never hangs, nothing leaks, the
  handle stays usable, no byte of a surviving file is lost;
- model (fuzzing.py): hypothesis sequences of sync/async reads and writes, whole-file
  writes and truncations against an in-memory model of the file (tests/io_model.py);
- config (fuzzing.py): the ZeRO config loader fed mutated real configs and damaged files
  (tests/config_mutations.py): ConfigError or a loaded config, nothing else;
- stress: 8 threads x 2,000 mixed ops, shared and own handles, byte-checked;
- leaks (stress.py): fds, threads, VmLck and kernel AIO contexts around churn (200 handles,
  2,000 failing ops, locked tensors, engine failures): goal 0;
- security: NUL paths, planted symlinks, read-only targets, killed writers,
  lazy (conjugate/negative) views, out-of-range integers;
- engine, checkpoints: the ZeRO-3 engine under injected swap-in/swap-out faults and
  damaged swap files; hostile checkpoints and saves cut at their worst moment.

What a case is (rows, sections, the guarded run that counts a hang, an error or a leak) is
cases.py. To add a section: write a function ``def my_section(ctx: Context) -> Section`` in
a module of its own here, append it to report.SECTIONS, and rerun. Rows are aggregated into
the summary table; a row fails when any of its cases fails, loses bytes or leaks. The tests'
modules it uses (io_model, config_mutations, helpers) are imported as ``tests.*``: run it from
the repository root.
"""
