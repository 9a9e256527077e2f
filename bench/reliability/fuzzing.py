"""Random inputs: hypothesis sequences of reads and writes against an in-memory model of the file
(tests/io_model.py), and the ZeRO config loader fed mutated configs and damaged files
(tests/config_mutations.py)."""
from __future__ import annotations

import os
from typing import List

from nvmeio import resources

from .cases import Context, Row, Section, run_guarded, settled_snapshot


def section_model(ctx: Context) -> Section:
    from hypothesis import HealthCheck, given, settings
    from tests.io_model import handle_settings, run_sequence, sequences

    examples = 100 if ctx.quick else 500
    totals = {"examples": 0, "ops": 0, "bytes_checked": 0, "bytes_lost": 0}
    first: List[str] = []
    d = ctx.fresh_dir("model")

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cfg=handle_settings, seq=sequences)
    def run(cfg, seq):
        path = os.path.join(d, f"m{totals['examples']}.bin")
        out = run_sequence(cfg, seq, path)
        os.unlink(path)
        totals["examples"] += 1
        totals["ops"] += out.ops
        totals["bytes_checked"] += out.bytes_checked
        totals["bytes_lost"] += out.bytes_lost
        if out.first_difference and not first:
            first.append(f"{out.first_difference} ({cfg}, {seq})")

    before = settled_snapshot()
    error = run_guarded(run)
    grown = resources.grown_since(before)
    row = Row("random read/write sequences vs an in-memory model", cases=totals["examples"],
              failed=1 if error else 0, bytes_lost=totals["bytes_lost"], leaks=grown,
              detail=(error or (first[0] if first else
                                f"{totals['ops']:,} ops, {totals['bytes_checked']:,} bytes compared")))
    return Section("model", "Hypothesis: random I/O sequences against a model of the file",
                   "Sequences of up to 12 steps (sync/async pwrite and pread at any offset and "
                   "size up to 200 KB, whole-file write(), truncation from outside, wait()) on a "
                   "random backend and handle settings (block size, queue depth, threads, "
                   "single_submit, overlap_events); every read and the final file compared with a "
                   "bytearray model; a read past the end must raise ShortReadError and leave its "
                   "buffer untouched. tests/io_model.py.", [row], dict(totals))


# -- config ---------------------------------------------------------------------------------------

def section_config(ctx: Context) -> Section:
    from tests.config_mutations import fuzz

    cases = 500 if ctx.quick else 4000
    d = ctx.fresh_dir("config")
    before = settled_snapshot()
    result = fuzz(cases=cases, seed=14, scratch=d)
    grown = resources.grown_since(before)
    row = Row("mutated configs and damaged JSON files", cases=result.cases,
              failed=len(result.findings), leaks=grown,
              detail=("; ".join(result.findings[:5]) or
                      f"{result.loaded} loaded, {result.clear_errors} ConfigError with the key named"))
    return Section("config", "ZeRO config loader fuzzing (zero config)",
                   "The real DeepSpeed configs of tests/data and the test suite's base configs, "
                   "with 1-3 random mutations each (a key deleted, a value replaced by junk of "
                   "another type or an extreme value such as NaN, 2**63, '', '../../etc', a key "
                   "misspelled, an unknown key added), loaded for a random world size; and files "
                   "cut short, with a flipped byte or a duplicated key. A case fails on any outcome "
                   "but a loaded config or a ConfigError with a message. tests/config_mutations.py.",
                   [row], {"loaded": result.loaded, "config_errors": result.clear_errors})
