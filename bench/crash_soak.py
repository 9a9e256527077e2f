"""Crash anywhere, resume exactly, the long soak: hundreds of SIGKILLs at random instants of a
training job on NVMe, each life restarting from ``latest`` (tests/crash_soak.py, whose small
version tests/test_crash_soak.py runs); its section of bench/RELIABILITY.md.

    python -m bench.crash_soak --kills 200 --results-md bench/RELIABILITY.md
    python -m bench.crash_soak --ranks 2 --kills 60 --enospc 0.1 --results-md bench/RELIABILITY.md

The soak's processes import the installed nvmeio, or PYTHONPATH's (as the tests' children
do): ``PYTHONPATH=$PWD python -m bench.crash_soak ...`` soaks the working tree.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from bench import harness
from tests.crash_soak import PHASES, soak

SECTION = "## Crash anywhere, resume exactly (bench/crash_soak.py)"
SECTION_RANKS = "## Crash anywhere, resume exactly: two ranks (bench/crash_soak.py --ranks 2)"


def figures(result: dict, when: str) -> list:
    lost = len(result.get("completed_checkpoints_lost", []))
    return [harness.Figure("kills (and lives failed by ENOSPC), each resumed from `latest`",
                           f"{result['kills']} ({result.get('enospc_failures', 0)})", when=when),
            harness.Figure("end bit-identical to an uninterrupted run", "yes" if result.get("bit_identical") else "NO",
                           "yes", bool(result.get("bit_identical")), when),
            harness.Figure("completed checkpoints lost", str(lost), "0", lost == 0, when),
            harness.Figure("failures", str(len(result["failures"])), "0", not result["failures"], when)]


def details(result: dict, meta: dict) -> str:
    phases = ", ".join(f"{p} {result['phases'].get(p, 0)}" for p in PHASES)
    verdict = "0 failures" if not result["failures"] else f"{len(result['failures'])} failure(s)"
    lines = [f"Latest run: {meta['started']}, commit {meta['commit']}; {result['seconds']} s.", "",
             "The GPT of zero.examples, parameters and AdamW state on NVMe, a checkpoint every few steps; "
             "each life of the job resumes from `latest` and is SIGKILLed at a random instant; the last life "
             "runs to the end. Compared with an uninterrupted run of the same steps.", "",
             "| kills | lives failed by ENOSPC | lives | loads from latest | completed checkpoints | bit-identical end | "
             "checkpoints lost | swap leftovers | live job touched | result |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
             f"| {result['kills']} | {result.get('enospc_failures', 0)} | {result['lives']} | {result['loads']} | "
             f"{result['checkpoints_completed']} | "
             f"{'yes' if result.get('bit_identical') else 'NO'} | {len(result.get('completed_checkpoints_lost', []))} | "
             f"{len(result.get('swap_leftovers', []))} | "
             f"{'yes' if any('live job' in f for f in result['failures']) else 'no'} | {verdict} |", "",
             f"- kills by phase: {phases}.",
             *(_survivors(result) if result.get("ranks", 1) > 1 else []),
             *[f"- failure: {f[:500]}" for f in result["failures"]], ""]
    return "\n".join(lines)


def _survivors(result: dict) -> list:
    """The lines of a multi-rank run: how long the other rank took to fail, by the phase of the death."""
    def stats(seconds):
        return f"median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s over {len(seconds)}"

    times = result["survivor_fail_s"]
    if not times:
        return ["- no rank outlived its peer's death."]
    by_phase = {}
    for at, seconds in times:
        by_phase.setdefault(at, []).append(seconds)
    errors = ", ".join(f"{name} {n}" for name, n in sorted(result["survivor_errors"].items(), key=lambda e: -e[1]))
    return [f"- {result['ranks']} gloo ranks, one killed (or given the ENOSPC) per life; the other must exit on its "
            f"own within {result['bound_s']:g} s of that death. After a kill it did: {stats([s for _, s in times])}.",
            "- by the phase of the kill: " + "; ".join(f"{at} {stats(by_phase[at])}"
                                                         for at in PHASES if at in by_phase) + ".",
            f"- what the survivors died of: {errors}."]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--max-delay", type=float, default=2.0,
                   help="kills land uniformly in [0, this) s after the engine is built (one in ten from the start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="ranks of the job (gloo processes); one is killed per life")
    p.add_argument("--pg-timeout", type=float, default=30.0,
                   help="timeout of the ranks' gloo group, s (with --ranks > 1)")
    p.add_argument("--bound", type=float, default=0.0,
                   help="a survivor must fail within this many s of its peer's death (default: pg timeout + 120)")
    p.add_argument("--enospc", type=float, default=0.0,
                   help="this fraction of lives gets ENOSPC at a random write instead of a kill")
    p.add_argument("--dir", default=None, help="where the runs' files go (default: a fresh temporary folder)")
    p.add_argument("--out", help="JSON of the result")
    p.add_argument("--results-md", help="replace this file's section (bench/RELIABILITY.md)")
    args = p.parse_args(argv)
    meta = harness.provenance()
    root = tempfile.mkdtemp(prefix="crash-soak-", dir=args.dir)
    result = soak(root, args.kills, args.steps, args.save_every, args.layers, args.d_model, args.max_delay, args.seed,
                  enospc=args.enospc, ranks=args.ranks, pg_timeout=args.pg_timeout, bound=args.bound)
    print(json.dumps(result, indent=1))
    harness.save_json(result, args.out, indent=1)
    if args.results_md:
        harness.write_section(args.results_md, SECTION if args.ranks == 1 else SECTION_RANKS,
                              figures(result, meta["when"]),
                              "python -m bench.crash_soak " + " ".join(argv), details(result, meta))
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
