"""bench/gpu_check.py's ``lora`` stage: bench/lora.py's LoRA stand-in on the GPU, without and with
``zero_quantized_nontrainable_weights``, each run in a child of its own.

[Note: what the GPU adds to bench/lora.py]
On the CPU the LoRA iteration is bound by compute (its forward and backward take 1.5x to 36x the
disk's time for its bytes), so the quantized base's smaller reads cannot show in seconds. On a GPU
the same iteration is bound by the frozen base's reads, and issue 32 asks that its time fall with
its bytes: the stage reports, per dtype, the flagged run's bytes and seconds over the unflagged
run's, and each run's seconds over the disk's time for its bytes (the disk stage's reference, as
the train stage's rows).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time

LORA_MODULE = "bench.lora"


def jobs(dtypes) -> list:
    """(dtype, flag) of every run, unflagged first per dtype (the pair a short budget keeps)."""
    return [(d, flag) for d in dtypes for flag in (False, True)]


def stage_lora(run, stage, disk_reference) -> dict:
    """Runs bench/lora.py's ``iterations`` child per (dtype, flag); ``disk_reference(run, disk, r, w)``
    is gpu_check's. The record is rewritten after every run."""
    s = run.sizes
    out = {"model": s.model, "device": "cuda" if run.cuda else "cpu", "runs": []}
    disk = run.record["stages"].get("disk", {})
    for dtype, flag in jobs(s.dtypes):
        left = stage.left()
        label = f"lora {dtype} {'quantized' if flag else 'unquantized'}"
        if left < max(1.0, s.min_run_s):
            row = {"skipped": "the stage's time ran out"}
        else:
            swap = tempfile.mkdtemp(prefix="lora-", dir=run.scratch)
            spec = {"dtype": dtype, "flag": flag, "model": s.model, "nvme_path": swap, "warmup": s.warmup,
                    "iters": s.iters}
            run.say(f"lora: {label}")
            try:
                row = run.child(LORA_MODULE, ["--child", "iterations", json.dumps(spec)], min(left, s.run_cap_s))
            finally:
                shutil.rmtree(swap, ignore_errors=True)
        row = {"dtype": dtype, "flag": flag, **row}
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
    """Per dtype with both runs measured: (dtype, unflagged row, flagged row)."""
    rows = {(r["dtype"], r["flag"]): r for r in st.get("runs", []) if "median_s" in r}
    return [(d, rows[(d, False)], rows[(d, True)]) for d in dict.fromkeys(d for d, _ in rows)
            if (d, False) in rows and (d, True) in rows]


def moved(row: dict) -> int:
    return row["swap_read_bytes"] + row["swap_write_bytes"]


def to_disk(row: dict):
    disk = (row.get("disk") or {}).get("seconds")
    return row["median_s"] / disk if disk else None
