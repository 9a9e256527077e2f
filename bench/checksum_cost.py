"""What swap-file checksums cost: digest speeds, and the training step with each algorithm.

    flock /tmp/bench.lock python -m bench.checksum_cost --results-md bench/RESULTS.md
    python -m bench.checksum_cost --rounds 1 --steps 4          # a quick look

Part 1: each algorithm of swapper.checksum digests a 256 MiB tensor (median of
5). Part 2: one ZeRO-3 training step of a small GPT (4 layers, d_model 256,
vocab 4096; bench/train_step.py's config otherwise) with parameters *and* optimizer states on NVMe (``max_in_cpu`` 0, so every
parameter is swapped in each forward and backward: the most checksummed bytes
per step), ``offload_param.checksum`` and ``offload_optimizer.checksum`` set to
none / crc32 / crc32c / xxhash; each in a fresh process, 2 warm-up steps, the
median of ``--steps`` (wall clock, and the process's CPU time, all threads: the
digests add CPU work, and CPU time is far less disturbed than wall time by
other work on a shared machine), round-robin ``--rounds`` times, median over
rounds. The
result decides the default of the ``checksum`` key ([Note: checksum default]
in zero/config/offload.py).
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
from bench.train_step import BATCH, ds_config

HERE = os.path.dirname(os.path.abspath(__file__))

MODEL = dict(vocab=4096, d_model=256, heads=4, layers=4, seq=128, tie=False)  # ~4M parameters

ALGORITHMS = ["none", "crc32", "crc32c", "xxhash"]
SECTION = "## Swap-file checksums (bench/checksum_cost.py)"


def digest_speeds(nbytes: int = 256 << 20) -> dict:
    import torch

    from swapper.checksum import ChecksumTable

    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    speeds = {}
    for name in ALGORITHMS[1:]:
        table = ChecksumTable(name)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            table.digest(data)
            times.append(time.perf_counter() - t0)
        speeds[name] = nbytes / statistics.median(times) / 1e9
    return speeds


def run_child(checksum: str, steps: int, warmup: int, nvme_path: str) -> dict:
    import torch

    import zero
    from zero.examples import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    config = ds_config("nvme", nvme_path)
    zc = config["zero_optimization"]
    zc["offload_param"].update(max_in_cpu=0, min_swap_bytes=0, checksum=checksum)
    zc["offload_optimizer"].update(checksum=checksum)
    from swapper.checksum import ChecksumTable

    hashed = {"seconds": 0.0, "bytes": 0}
    digest = ChecksumTable.digest

    def timed_digest(self, data):  # the checksum work itself, timed where it happens
        t0 = time.perf_counter()
        try:
            return digest(self, data)
        finally:
            hashed["seconds"] += time.perf_counter() - t0
            hashed["bytes"] += data.numel() * data.element_size()

    ChecksumTable.digest = timed_digest
    engine, _, _, _ = zero.initialize(model=model, config=config)
    times, cpu, digest_s, digest_b = [], [], [], []
    for _ in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        h0, b0 = hashed["seconds"], hashed["bytes"]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        digest_s.append(hashed["seconds"] - h0)
        digest_b.append(hashed["bytes"] - b0)
    swapped = engine.parts.param_store.swapper.nvme_bytes + engine.parts.optimizer_store.swapper.nvme_bytes
    engine.destroy()
    return {"checksum": checksum, "median_ms": 1000 * statistics.median(times[warmup:]),
            "cpu_ms": 1000 * statistics.median(cpu[warmup:]),
            "min_ms": 1000 * min(times[warmup:]),
            "digest_ms": 1000 * statistics.median(digest_s[warmup:]),
            "digest_mb": statistics.median(digest_b[warmup:]) / 1e6,
            "times_ms": [round(1000 * t, 1) for t in times[warmup:]], "nvme_bytes": swapped}


def run_one(checksum: str, args, root: str) -> dict:
    nvme_path = tempfile.mkdtemp(prefix=f"{checksum}-", dir=root)
    try:
        result = harness.run_child("bench.checksum_cost", ["--child", checksum, "--steps", args.steps, "--warmup",
                                                           args.warmup, "--nvme_path", nvme_path], timeout=900)
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)
    return {"checksum": checksum, **result}


def chart(summary: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ALGORITHMS if "median_ms" in summary.get(n, {})]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, [summary[n]["digest_ms"] for n in names], color=["#888", "#c66", "#6a6", "#66c"][:len(names)])
    ax.set_ylabel("checksum work per step (ms)")
    ax.set_title(f"hashing per step; fastest unchecked step {summary['none'].get('min_ms', 0):.0f} ms")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nvme_path", default=None)
    parser.add_argument("--results-md", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.print_result(run_child(args.child, args.steps, args.warmup, args.nvme_path))
        return 0

    meta = harness.provenance()
    speeds = digest_speeds()
    print("digest GB/s:", {k: round(v, 1) for k, v in speeds.items()}, flush=True)
    root = args.nvme_path or tempfile.mkdtemp(prefix="checksum_cost-")
    results = {n: [] for n in ALGORITHMS}
    for r in range(args.rounds):
        for name in ALGORITHMS:
            res = run_one(name, args, root)
            results[name].append(res)
            print(f"round {r + 1}: {name}: {res.get('median_ms', 'failed')}", flush=True)
    if not args.nvme_path:
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for name, rs in results.items():
        ok = [x for x in rs if "median_ms" in x]
        summary[name] = ({"median_ms": statistics.median(x["median_ms"] for x in ok),
                          "cpu_ms": statistics.median(x["cpu_ms"] for x in ok),
                          "min_ms": min(x["min_ms"] for x in ok),
                          "digest_ms": statistics.median(x["digest_ms"] for x in ok),
                          "digest_mb": statistics.median(x["digest_mb"] for x in ok),
                          "round_medians_ms": [round(x["median_ms"], 1) for x in ok],
                          "nvme_bytes": ok[0]["nvme_bytes"]} if ok else {"error": rs[-1].get("error", "")})
    fastest = summary["none"].get("min_ms")
    lines = ["| checksum | digest GB/s (256 MiB) | hashed per step MB | hashing per step ms | / fastest "
             "unchecked step | fastest step ms | median step ms (wall) | step CPU ms | round medians ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in ALGORITHMS:
        s = summary[name]
        if "median_ms" not in s:
            lines.append(f"| {name} | | failed | | | | | | |")
            continue
        speed = f"{speeds[name]:.1f}" if name in speeds else "—"
        share = f"{100 * s['digest_ms'] / fastest:.1f}%" if fastest else "—"
        lines.append(f"| {name} | {speed} | {s['digest_mb']:.0f} | {s['digest_ms']:.1f} | {share} | "
                     f"{s['min_ms']:.0f} | {s['median_ms']:.0f} | {s['cpu_ms']:.0f} | "
                     f"{', '.join(map(str, s['round_medians_ms']))} |")
    print("\n".join(lines))
    meta["load_end"] = harness.load_average()
    harness.save_json({**meta, "speeds_gbps": speeds, "rounds": results, "summary": summary},
                      os.path.join(HERE, "out", "checksum_cost.json"), indent=1)
    if args.results_md:
        chart(summary, os.path.join(HERE, "checksum_cost.png"))
        nbytes = summary["none"].get("nvme_bytes", 0)
        details = "\n".join([
            f"Latest run: {meta['started']}, commit {meta['commit']}; load average {meta['load_start']} at start, "
            f"{meta['load_end']} at end (2 CPUs shared with other work).",
            "",
            f"GPT ({MODEL['layers']} layers, d_model {MODEL['d_model']}, vocab {MODEL['vocab']}), batch {BATCH}, "
            f"fp32, parameters and optimizer states on NVMe (max_in_cpu 0: {nbytes / 2**20:.0f} MiB of swap "
            "files, every parameter read in each forward and backward), one process per run.",
            "",
            *lines,
            "",
            "'hashing per step' is the time inside the digest calls (timed where they run), so the "
            "machine's load inflates it far less than the step times, which swing by 10x here between "
            "rounds; '/ fastest unchecked step' sets it against the fastest step without checksums.",
            "",
            "![checksum cost](checksum_cost.png)",
        ])
        harness.write_section(args.results_md, SECTION, figures(summary, speeds, meta["when"]),
                              f"python -m bench.checksum_cost --rounds {args.rounds} --steps {args.steps}", details)
    return 0


def figures(summary: dict, speeds: dict, when: str) -> list:
    """The headline: each algorithm's hashing per step against the fastest step without checksums
    (no goal: the figures decide the ``checksum`` key's default)."""
    fastest = summary["none"].get("min_ms")
    out = []
    for name in ALGORITHMS[1:]:
        s = summary[name]
        if "digest_ms" in s and fastest:
            out.append(harness.Figure(f"{name}{' (the default)' if name == 'xxhash' else ''}: hashing per step / "
                                      f"fastest unchecked step ({speeds.get(name, 0):.1f} GB/s digest)",
                                      f"**{100 * s['digest_ms'] / fastest:.1f}%**", when=when))
    return out


if __name__ == "__main__":
    sys.exit(main())
