"""Training beyond memory at speed: step time beside plain torch, and peak memory at 2x RAM.

    flock /tmp/bench.lock python -m bench.scale speed           # 311M: torch, zero cpu/nvme variants, DeepSpeed
    flock /tmp/bench.lock python -m bench.scale scale           # 1.63B and ~3B under zero.Init(nvme), 1 + 3 steps
    flock /tmp/bench.lock python -m bench.scale speed scale --results-md bench/RESULTS.md \\
        --json bench/out/scale.json --png bench/scale.png

Speed: GPT from zero.examples (vocab 8192, 24 layers, d_model 1024, 16 heads,
tied head: 311M parameters), seq 128, batch 2, fp32 AdamW. ``torch``: plain
PyTorch, everything in memory, ``AdamW(fused=True)``. ``zero-cpu``:
parameters and optimizer in host memory. ``zero-nvme``: both on NVMe,
``max_in_cpu`` 0, ``sub_group_size`` and ``buffer_size`` 2e7, aio block 8 MiB,
queue depth 32, 4 threads, pipelined optimizer reads and writes, prefetch on;
sub-groups stepped during backward as their gradients complete (the default);
``zero-nvme-afterbackward`` (``step_in_backward`` false: gradients written to
NVMe during backward, read back by the step after it), ``zero-nvme-nochecksum``
(swap-file checksums off), ``zero-nvme-noprefetch`` (``stage3_prefetch_bucket_size`` 0 and
``stage3_max_reuse_distance`` 0) and ``zero-nvme-nopipeline`` (pipeline_read
and pipeline_write off) beside it. ``ds-*``: DeepSpeed 0.19.8 (``--ds-python``)
with the same config; each failure is recorded with its last line. Every
contender runs in its own process (its VmHWM is its peak RSS), one after the
other: ``--warmup`` steps, then the median of ``--steps``.

Scale: the same GPT at 32 layers x d_model 2048 (1.63B) and 32 x 2816 (~3.1B,
model states about 2x this machine's RAM), built under
``zero.Init(remote_device="nvme")`` and trained with parameters and optimizer on
NVMe: one step that records the trace, then the median of ``--scale-steps``. Peak RSS is printed beside the model-state bytes (16 per
parameter: fp32 weights, gradients, exp_avg, exp_avg_sq) and the estimator's
NVMe row. The in-memory estimate of a scale model's step: plain torch (in memory, fused AdamW) at the
same width with 4 and 8 layers (``layers-<model>-<n>``), a line through the two step times
read at 32 layers (read there, an error in either time is multiplied by up to 16 with 2 and
4 layers, by 7 with 4 and 8: the 3.1B estimate moved from 36.8 to 33.0 s between two runs).
Free disk space is checked first; swap files are deleted after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import harness, training

SECTION = "## Training beyond memory (bench/scale.py)"
SPEED_MODEL = dict(vocab=8192, d_model=1024, heads=16, layers=24, seq=128, tie=True)
SCALE_MODELS = {"1.63B": dict(vocab=8192, d_model=2048, heads=16, layers=32, seq=128, tie=True),
                "3.1B": dict(vocab=8192, d_model=2816, heads=22, layers=32, seq=128, tie=True)}
BATCH = 2
LR = 1e-4
AIO = {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
       "overlap_events": True}
SPEED = ["torch", "zero-cpu", "zero-nvme", "zero-nvme-afterbackward", "zero-nvme-noprefetch", "zero-nvme-nopipeline",
         "zero-nvme-nochecksum", "ds-cpu",
         "ds-nvme", "ds-nvme-optimizer"]
GiB = 1 << 30


def config(kind: str, nvme_path: str, live: int = 10 ** 9) -> dict:
    """The DeepSpeed config dict of one contender (both engines read the same)."""
    if kind.endswith("cpu"):
        zc = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    else:
        zc = {"stage": 3, "sub_group_size": int(2e7), "stage3_max_live_parameters": live,
              "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_size": int(2e7),
                                "max_in_cpu": 0},
              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                                    "pipeline_write": True}}
        if kind.endswith("noprefetch"):
            zc.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
        if kind.endswith("afterbackward"):  # the optimizer steps after backward, reading gradients back
            zc["offload_optimizer"]["step_in_backward"] = False
        if kind.endswith("nochecksum"):
            zc["offload_param"]["checksum"] = zc["offload_optimizer"]["checksum"] = "none"
        if kind.endswith("nopipeline"):
            zc["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
        if kind.startswith("ds-"):
            zc["offload_optimizer"]["buffer_count"] = 16  # DeepSpeed's pipelining needs more than 4
        if kind == "ds-nvme-optimizer":  # parameters in host memory, optimizer on NVMe
            zc["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": zc, "aio": AIO, "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}


def run_child(name: str, steps: int, warmup: int, nvme_path: str) -> dict:
    """Measure one contender in this process."""
    import torch

    ex = training.examples(deepspeed=name.startswith("ds-"))
    GPT, GPTConfig = ex.GPT, ex.GPTConfig
    scale = name.startswith("scale-")
    if name.startswith("layers-"):  # plain torch, a scale model's width with fewer layers (in memory)
        model_name, layers = name[7:].rsplit("-", 1)
        cfg = GPTConfig(**dict(SCALE_MODELS[model_name], layers=int(layers)))
        name = "torch"
    else:
        cfg = GPTConfig(**(SCALE_MODELS[name[6:]] if scale else SPEED_MODEL))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    t0 = time.perf_counter()
    if name == "torch":
        from zero.stores import malloc_settings

        malloc_settings.hold()  # plain torch at its best: the engine's glibc malloc settings too
        model = GPT(cfg)
        step = training.torch_step(model, x, y, LR)
    elif name.startswith("ds-"):
        training.join_as_single_rank()
        import deepspeed

        conf = config(name, nvme_path)
        with deepspeed.zero.Init(config_dict_or_path=conf):
            model = GPT(cfg)
        engine, _, _, _ = deepspeed.initialize(model=model, config=conf)
    else:
        import zero

        numel_guess = 12 * cfg.layers * cfg.d_model ** 2
        conf = config("zero-nvme" if scale else name, nvme_path,
                      live=max(int(2e7), numel_guess // 40) if scale else 10 ** 9)
        if scale:  # each partition fits one buffer: the largest layer (fc) at d 2816 is 31.7M elements
            largest = max(4 * cfg.d_model ** 2 + 4 * cfg.d_model, cfg.vocab * cfg.d_model)
            conf["zero_optimization"]["offload_param"]["buffer_size"] = max(int(2e7), largest)
        with zero.Init(config_dict_or_path=conf):
            model = GPT(cfg)
        built_rss = harness.status_bytes("VmRSS")
        engine, _, _, _ = zero.initialize(model=model, config=conf)
    if not name == "torch":
        step = training.engine_step(engine, x, y)
    init_s = time.perf_counter() - t0
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    times, losses = training.timed_steps(step, warmup, steps)
    out = {"contender": name, "layers": cfg.layers, "params": params, "init_s": round(init_s, 1),
           "median_s": statistics.median(times[warmup:]), "times_s": [round(t, 2) for t in times],
           "peak_rss_bytes": harness.status_bytes("VmHWM"), "losses": losses}
    if scale:
        from zero.stores.estimator import estimate_zero3

        total, largest = params, max(sum(int(getattr(p, "ds_numel", p.numel())) for p in m.parameters(False))
                                     for m in model.modules())
        est = estimate_zero3(total, largest, "nvme", "nvme", bytes_per_param=4, sub_group_size=int(2e7),
                             optimizer_pipeline_slots=3, additional_buffer_factor=1.0)
        # No GPU here: the estimator's per-GPU bytes (the gathered largest layer) are host memory too.
        out.update(built_rss_bytes=built_rss, estimate_cpu_bytes=est.cpu_bytes + est.gpu_bytes,
                   estimate_nvme_bytes=est.nvme_bytes,
                   max_live_parameters=conf["zero_optimization"]["stage3_max_live_parameters"])
    return out


def run_contender(name: str, args, nvme_root: str) -> dict:
    python = args.ds_python if name.startswith("ds-") else None
    nvme_path = tempfile.mkdtemp(prefix=f"{name}-", dir=nvme_root)
    steps, warmup = (args.scale_steps, 1) if name.startswith("scale-") else (args.steps, args.warmup)
    try:
        result = harness.run_child("bench.scale", ["--child", name, "--steps", steps, "--warmup", warmup,
                                                   "--nvme_path", nvme_path], python, args.timeout)
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)
    return {"contender": name, **result}


def disk_needed(names) -> int:
    """Swap bytes of the largest contender. Ours: master and two Adam states (the fp32 weights are
    read from the master), plus zero.Init's slices while initialize takes them over, or the
    gradients when the step runs after backward: 16 bytes per parameter. DeepSpeed: its fp32
    weights, master, two Adam states and gradients, 20."""
    from zero.examples import GPT, GPTConfig  # noqa: F401 - sizes by formula, nothing built

    def params(m):
        d, layers = m["d_model"], m["layers"]
        return layers * (12 * d * d + 13 * d) + m["vocab"] * d + m["seq"] * d + 2 * d

    sizes = [(params(SCALE_MODELS[n[6:]]) if n.startswith("scale-") else params(SPEED_MODEL))
             * (20 if n.startswith("ds-") else 16) for n in names]
    return int(max(sizes, default=0) * 1.05)


def combine_rounds(runs: list) -> dict:
    """One contender's result over interleaved rounds: the round with the median of the round
    medians, with every round's median (and the failure of a round, if any) kept beside it."""
    ok = [r for r in runs if "median_s" in r]
    if len(runs) == 1 or not ok:
        return runs[0]
    ok.sort(key=lambda r: r["median_s"])
    out = dict(ok[(len(ok) - 1) // 2])
    out["round_medians_s"] = [r.get("median_s") for r in runs]
    return out


def paired_ratio(results: dict, name: str):
    """Median over rounds of the contender's round median over torch's in the same round."""
    a, b = results.get(name, {}).get("round_medians_s"), results.get("torch", {}).get("round_medians_s")
    if not a or not b or len(a) != len(b):
        return None
    ratios = sorted(x / y for x, y in zip(a, b) if x and y)
    return statistics.median(ratios) if ratios else None


ESTIMATE_LAYERS = (4, 8)  # plain torch in memory at these depths: step = fixed + per-layer x layers


def in_memory_estimate(results: dict, model: str):
    """The scale model's step in memory, from plain torch at the same width with fewer layers
    (``layers-<model>-<n>``): a line through the two depths, read at the model's layer count."""
    runs = [results.get(f"layers-{model}-{n}", {}) for n in ESTIMATE_LAYERS]
    if not all("median_s" in r for r in runs):
        return None
    (l1, t1), (l2, t2) = ((r["layers"], r["median_s"]) for r in runs)
    return t1 + (SCALE_MODELS[model]["layers"] - l1) * (t2 - t1) / (l2 - l1)


def table(results: dict) -> list:
    base = results.get("torch", {}).get("median_s")
    lines = ["| contender | params | median step s | / plain torch | peak RSS GiB | steps s |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if name.startswith("scale-") or name.startswith("layers-"):
            continue
        if "error" in r:
            lines.append(f"| {name} | | failed: {r['error'][:90]} | | | |")
            continue
        own = results.get(r.get("baseline"), {}).get("median_s", base)  # merged runs: their own torch
        ratio = f"{r['median_s'] / own:.2f}" if own else "-"
        steps = ", ".join(map(str, r["times_s"]))
        if "round_medians_s" in r:
            paired = paired_ratio(results, name)
            ratio += f" (paired {paired:.2f})" if paired and name != "torch" else ""
            steps = "round medians " + ", ".join(f"{x:.2f}" if x else "failed" for x in r["round_medians_s"])
        lines.append(f"| {name} | {r['params'] / 1e6:.0f}M | {r['median_s']:.2f} | {ratio} | "
                     f"{r['peak_rss_bytes'] / GiB:.2f} | {steps} |")
    scale = {n: r for n, r in results.items() if n.startswith("scale-")}
    if scale:
        lines += ["", "| model | params | model states GiB | peak RSS GiB | peak / states | RSS after build GiB | "
                      "estimator (nvme/nvme) host GiB | NVMe GiB | steps s | in-memory estimate s | "
                      "median / estimate |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for name, r in scale.items():
            if "error" in r:
                lines.append(f"| {name[6:]} | failed: {r['error'][:90]} | | | | | | | | | |")
                continue
            states = 16 * r["params"]
            est = in_memory_estimate(results, name[6:])
            vs = (f"{est:.1f} | {r['median_s'] / est:.2f}" if est else "- | -")
            lines.append(f"| {name[6:]} | {r['params'] / 1e9:.2f}B | {states / GiB:.1f} | "
                         f"{r['peak_rss_bytes'] / GiB:.2f} | {100 * r['peak_rss_bytes'] / states:.1f}% | "
                         f"{r['built_rss_bytes'] / GiB:.2f} | {r['estimate_cpu_bytes'] / GiB:.2f} | "
                         f"{r['estimate_nvme_bytes'] / GiB:.1f} | {', '.join(map(str, r['times_s']))} | {vs} |")
        for name, r in results.items():
            if name.startswith("layers-"):
                shown = f"{r['median_s']:.2f} s" if "median_s" in r else f"failed: {r['error'][:90]}"
                lines.append(f"- in memory, plain torch, {name[7:].rsplit('-', 1)[0]} width with "
                             f"{r.get('layers', name.rsplit('-', 1)[1])} layers: {shown}")
    return lines


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in results.items() if "median_s" in r and not n.startswith("scale-")}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(list(ok), [r["median_s"] for r in ok.values()], color="tab:blue")
    if "torch" in ok:
        for goal, style in ((1.25, "--"), (1.1, ":")):
            ax.axvline(goal * ok["torch"]["median_s"], color="tab:red", linestyle=style,
                       label=f"{goal}x plain torch")
        ax.legend(loc="lower right")
    ax.set_xlabel("median step (s), 311M GPT, batch 2 x 128")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def figures(results: dict, when: str) -> list:
    """The headline: step time over plain torch's (ratios paired by round where there are rounds),
    peak RSS over the model-state bytes, and the largest model's step over its in-memory estimate."""
    base = results.get("torch", {}).get("median_s")
    out = []
    for name, goal in (("zero-nvme", 1.25), ("zero-nvme-nochecksum", 1.25), ("zero-cpu", 1.1)):
        r = results.get(name, {})
        if base and "median_s" in r:
            paired = paired_ratio(results, name)
            ratio = paired or r["median_s"] / base
            how = ", paired by round" if paired else ""
            out.append(harness.Figure(f"{name} step / plain torch (311M{how})", f"**{ratio:.2f}x**", f"≤ {goal}x",
                                      ratio <= goal, when))
    for name, r in results.items():
        if name.startswith("scale-") and "median_s" in r:
            share = r["peak_rss_bytes"] / (16 * r["params"])
            goal = 0.15 if r["params"] > 2.5e9 else 0.20
            out.append(harness.Figure(f"{name[6:]}: peak RSS / model-state bytes", f"**{100 * share:.1f}%**",
                                      f"≤ {100 * goal:.0f}%", share <= goal, when))
            est = in_memory_estimate(results, name[6:])
            if est and r["params"] > 2.5e9:
                ratio = r["median_s"] / est
                out.append(harness.Figure(f"{name[6:]}: median step / its in-memory estimate ({r['median_s']:.1f} / "
                                          f"{est:.1f} s)", f"**{ratio:.2f}x**", "≤ 1.3x (issue 21)", ratio <= 1.3,
                                          when))
    return out


def verdicts(results: dict) -> list:
    return [f"- {f.what}: {f.today.strip('*')} ({'meets' if f.met else 'misses'} the goal {f.goal})"
            for f in figures(results, "")]


def details(results: dict, meta: dict, png: str | None, notes=()) -> str:
    rows = table(results) + [f"- {n}" for n in notes]
    body = [f"Latest run: {meta['started']}, commit {meta.get('commit', '?')}; load average "
            f"{meta['load_start']} at start, {meta['load_end']} at end (2 CPUs: absolute times vary by 10% and more "
            f"from run to run, so the figures to read are ratios within one run or round); {meta['elapsed_s']:.0f} s "
            "in all.", "", __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "", *rows, ""]
    if png:
        body += [f"![step times]({os.path.basename(png)})", ""]
    return "\n".join(body)


def write_section(results_md: str, results: dict, meta: dict, png: str | None, notes=()) -> None:
    harness.write_section(results_md, SECTION, figures(results, meta.get("when", meta["started"])), meta["command"],
                          details(results, meta, png, notes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help="speed, scale or both (default: speed)")
    parser.add_argument("--contenders", nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--scale-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the contenders this many times, interleaved; each one's figure is the "
                             "median of its round medians, and ratios are paired within each round")
    parser.add_argument("--nvme_path", default=None, help="directory for swap files (default: a temp dir)")
    parser.add_argument("--ds-python", default="/opt/dsvenv/bin/python")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json", default=None)
    parser.add_argument("--results-md", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--note", action="append", default=[], help="a line for RESULTS.md (repeatable)")
    parser.add_argument("--from-json", nargs="+", default=None,
                        help="only write --results-md / --png from saved --json files (merged)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.from_json:
        results, metas = {}, []
        for path in args.from_json:
            with open(path) as f:
                saved = json.load(f)
            results.update(saved["results"])
            metas.append(saved["meta"])
        meta = {"started": " and ".join(m["started"] for m in metas),
                "when": " and ".join(m.get("when", m["started"]) for m in metas),
                "commit": " / ".join(m.get("commit", "?") for m in metas),
                "command": " ; ".join(m["command"] for m in metas),
                "load_start": " / ".join(m["load_start"] for m in metas),
                "load_end": " / ".join(m["load_end"] for m in metas),
                "elapsed_s": sum(m["elapsed_s"] for m in metas)}
        if args.png:
            chart(results, args.png)
        if args.results_md:
            write_section(args.results_md, results, meta, args.png, args.note)
        print("\n".join(table(results)))
        return 0

    if args.child:
        harness.print_result(run_child(args.child, args.steps, args.warmup, args.nvme_path))
        return 0

    args.parts = args.parts or ["speed"]
    unknown = set(args.parts) - {"speed", "scale"}
    if unknown:
        parser.error(f"unknown part {sorted(unknown)}: choose speed and/or scale")
    names = args.contenders or ((SPEED if "speed" in args.parts else [])
                                + ([f"scale-{m}" for m in SCALE_MODELS] if "scale" in args.parts else [])
                                + ([f"layers-{m}-{n}" for m in SCALE_MODELS for n in ESTIMATE_LAYERS]
                                   if "scale" in args.parts else []))
    names = [n for n in names if not n.startswith("ds-") or os.path.exists(args.ds_python)]
    nvme_root = args.nvme_path or tempfile.mkdtemp(prefix="scale-", dir="/tmp")
    need, free = disk_needed(names), shutil.disk_usage(nvme_root).free
    print(f"swap space needed (largest contender; each is checked before it runs): {need / GiB:.1f} GiB; "
          f"free under {nvme_root}: {free / GiB:.1f} GiB", flush=True)
    meta = dict(harness.provenance(nvme_root),
                command="python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:]))
    rounds = {name: [] for name in names}
    try:
        for k in range(args.rounds):
            for name in names:
                need, free = disk_needed([name]), shutil.disk_usage(nvme_root).free
                if need > free:
                    r = {"contender": name, "error": (
                        f"needs {need / GiB:.1f} GiB of swap space, {free / GiB:.1f} GiB free: not run")}
                else:
                    r = run_contender(name, args, nvme_root)
                rounds[name].append(r)
                shown = (f"median {r['median_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB"
                         if "median_s" in r else f"failed: {r['error']}")
                print(f"{name} (round {k + 1}): {shown}", flush=True)
    finally:
        if not args.nvme_path:
            shutil.rmtree(nvme_root, ignore_errors=True)
    meta.update(load_end=harness.load_average(), elapsed_s=time.time() - meta["t0"])
    results = {name: combine_rounds(rs) for name, rs in rounds.items() if rs}
    print("\n".join(table(results) + [""] + verdicts(results)))
    harness.save_json({"meta": meta, "results": results}, args.json, indent=1)
    if args.png:
        chart(results, args.png)
    if args.results_md:
        write_section(args.results_md, results, meta, args.png, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
