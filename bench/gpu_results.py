"""The GPU section's chart: each stored run of bench/gpu_check.py (bench/gpu_runs/*.json), the
I/O-bound iteration against the disk's time for its bytes and aio_handle's CUDA / host ratios.

    python -m bench.gpu_results            # -> bench/gpu_check.png
"""
from __future__ import annotations

import glob
import json
import os
import sys

from bench import harness

RUNS = os.path.join(harness.ROOT, "bench", "gpu_runs")


def load_runs(folder: str = RUNS) -> list:
    """(name, record) of every stored run, oldest first."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            out.append((os.path.splitext(os.path.basename(path))[0], json.load(f)))
    return out


def iteration_ratios(record: dict) -> dict:
    """'dtype k=K' -> ours / the disk's time for the same bytes."""
    runs = record["stages"].get("train", {}).get("runs", [])
    return {f"{r['dtype']} k={r['k']}": r["median_s"] / r["disk"]["seconds"] for r in runs if "median_s" in r}


def chart(runs: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({k for _, r in runs for k in iteration_ratios(r)}, key=lambda s: (s.split()[0], int(s.split("=")[1])))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(runs))
    for i, (name, record) in enumerate(runs):
        ratios = iteration_ratios(record)
        xs = [j + i * width for j, label in enumerate(labels) if label in ratios]
        ax.bar(xs, [ratios[label] for label in labels if label in ratios], width, label=name)
    ax.axhline(1.15, color="k", linestyle="--", linewidth=1, label="goal (k = 1): 1.15")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("iteration / disk's time for its bytes")
    ax.set_title("311M GPT, params + optimizer on NVMe, on an H200 (bench/gpu_check.py)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    runs = load_runs()
    if not runs:
        print(f"no runs in {RUNS}", file=sys.stderr)
        return 1
    out = os.path.join(harness.ROOT, "bench", "gpu_check.png")
    chart(runs, out)
    for name, record in runs:
        print(name, {k: round(v, 2) for k, v in iteration_ratios(record).items()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
