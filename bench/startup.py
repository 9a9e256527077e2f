"""How long a fresh process takes to build an engine and take its first step: every rank of every
launch pays it, before any I/O.

    flock /tmp/bench.lock python -m bench.startup --results-md bench/RESULTS.md
    python -m bench.startup --rounds 3          # a quick look

Each run is a fresh process that imports torch and zero, builds a small GPT (4 layers, d_model
256, vocab 4096), then either ``zero.initialize`` with parameters and optimizer on NVMe (as
bench/checksum_cost.py) or, the reference, plain torch's AdamW, and takes one step of batch 1.
The variants, round-robin ``--rounds`` times, median per phase:

- ``plain torch``: the model in memory and ``torch.optim.AdamW``;
- ``ours``: the engine as it is;
- ``ours, torch's add_param_group``: the engine calling the optimizer's ``add_param_group``
  through torch's ``torch._disable_dynamo`` wrapper, whose first call imports ``torch._dynamo``
  (what the engine did before 2026-11-28; zero/engine/optimizer.py says why it no longer does).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import harness

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Process start to first step (bench/startup.py)"
MODEL = dict(vocab=4096, d_model=256, heads=4, layers=4, seq=128, tie=False)
VARIANTS = {"plain": "plain torch", "ours": "ours", "wrapped": "ours, torch's add_param_group"}
PHASES = ("import_s", "build_s", "init_s", "step_s")


def child(variant: str, nvme_path: str) -> dict:
    t0 = time.perf_counter()
    import torch

    import zero
    from zero.examples import GPT, GPTConfig, make_batches

    t1 = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    x, y = make_batches(GPTConfig(**MODEL), 1, 1)[0]
    t2 = time.perf_counter()
    if variant == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t3 = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
    else:
        if variant == "wrapped":
            from zero.engine.optimizer import ZeroOptimizer

            del ZeroOptimizer.add_param_group  # torch's own, through its dynamo-disabling wrapper
        conf = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme_path},
                                      "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}}
        engine, _, _, _ = zero.initialize(model=model, config=conf)
        t3 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
    t4 = time.perf_counter()
    return {"variant": variant, "import_s": t1 - t0, "build_s": t2 - t1, "init_s": t3 - t2, "step_s": t4 - t3,
            "total_s": t4 - t0, "dynamo_imported": "torch._dynamo" in sys.modules}


def run_one(variant: str, root: str) -> dict:
    nvme_path = tempfile.mkdtemp(prefix=f"{variant}-", dir=root)
    try:
        return harness.run_child("bench.startup", ["--child", variant, "--nvme_path", nvme_path], timeout=300)
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)


def summarize(results: dict) -> dict:
    summary = {}
    for variant, runs in results.items():
        ok = [r for r in runs if "total_s" in r]
        if not ok:
            summary[variant] = {"error": runs[-1].get("error", "no run finished")}
            continue
        summary[variant] = {k: statistics.median(r[k] for r in ok) for k in (*PHASES, "total_s")}
        summary[variant]["dynamo_imported"] = all(r["dynamo_imported"] for r in ok)
        summary[variant]["runs"] = len(ok)
    return summary


def table(summary: dict) -> list:
    lines = ["| variant | import s | build model s | optimizer / engine s | first step s | total s | "
             "imports torch._dynamo | runs |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for variant, name in VARIANTS.items():
        s = summary[variant]
        if "total_s" not in s:
            lines.append(f"| {name} | failed: {s['error']} | | | | | | |")
            continue
        lines.append(f"| {name} | " + " | ".join(f"{s[k]:.2f}" for k in (*PHASES, "total_s")) +
                     f" | {'yes' if s['dynamo_imported'] else 'no'} | {s['runs']} |")
    return lines


def chart(record: dict, png: str) -> bool:
    plt = harness.pyplot()
    if plt is None:
        return False
    summary = record["summary"]
    names = [v for v in VARIANTS if "total_s" in summary[v]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    left = [0.0] * len(names)
    for phase, color in zip(PHASES, ("#999", "#6a6", "#c66", "#66c")):
        widths = [summary[v][phase] for v in names]
        ax.barh([VARIANTS[v] for v in names], widths, left=left, color=color, label=phase[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds from process start (median)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def figures(summary: dict, when: str) -> list:
    ours, wrapped, plain = summary["ours"], summary["wrapped"], summary["plain"]
    if not all("total_s" in s for s in (ours, wrapped, plain)):
        return []
    return [harness.Figure("engine built, start of the process to its first step done: ours / through torch's "
                           "wrapper", f"**{ours['total_s'] / wrapped['total_s']:.2f}** "
                           f"({ours['total_s']:.2f} s / {wrapped['total_s']:.2f} s)", when=when),
            harness.Figure("the same, ours / plain torch in memory (AdamW)",
                           f"**{ours['total_s'] / plain['total_s']:.2f}** "
                           f"({ours['total_s']:.2f} s / {plain['total_s']:.2f} s)", when=when)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--nvme_path", default=None)
    parser.add_argument("--results-md", default=None)
    parser.add_argument("--child", default=None, choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.print_result(child(args.child, args.nvme_path))
        return 0
    meta = harness.provenance()
    root = args.nvme_path or tempfile.mkdtemp(prefix="startup-")
    results = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            for variant in VARIANTS:
                res = run_one(variant, root)
                results[variant].append(res)
                print(f"round {r + 1}: {VARIANTS[variant]}: {res.get('total_s', res.get('error'))}", flush=True)
    finally:
        if not args.nvme_path:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(results)
    lines = table(summary)
    print("\n".join(lines))
    meta["load_end"] = harness.load_average()
    record = {"meta": {**meta, "command": f"python -m bench.startup --rounds {args.rounds}"},
              "model": MODEL, "rounds": results, "summary": summary}
    harness.save_json(record, os.path.join(HERE, "out", "startup.json"), indent=1)

    def markdown(record, png):
        return "\n".join([
            f"Latest run: {meta['started']}, commit {meta['commit']}; load average {meta['load_start']} at start, "
            f"{meta['load_end']} at end (2 CPUs shared with other work).",
            "",
            f"GPT ({MODEL['layers']} layers, d_model {MODEL['d_model']}, vocab {MODEL['vocab']}), batch 1, fp32; "
            "the engine with parameters and optimizer on NVMe. Each run a fresh process; the variants "
            f"round-robin, {args.rounds} rounds, the median of each phase.",
            "",
            *lines,
            "",
            "torch's `Optimizer.add_param_group` is wrapped in `torch._disable_dynamo`, whose first call "
            "imports `torch._dynamo`; plain torch's AdamW pays that too. The engine adds its groups "
            "through the unwrapped method (zero/engine/optimizer.py).",
            *([] if png is None else ["", f"![startup]({os.path.basename(png)})"]),
        ])

    harness.publish(record, args.results_md, SECTION, os.path.join(HERE, "startup.png") if args.results_md else None,
                    chart, lambda rec: figures(rec["summary"], meta["when"]), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
