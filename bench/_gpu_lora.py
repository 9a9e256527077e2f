"""bench/gpu_check.py's ``lora`` stage: bench/lora.py's LoRA stand-in on the GPU, without and with
``zero_quantized_nontrainable_weights``, each run in a child of its own.

[Note: what the GPU adds to bench/lora.py]
On the CPU the LoRA iteration is bound by compute (its forward and backward take 1.5x to 36x the
disk's time for its bytes), so the quantized base's smaller reads cannot show in seconds. On a GPU
the same iteration is bound by the frozen base's reads, and issue 32 asks that its time fall with
its bytes: the stage reports, per dtype, the flagged run's bytes and seconds over the unflagged
run's, and each run's seconds over the disk's time for its bytes (the disk stage's reference, as
the train stage's rows).

[Note: the wide model]
On an H200 the stand-in's quantized iteration stopped being the disk's: 0.29 GiB of int8 take
0.17 s to read, while its 339 units (24 layers of small Linears and rank-8 adapters, 1 x 8
tokens) cost about 0.2 s of the CPU's hooks and copies a forward and backward (bench/gpu_runs/,
2026-11-27 18:58). Issue 32's "the iteration time falls in proportion in the I/O-bound regime"
needs a model still I/O-bound with the flag: the wide model (``Sizes.lora_wide``, 8 layers of
d_model 2048, 420M parameters: a unit's read takes ~10x as long as the stand-in's for about
a third of the units) runs the same pair in fp32 after the stand-in's rows.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time

LORA_MODULE = "bench.lora"


STAND_IN = "stand-in"
WIDE = "wide"


def jobs(sizes) -> list:
    """(model label, model, dtype, flag) of every run: the stand-in per dtype, unflagged first (the
    pair a short budget keeps), then the wide model in fp32 (see [Note: the wide model])."""
    out = [(STAND_IN, sizes.model, d, flag) for d in sizes.dtypes for flag in (False, True)]
    if sizes.lora_wide:
        out += [(WIDE, sizes.lora_wide, "fp32", flag) for flag in (False, True)]
    return out


def stage_lora(run, stage, disk_reference) -> dict:
    """Runs bench/lora.py's ``iterations`` child per (dtype, flag); ``disk_reference(run, disk, r, w)``
    is gpu_check's. The record is rewritten after every run."""
    s = run.sizes
    out = {"model": s.model, "models": {STAND_IN: s.model, **({WIDE: s.lora_wide} if s.lora_wide else {})},
           "device": "cuda" if run.cuda else "cpu", "runs": []}
    disk = run.record["stages"].get("disk", {})
    for name, model, dtype, flag in jobs(s):
        left = stage.left()
        label = f"lora {'' if name == STAND_IN else name + ' '}{dtype} {'quantized' if flag else 'unquantized'}"
        if left < max(1.0, s.min_run_s):
            row = {"skipped": "the stage's time ran out"}
        else:
            swap = tempfile.mkdtemp(prefix="lora-", dir=run.scratch)
            spec = {"dtype": dtype, "flag": flag, "model": model, "nvme_path": swap, "warmup": s.warmup,
                    "iters": s.iters}
            run.say(f"lora: {label}")
            try:
                row = run.child(LORA_MODULE, ["--child", "iterations", json.dumps(spec)], min(left, s.run_cap_s))
            finally:
                shutil.rmtree(swap, ignore_errors=True)
        row = {"lora_model": name, "dtype": dtype, "flag": flag, **row}
        if "median_s" in row:
            row["disk"] = disk_reference(run, disk, row["swap_read_bytes"], row["swap_write_bytes"])
        run.say(f"lora: {label}: " + line(row))
        out["runs"].append(row)
        run.record["stages"]["lora"] = {**out, "status": "running", "seconds": round(time.monotonic() - stage.start),
                                        "budget_s": round(stage.deadline - stage.start)}
        run.write()
    failed = [r for r in out["runs"] if "error" in r]
    skipped = [r for r in out["runs"] if "skipped" in r]
    out["status"] = "failed" if failed else "partial" if skipped else "ok"
    if failed:
        out["error"] = f"{len(failed)} of {len(out['runs'])} runs failed, the first: {failed[0]['error']}"
    elif skipped:
        out["error"] = f"{len(skipped)} of {len(out['runs'])} skipped: {skipped[0]['skipped']}"
    if not run.cuda:
        out["note"] = "no CUDA: rehearsed on CPU"
    return out


def line(row: dict) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"failed: {row['error']}"
    return (f"{row['median_s']:.3f} s/iteration, swapper read {row['swap_read_bytes'] / (1 << 30):.3f} GiB, "
            f"wrote {row['swap_write_bytes'] / (1 << 30):.4f} GiB, init {row['init_s']} s")


def pairs(st: dict) -> list:
    """Per (model label, dtype) with both runs measured: (label, dtype, unflagged row, flagged row)."""
    rows = {(r.get("lora_model", STAND_IN), r["dtype"], r["flag"]): r for r in st.get("runs", []) if "median_s" in r}
    keys = dict.fromkeys((m, d) for m, d, _ in rows)
    return [(m, d, rows[(m, d, False)], rows[(m, d, True)]) for m, d in keys
            if (m, d, False) in rows and (m, d, True) in rows]


def pair_name(model: str, dtype: str) -> str:
    return dtype if model == STAND_IN else f"{model} {dtype}"


def moved(row: dict) -> int:
    return row["swap_read_bytes"] + row["swap_write_bytes"]


def to_disk(row: dict):
    disk = (row.get("disk") or {}).get("seconds")
    return row["median_s"] / disk if disk else None
