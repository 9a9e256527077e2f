"""nvme_tune's smart search against the full grid: time, and the quality of the pick.

Run on purpose (not in CI):

    python -m bench.tune_search                               # 400M, in the temp dir
    python -m bench.tune_search --nvme_dir /local_nvme --trials 3
    python -m bench.tune_search --results-md bench/RESULTS.md  # also refresh that section

One trial, in one process over one shared buffer and file (nvmeio.tune's
Workload): the full grid (every configuration of ds_nvme_tune's default sweep
x every available backend, once each; the pick is the best single read +
write sample, as ds_nvme_tune picks) and the smart search (nvme_tune's
default), each timed from its first to its last measurement. Then the two
picks are re-measured alternately, --rounds rounds each (the order flips
every round so drift hits both alike), and the smart pick's mean read + write
GB/s is divided by the grid pick's.

Goals (issue #4): smart time <= 0.25 x grid time, and the re-measured ratio
>= 0.95. Trials alternate which search runs first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import nvmeio
from bench import harness
from nvmeio.tune._dirs import check_dir
from nvmeio.tune._measure import Workload
from nvmeio.tune._search import grid_search, smart_search
from nvmeio.tune._space import build_space, format_size, parse_size

SECTION = "## nvme_tune search (bench/tune_search.py)"
TIME_GOAL, QUALITY_GOAL = 0.25, 0.95


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_trial(workload: Workload, space, rounds: int, grid_first: bool, progress) -> dict:
    def measure(config, phase):
        sample = workload.measure(config)
        progress(phase)
        return sample

    searches = {}
    for name in (("grid", "smart") if grid_first else ("smart", "grid")):
        searches[name] = grid_search(space, measure) if name == "grid" else \
            smart_search(space, measure)
    grid, smart = searches["grid"], searches["smart"]
    picks = {"grid": grid.best, "smart": smart.best}
    samples: dict[str, list] = {"grid": [], "smart": []}
    for r in range(rounds):
        for name in (("grid", "smart") if r % 2 == 0 else ("smart", "grid")):
            s = workload.measure(picks[name])
            progress("remeasure")
            samples[name].append({"read_gbps": s.read_gbps, "write_gbps": s.write_gbps,
                                  "sum": s.score, "error": s.error})

    def stats(name: str) -> dict:
        ss = samples[name]
        sums = [x["sum"] for x in ss]
        return {"config": picks[name].as_dict(), "aio": picks[name].aio_block(),
                "label": picks[name].label(),
                "read_gbps": statistics.fmean(x["read_gbps"] for x in ss),
                "write_gbps": statistics.fmean(x["write_gbps"] for x in ss),
                "sum_mean": statistics.fmean(sums), "sum_median": statistics.median(sums),
                "samples": ss}

    g, s = stats("grid"), stats("smart")
    return {
        "grid_first": grid_first,
        "grid": {"runs": grid.evals, "time_s": grid.elapsed_s,
                 "pick_search_gbps": grid.results.score(grid.best), **g},
        "smart": {"runs": smart.evals, "configurations": len(smart.results.samples),
                  "budget_runs": smart.budget_evals, "phases": smart.phases,
                  "time_s": smart.elapsed_s,
                  "pick_search_gbps": smart.results.score(smart.best), **s},
        "time_ratio": smart.elapsed_s / grid.elapsed_s,
        "runs_ratio": smart.evals / grid.evals,
        "quality_ratio": s["sum_mean"] / g["sum_mean"],
        "quality_ratio_median": s["sum_median"] / g["sum_median"],
        "same_pick": picks["grid"] == picks["smart"],
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        SECTION, "",
        f"{m['started']}, commit {m['commit']}, {m['nproc']} cores, kernel {m['kernel']}, "
        f"{m['fstype']} on {m['disk_dir']}, io_size {format_size(report['io_size'])}, "
        f"space {report['space_size']} configurations ({report['space']}).",
        f"Load before: `{m['uptime_before']}`; after: `{m['uptime_after']}` "
        "(2 cores shared with other engineers' jobs).", "",
        "| trial | grid runs | grid time | smart runs | smart time | time ratio | "
        "grid pick: r+w GB/s in the sweep → re-measured | "
        "smart pick: r+w GB/s in the search → re-measured | "
        f"quality ratio (mean of {report['rounds']}) | median ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, t in enumerate(report["trials"], 1):
        g, s = t["grid"], t["smart"]
        lines.append(
            f"| {i} | {g['runs']} | {g['time_s']:.1f} s | {s['runs']} | {s['time_s']:.1f} s | "
            f"**{t['time_ratio']:.3f}** | `{g['label']}` {g['pick_search_gbps']:.2f} → "
            f"{g['sum_mean']:.2f} | `{s['label']}` {s['pick_search_gbps']:.2f} → "
            f"{s['sum_mean']:.2f} | **{t['quality_ratio']:.3f}** | "
            f"{t['quality_ratio_median']:.3f} |")
    v = report["verdict"]
    lines += [
        "",
        f"Goals: time ratio <= {TIME_GOAL} and quality ratio >= {QUALITY_GOAL}: "
        f"{'met' if v['met'] else 'NOT met'} in {v['trials_met']} of {v['trials']} trials "
        f"(worst time ratio {v['worst_time_ratio']:.3f}, worst quality ratio "
        f"{v['worst_quality_ratio']:.3f}).",
        "",
        "Times cover the searches' measurements only (the buffer and file are shared and "
        "prepared once), handle set-up and teardown included. The grid pick is its best "
        "single sample (ds_nvme_tune's rule), so its sweep figure is its luckiest run; the "
        "smart pick is the best mean among configurations measured at least twice. The "
        f"quality ratio is smart / grid of the mean read + write GB/s over {report['rounds']} "
        "alternating re-measurements of each pick (the order flips every round). JSON: "
        f"`{report.get('json_path', 'stdout')}`.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme_dir", default=tempfile.gettempdir())
    p.add_argument("--io_size", type=parse_size, default=parse_size("400M"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--backend", nargs="+", help="backends (default: every available one)")
    p.add_argument("--json", default=os.path.join(harness.ROOT, "bench", "out", "tune_search.json"),
                   help="where to write the JSON report (default bench/out/tune_search.json)")
    p.add_argument("--results-md", help="refresh our section of this markdown file")
    args = p.parse_args()

    from tqdm import tqdm

    available = nvmeio.available_backends()
    space = build_space(None, args.backend, available)
    check = check_dir(args.nvme_dir)
    if not check.usable:
        print(f"tune_search: {args.nvme_dir} {check.problem}", file=sys.stderr)
        return 2
    bench_dir = tempfile.mkdtemp(prefix="tune_search_", dir=args.nvme_dir)
    machine = {**harness.provenance(), "nvmeio": nvmeio.__version__, "disk_dir": args.nvme_dir,
               "fstype": check.fstype, "direct_io": check.direct_io, "backends": available,
               "uptime_before": uptime()}
    per_trial = len(space) + len(space) // 4 + 2 * args.rounds
    bar = tqdm(total=per_trial * args.trials, desc="tune_search", unit="run", file=sys.stderr)
    trials = []
    t0 = time.monotonic()
    try:
        with Workload([bench_dir], args.io_size) as workload:
            for i in range(args.trials):
                trials.append(run_trial(workload, space, args.rounds, grid_first=(i % 2 == 0),
                                        progress=lambda phase: bar.update(1)))
    finally:
        bar.close()
        os.rmdir(bench_dir)
    machine["uptime_after"] = uptime()
    machine["wall_s"] = round(time.monotonic() - t0, 1)
    met = [t["time_ratio"] <= TIME_GOAL and t["quality_ratio"] >= QUALITY_GOAL for t in trials]
    report = {
        "machine": machine, "io_size": args.io_size, "rounds": args.rounds,
        "space": space.describe(), "space_size": len(space), "trials": trials,
        "verdict": {"met": all(met), "trials": len(trials), "trials_met": sum(met),
                    "worst_time_ratio": max(t["time_ratio"] for t in trials),
                    "worst_quality_ratio": min(t["quality_ratio"] for t in trials)},
        "json_path": os.path.relpath(args.json, harness.ROOT) if args.json else None,
    }
    harness.save_json(report, args.json, indent=2)
    md = markdown(report)
    print(md)
    if args.results_md:
        harness.write_section(args.results_md, SECTION, figures(report), "python -m bench.tune_search " + " ".join(
            sys.argv[1:]), md.split("\n", 1)[1])
    return 0 if report["verdict"]["met"] else 1


def figures(report: dict) -> list:
    """The headline (issue #4): the worst trial's search time and pick quality, smart over grid."""
    v, when, n = report["verdict"], report["machine"]["when"], len(report["trials"])
    return [harness.Figure(f"smart search time / full grid's (worst of {n} trials)", f"**{v['worst_time_ratio']:.3f}**",
                           f"≤ {TIME_GOAL}", v["worst_time_ratio"] <= TIME_GOAL, when),
            harness.Figure(f"smart pick / grid pick, re-measured r+w GB/s (worst of {n} trials)",
                           f"**{v['worst_quality_ratio']:.3f}**", f"≥ {QUALITY_GOAL}",
                           v["worst_quality_ratio"] >= QUALITY_GOAL, when)]


if __name__ == "__main__":
    sys.exit(main())
