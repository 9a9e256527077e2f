"""LoRA checkpoints with and without the frozen base (``save_checkpoint(exclude_frozen_parameters=True)``).

    flock /tmp/bench.lock python -m bench.lora_checkpoint --out bench/out/lora_checkpoint.json \
        --results-md bench/RESULTS.md
    python -m bench.lora_checkpoint --quick          # smoke test, a small model
    python -m bench.lora_checkpoint --render bench/out/lora_checkpoint.json --results-md bench/RESULTS.md

[Note: what is measured]
bench/lora.py's LoRA stand-in (the 311M GPT, rank 8 adapters, base frozen with its parameters on NVMe),
with the optimizer in host memory and on NVMe, fp32 and bf16 compute, each in a fresh process: one
step trained, then ``--repeats`` saves of a whole checkpoint and of one without the frozen units
(``exclude_frozen_parameters=True``, what ZeroTrainer saves for a peft model and the HF Trainer under
DeepSpeed), each followed by its load into the same engine (the lean one with
``load_module_strict=False``). Per kind: the checkpoint's bytes on disk (hard links to the optimizer's
swap files counted: the bytes it holds), the bytes the save wrote and the load read (``/proc/self/io``,
page cache dropped before each load where root), seconds (medians). A whole checkpoint writes each
frozen parameter's values as its sub-group's fp32 master; the lean one writes none of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import harness
from bench.checkpoint_io import tree_bytes
from bench.io_bound import MODEL, SEQ
from bench.lora import QUICK_MODEL, _engine
from tools import fio

SECTION = "## LoRA checkpoints without the frozen base (bench/lora_checkpoint.py)"
GiB = harness.GiB


def _written(a: dict, b: dict) -> int:
    return (b["write_bytes"] - b["cancelled_write_bytes"]) - (a["write_bytes"] - a["cancelled_write_bytes"])


def child(spec: dict) -> dict:
    ex, engine, model = _engine(spec)
    cfg = ex.GPTConfig(**spec["model"])
    x, y = ex.make_batches(dataclasses.replace(cfg, seq=SEQ), 1, 1)[0]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    out = {"params": params, "trainable": trainable, "cache_dropped": True}
    for kind, exclude in (("whole", False), ("lean", True)):
        saves, loads, written, read, sizes = [], [], [], [], []
        for i in range(spec["repeats"]):
            ckpt = os.path.join(spec["ckpt_dir"], f"{kind}{i}")
            io0 = harness.settled_io()
            t0 = time.perf_counter()
            engine.save_checkpoint(ckpt, tag="t", exclude_frozen_parameters=exclude)
            saves.append(time.perf_counter() - t0)
            written.append(_written(io0, harness.settled_io()))
            sizes.append(tree_bytes(ckpt))
            out["cache_dropped"] &= fio.drop_page_cache()
            io0 = harness.settled_io()
            t0 = time.perf_counter()
            engine.load_checkpoint(ckpt, tag="t", load_module_strict=not exclude)
            loads.append(time.perf_counter() - t0)
            read.append(harness.settled_io()["read_bytes"] - io0["read_bytes"])
            shutil.rmtree(ckpt)
        out[kind] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                     "written_bytes": int(statistics.median(written)), "read_bytes": int(statistics.median(read)),
                     "bytes": int(statistics.median(sizes)), "saves_s": [round(t, 3) for t in saves],
                     "loads_s": [round(t, 3) for t in loads]}
    engine.destroy()
    return out


def run(args) -> dict:
    model = QUICK_MODEL if args.quick else MODEL
    root = tempfile.mkdtemp(prefix="lora-ckpt-", dir=args.nvme_dir)
    record = {"meta": {**harness.provenance(args.nvme_dir),
                       "command": "python -m bench.lora_checkpoint " + " ".join(args.argv),
                       "quick": args.quick, "model": model, "repeats": args.repeats}, "runs": []}
    try:
        for optimizer in ("cpu", "nvme"):
            for dtype in args.dtypes:
                swap, ckpt = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root)
                spec = {"dtype": dtype, "flag": False, "model": model, "nvme_path": swap, "optimizer": optimizer,
                        "ckpt_dir": ckpt, "repeats": args.repeats}
                row = {"dtype": dtype, "optimizer": optimizer,
                       **harness.run_child("bench.lora_checkpoint", ["--child", json.dumps(spec)], None, args.timeout)}
                shutil.rmtree(swap, ignore_errors=True)
                shutil.rmtree(ckpt, ignore_errors=True)
                record["runs"].append(row)
                harness.save_json(record, args.out, indent=1)
                print(describe(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record["meta"].update(load_end=harness.load_average(), elapsed_s=round(time.time() - record["meta"]["t0"]))
    return record


def describe(row: dict) -> str:
    if "error" in row:
        return f"{row['dtype']} optimizer {row['optimizer']}: {row['error']}"
    w, lean = row["whole"], row["lean"]
    return (f"{row['dtype']} optimizer {row['optimizer']}: {w['bytes'] / GiB:.3f} -> {lean['bytes'] / GiB:.4f} GiB, "
            f"save {w['save_s']:.2f} -> {lean['save_s']:.2f} s, load {w['load_s']:.2f} -> {lean['load_s']:.2f} s")


def table(record: dict) -> list:
    rows = ["| compute | optimizer | checkpoint | on disk | written by the save | save s | read by the load | load s |",
            "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in record["runs"]:
        if "error" in r:
            rows.append(f"| {r['dtype']} | {r['optimizer']} | failed: {r['error'][:80]} | | | | | |")
            continue
        for kind, label in (("whole", "whole"), ("lean", "without the frozen base")):
            k = r[kind]
            rows.append(f"| {r['dtype']} | {r['optimizer']} | {label} | {k['bytes'] / 2**20:.1f} MiB | "
                        f"{k['written_bytes'] / 2**20:.1f} MiB | {k['save_s']:.3f} | {k['read_bytes'] / 2**20:.1f} MiB | "
                        f"{k['load_s']:.3f} |")
    return rows


def figures(record: dict) -> list:
    when = record["meta"]["started"]
    out = []
    for r in record["runs"]:
        if "error" in r:
            continue
        w, lean = r["whole"], r["lean"]
        out.append(harness.Figure(
            f"{r['dtype']}, optimizer {r['optimizer']}: LoRA checkpoint bytes without / with the frozen base "
            f"(save {lean['save_s']:.2f} vs {w['save_s']:.2f} s, load {lean['load_s']:.2f} vs {w['load_s']:.2f} s)",
            f"**{lean['bytes'] / w['bytes']:.4f}x**", "the adapters and their states only", None, when))
    return out


def chart(record: dict, path: str) -> bool:
    plt = harness.pyplot()
    if plt is None:
        return False
    runs = [r for r in record["runs"] if "error" not in r]
    labels = [f"{r['dtype']}\nopt {r['optimizer']}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, scale, unit in ((axes[0], "bytes", 2 ** 20, "MiB on disk"), (axes[1], "save_s", 1, "save s"),
                                 (axes[2], "load_s", 1, "load s")):
        for i, (kind, name) in enumerate((("whole", "whole"), ("lean", "exclude_frozen_parameters"))):
            values = [r[kind][key] / scale for r in runs]
            xs = [g + (i - 0.5) * 0.4 for g in range(len(runs))]
            bars = ax.bar(xs, values, 0.4, label=name)
            ax.bar_label(bars, labels=[f"{v:.1f}" if v >= 10 else f"{v:.2f}" for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(runs)), labels, fontsize=8)
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    m = record["meta"]["model"]
    fig.suptitle(f"LoRA checkpoints of GPT {m['layers']} x d {m['d_model']} (base frozen on NVMe); median of "
                 f"{record['meta']['repeats']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(record: dict, png) -> str:
    m = record["meta"]
    doc = " ".join(__doc__.split("[Note: what is measured]", 1)[1].split())
    runs = [r for r in record["runs"] if "params" in r]
    sizes = f"{runs[0]['params'] / 1e6:.1f}M parameters, {runs[0]['trainable'] / 1e6:.2f}M trainable. " if runs else ""
    dropped = "" if all(r.get("cache_dropped") for r in runs) else " (page cache not dropped: not root)"
    body = [f"Latest run: {m['started']}, commit {m['commit']}; {m['nproc']} CPUs, disk {m['disk']}; load average "
            f"{m['load_start']} at the start, {m['load_end']} at the end; {m['elapsed_s']} s in all."
            + (" **Quick run (--quick): a smoke test.**" if m["quick"] else ""), "", doc, "",
            sizes + "Medians of the saves and loads" + dropped + ".", "", *table(record), ""]
    if png:
        body += [f"![LoRA checkpoints]({os.path.basename(png)})", ""]
    return "\n".join(body)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (4 layers x d 256)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="swap files and checkpoints go under it")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per child")
    p.add_argument("--out", help="JSON of the run")
    p.add_argument("--results-md", help="replace this file's section (e.g. bench/RESULTS.md)")
    p.add_argument("--png", help="the chart (default: lora_checkpoint.png beside --results-md)")
    p.add_argument("--render", metavar="JSON", help="only write --results-md / --png from a saved --out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        harness.print_result(child(json.loads(args.child)))
        return 0
    if args.render:
        with open(args.render) as f:
            record = json.load(f)
    else:
        args.argv = argv
        record = run(args)
        harness.save_json(record, args.out, indent=1)
    print("\n".join(table(record)))
    png = args.png or (os.path.join(os.path.dirname(os.path.abspath(args.results_md)), "lora_checkpoint.png")
                       if args.results_md else None)
    harness.publish(record, args.results_md, SECTION, png, chart, figures, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
