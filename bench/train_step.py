"""One training step of a 27M-parameter GPT: plain PyTorch, nvmeio's ZeRO-3, DeepSpeed's ZeRO-3.

    python -m bench.train_step                       # every contender, 3 rounds, table on stdout
    python -m bench.train_step --results-md bench/RESULTS.md --json bench/out/train_step.json
    python -m bench.train_step --contenders torch zero-none --rounds 1

Model: zero.examples.GPT with 6 layers, d_model 512, 8 heads, vocab 8192 (head
not tied), seq 128, batch 4, fp32, AdamW (lr 1e-4, weight decay 0.01).
Contenders: ``torch`` (torch.optim.AdamW(fused=True)), ``zero-none``,
``zero-cpu``, ``zero-nvme`` (this repository: parameters and optimizer states
both on that device) and ``ds-none``, ``ds-cpu``, ``ds-nvme`` (DeepSpeed ZeRO-3
with the same config dict, run by ``--ds-python`` when it exists).

Each contender runs in a fresh process, so its peak RSS (VmHWM) is its own:
2 warm-up steps, then the median of ``--steps`` step times (wall clock, from
the forward to the end of the optimizer step). Contenders are run
round-robin ``--rounds`` times and the median over rounds is reported, since
the 2-CPU machine is shared. Both engines get the same config dict, which
keeps DeepSpeed's defaults (sub_group_size 1e9, persistence threshold 1e5;
for NVMe ``max_in_cpu`` 1e9, so this model's parameters stay in host memory,
and no read/write pipelining, which DeepSpeed 0.19.8 only runs with
``buffer_count`` raised to 16 here) plus a tuned ``aio`` block. Environment
overrides for experiments: ``TRAIN_STEP_SUB_GROUP_SIZE`` (e.g. 1e7) and
``TRAIN_STEP_NVME_OPTIMIZER`` (JSON merged into ``offload_optimizer``, e.g.
``{"pipeline_read": true, "pipeline_write": true, "buffer_count": 16}``).
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

CONTENDERS = ["torch", "zero-none", "zero-cpu", "zero-nvme", "ds-none", "ds-cpu", "ds-nvme"]
SECTION = "## Training step (bench/train_step.py)"
MODEL = dict(vocab=8192, d_model=512, heads=8, layers=6, seq=128, tie=False)
BATCH = 4
LR = 1e-4
AIO = {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
       "overlap_events": True}


NVME_OPTIMIZER = json.loads(os.environ.get("TRAIN_STEP_NVME_OPTIMIZER", "{}"))
SUB_GROUP_SIZE = int(float(os.environ.get("TRAIN_STEP_SUB_GROUP_SIZE", "1e9")))


def ds_config(device: str, nvme_path: str) -> dict:
    """The DeepSpeed config both engines get for one offload device."""
    zero = {"stage": 3, "sub_group_size": SUB_GROUP_SIZE, "stage3_param_persistence_threshold": 100_000,
            "offload_param": {"device": device}, "offload_optimizer": {"device": device}}
    if device == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path)
        zero["offload_optimizer"].update(nvme_path=nvme_path, **NVME_OPTIMIZER)
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": AIO,
        "steps_per_print": 10 ** 6,
        "wall_clock_breakdown": False,
    }


def run_child(contender: str, steps: int, warmup: int, nvme_path: str) -> dict:
    """Measure one contender in this process; returns the result dict."""
    import torch

    kind, _, device = contender.partition("-")
    ex = training.examples(deepspeed=kind == "ds")
    torch.manual_seed(0)
    cfg = ex.GPTConfig(**MODEL)
    model = ex.GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    if kind == "torch":
        step = training.torch_step(model, x, y, LR)
    else:
        config = ds_config(device, nvme_path)
        if kind == "zero":
            import zero as runtime
        else:
            training.join_as_single_rank()
            import deepspeed as runtime
        engine, _, _, _ = runtime.initialize(model=model, config=config)
        step = training.engine_step(engine, x, y)
    times, losses = training.timed_steps(step, warmup, steps)
    measured = times[warmup:]
    return {"contender": contender, "params": params, "median_ms": 1000 * statistics.median(measured),
            "times_ms": [round(1000 * t, 2) for t in measured],
            "peak_rss_gib": harness.status_bytes("VmHWM") / 2 ** 30, "losses": losses}


def run_contender(contender: str, args, nvme_root: str) -> dict:
    python = args.ds_python if contender.startswith("ds-") else None
    nvme_path = tempfile.mkdtemp(prefix=f"{contender}-", dir=nvme_root)
    try:
        result = harness.run_child("bench.train_step", ["--child", contender, "--steps", args.steps, "--warmup",
                                                        args.warmup, "--nvme_path", nvme_path], python, args.timeout)
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)
    return {"contender": contender, **result}


def summarize(rounds: list) -> dict:
    by = {}
    for result in (r for batch in rounds for r in batch):
        by.setdefault(result["contender"], []).append(result)
    summary = {}
    for name, results in by.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            summary[name] = {"error": results[-1]["error"]}
            continue
        summary[name] = {
            "median_ms": statistics.median(r["median_ms"] for r in ok),
            "round_medians_ms": [round(r["median_ms"], 1) for r in ok],
            "peak_rss_gib": statistics.median(r["peak_rss_gib"] for r in ok),
            "params": ok[0]["params"],
            "first_losses": ok[0]["losses"][:3],
        }
    return summary


def table(summary: dict) -> list:
    base = summary.get("torch", {}).get("median_ms")
    lines = ["| contender | median step ms | / plain torch | / DeepSpeed same mode | peak RSS GiB | round medians ms |",
             "|---|---:|---:|---:|---:|---|"]
    for name in CONTENDERS:
        s = summary.get(name)
        if s is None:
            continue
        if "error" in s:
            lines.append(f"| {name} | failed: {s['error'].strip().splitlines()[-1][:80]} | | | | |")
            continue
        ratio = f"{s['median_ms'] / base:.2f}" if base else "—"
        ds = summary.get("ds-" + name.split("-", 1)[1]) if name.startswith("zero-") else None
        vs_ds = f"{s['median_ms'] / ds['median_ms']:.2f}" if ds and "median_ms" in ds else "—"
        lines.append(f"| {name} | {s['median_ms']:.1f} | {ratio} | {vs_ds} | {s['peak_rss_gib']:.2f} | "
                     f"{', '.join(str(x) for x in s['round_medians_ms'])} |")
    return lines


def figures(summary: dict, when: str) -> list:
    """The headline: each mode against plain torch (goal 1.15x, without offload to NVMe) and
    against DeepSpeed in the same mode (faster, in less memory)."""
    out = []
    base = summary.get("torch", {}).get("median_ms")
    for mode in ("none", "cpu", "nvme"):
        ours, theirs = summary.get(f"zero-{mode}", {}), summary.get(f"ds-{mode}", {})
        if "median_ms" not in ours:
            continue
        if base and mode in ("none", "cpu"):
            r = ours["median_ms"] / base
            out.append(harness.Figure(f"zero-{mode} step / plain torch", f"**{r:.2f}x**", "≤ 1.15x", r <= 1.15, when))
        if "median_ms" in theirs:
            r = ours["median_ms"] / theirs["median_ms"]
            out.append(harness.Figure(f"zero-{mode} step / DeepSpeed {mode}", f"**{r:.2f}x**", "< 1 (faster)", r < 1,
                                      when))
            out.append(harness.Figure(f"zero-{mode} peak RSS / DeepSpeed {mode}'s",
                                      f"{ours['peak_rss_gib']:.2f} / {theirs['peak_rss_gib']:.2f} GiB", "below",
                                      ours["peak_rss_gib"] < theirs["peak_rss_gib"], when))
    return out


def verdicts(summary: dict) -> list:
    out = []
    for f in figures(summary, ""):
        out.append(f"- {f.what}: {f.today.strip('*')} ({'meets' if f.met else 'misses'} the goal {f.goal})")
    return out


def write_markdown(path: str, summary: dict, args, meta: dict) -> None:
    params = next((s["params"] for s in summary.values() if "params" in s), 0)
    details = [
        f"Latest run: {meta['started']} on {meta.get('host', '?')}, commit {meta.get('commit', '?')}.",
        "",
        f"GPT ({params / 1e6:.1f}M parameters: 6 layers, d_model 512, 8 heads, vocab 8192, untied head), "
        f"seq 128, batch {BATCH}, fp32, AdamW; {args.warmup} warm-up steps, median of {args.steps} steps per "
        f"process, median over {args.rounds} round-robin rounds; peak RSS is the process's VmHWM. "
        "DeepSpeed 0.19.8 runs in its own venv with the same config dict: stage 3 with DeepSpeed's defaults "
        f"(sub_group_size {SUB_GROUP_SIZE:.0e}, persistence threshold 1e5; NVMe: max_in_cpu 1e9 keeps this "
        "model's parameters in host memory, the optimizer states go to disk"
        f"{', offload_optimizer ' + json.dumps(NVME_OPTIMIZER) if NVME_OPTIMIZER else ', no pipelining'}) "
        f"and aio {json.dumps(AIO)}. Machine: {os.cpu_count()} CPUs, no GPU; NVMe path on the VM's ext4 disk.",
        "",
        *table(summary),
        "",
        "- zero-nvme reads the optimizer states while the backward runs and writes them during the next "
        "forward (zero/optimizer_store.py), so its step waits for no I/O; DeepSpeed reads, steps and writes "
        "inside step()",
        f"- load average {meta['load_start']} at start, {meta['load_end']} at end (2 CPUs shared with other work); "
        f"run took {meta['elapsed_s']:.0f} s",
    ]
    when = meta.get("when", meta["started"])
    command = meta.get("command", f"python -m bench.train_step --rounds {args.rounds} --steps {args.steps}")
    harness.write_section(path, SECTION, figures(summary, when), command, "\n".join(details))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nvme_path", default=None, help="directory for swap files (default: a temp dir)")
    parser.add_argument("--ds-python", default="/opt/dsvenv/bin/python")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument("--results-md", default=None, help="replace this section of a RESULTS.md")
    parser.add_argument("--from-json", default=None, help="only rewrite --results-md from a saved --json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        args.rounds = len(saved["rounds"])
        write_markdown(args.results_md, saved["summary"], args,
                       dict(saved, elapsed_s=saved.get("elapsed_s", 0.0)))
        return 0

    if args.child:
        harness.print_result(run_child(args.child, args.steps, args.warmup, args.nvme_path))
        return 0

    contenders = [c for c in args.contenders if not c.startswith("ds-") or os.path.exists(args.ds_python)]
    nvme_root = args.nvme_path or tempfile.mkdtemp(prefix="train_step-")
    meta = dict(harness.provenance(), command="python -m bench.train_step " + " ".join(
        sys.argv[1:] if argv is None else argv))
    rounds = []
    for r in range(args.rounds):
        batch = []
        for contender in contenders:
            result = run_contender(contender, args, nvme_root)
            batch.append(result)
            shown = f"{result['median_ms']:.1f} ms, {result['peak_rss_gib']:.2f} GiB" if "median_ms" in result \
                else "failed"
            print(f"round {r + 1}: {contender}: {shown}", flush=True)
        rounds.append(batch)
    if not args.nvme_path:
        shutil.rmtree(nvme_root, ignore_errors=True)
    summary = summarize(rounds)
    print("\n".join(table(summary) + verdicts(summary)))
    meta.update(load_end=harness.load_average(), elapsed_s=time.time() - meta["t0"])
    harness.save_json({**meta, "rounds": rounds, "summary": summary}, args.json, indent=1)
    if args.results_md:
        write_markdown(args.results_md, summary, args, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
