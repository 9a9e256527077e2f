"""bench/gpu_check.py's ``infer`` stage: ZeRO-Inference on the GPU, bench/inference.py's children.

[Note: what the infer stage measures]
A Llama-shaped model (``Sizes.infer_model``: bench/inference.py's "medium", 426M parameters,
1.59 GiB of fp32 weights, more than its swap buffers hold) is built under ``zero.Init`` and saved (the ``create`` child), then loaded
with ``from_pretrained`` under ``zero.Init`` into NVMe partitions and served by greedy ``generate``
at each of ``Sizes.infer_batches`` (the ``generate`` child, contender zero-nvme: the Hugging Face
docs' ZeRO-Inference config, computing on the GPU). Every forward reads its swapped weights again
(1.28 GiB: the attention matrices, under ``min_swap_bytes``, stay in host memory), and on a GPU its
compute is small beside the reads, so a decode step's seconds over the disk's time for the bytes
it read (the disk stage's read speed) says how close serving comes to the disk; and
since a batch reads the weights once, batch 32 should make about 32 times the tokens a second of
batch 1. On the CPU (bench/RESULTS.md, "ZeRO-Inference beyond memory") compute hid the disk.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from bench.inference_report import decode_read

MODULE = "bench.inference"


def stage_infer(run, stage, disk_reference) -> dict:
    """The create child, then one generate child for every batch size; ``disk_reference(run, disk, r, w)``
    is gpu_check's."""
    s = run.sizes
    out = {"model": s.infer_model, "batches": list(s.infer_batches), "prompt_len": s.infer_prompt_len,
           "new_tokens": s.infer_new_tokens, "device": "cuda" if run.cuda else "cpu"}
    work = tempfile.mkdtemp(prefix="infer-", dir=run.scratch)
    ckpt, swap = os.path.join(work, "ckpt"), os.path.join(work, "swap")
    os.makedirs(swap)
    try:
        run.say(f"infer: create {s.infer_model}")
        created = run.child(MODULE, ["--child", "create", s.infer_model, ckpt, swap], stage.left())
        out["create"] = created
        if "error" in created:
            return {**out, "status": "failed", "error": f"create: {created['error']}"}
        shutil.rmtree(swap)
        os.makedirs(swap)
        run.say(f"infer: generate, batches {','.join(map(str, s.infer_batches))}")
        got = run.child(MODULE, ["--child", "generate", s.infer_model, "zero-nvme", ckpt, swap,
                                 ",".join(map(str, s.infer_batches)), s.infer_prompt_len, s.infer_new_tokens, "1"],
                        stage.left())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "error" in got:
        return {**out, "status": "failed", "error": f"generate: {got['error']}", "tail": got.get("tail")}
    disk = run.record["stages"].get("disk", {})
    rows = []
    for batch, r in got["batches"].items():
        read = decode_read(r, "swap")  # the mean of the forwards after the prompt's
        ref = disk_reference(run, disk, int(read), 0)
        rows.append({"batch": int(batch), "decode_s": r["decode_s_per_step"], "prefill_s": r["prefill_s"],
                     "decode_tokens_per_s": r["decode_tokens_per_s"], "tokens_per_s": r["tokens_per_s"],
                     "read_bytes_per_forward": read, "disk_s": ref.get("seconds"), "disk_source": ref.get("source"),
                     "to_disk": r["decode_s_per_step"] / ref["seconds"] if ref.get("seconds") else None})
        run.say(f"infer: {line(rows[-1])}")
    out.update(rows=rows, load_s=got["load_s"], weight_bytes=got["weight_bytes"], computed_on=got.get("device"),
               status="ok", seconds=round(time.monotonic() - stage.start))
    if not run.cuda:
        out["note"] = "no CUDA: rehearsed on CPU"
    return out


def line(row: dict) -> str:
    to_disk = "—" if row["to_disk"] is None else f"{row['to_disk']:.2f}"
    return (f"batch {row['batch']}: decode {row['decode_s']:.3f} s/step ({row['decode_tokens_per_s']:.1f} tokens/s), "
            f"{row['read_bytes_per_forward'] / (1 << 30):.3f} GiB read a forward, / disk {to_disk}")


def summary(st: dict) -> str:
    rows = st.get("rows") or []
    if not rows:
        return st.get("error", "")
    text = "; ".join(line(r) for r in rows)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        text += (f"; batch {last['batch']} / batch {first['batch']}: "
                 f"{last['decode_tokens_per_s'] / first['decode_tokens_per_s']:.1f}x the tokens a second")
    return text


def details(st: dict) -> list:
    rows = st.get("rows") or []
    if not rows:
        return []
    out = ["## ZeRO-Inference", "",
           f"bench/inference.py's {st['model']} Llama ({st['weight_bytes'] / (1 << 30):.2f} GiB of fp32 weights) from "
           f"NVMe, computing on {st.get('computed_on')}: greedy generate, {st['prompt_len']}-token prompts, "
           f"{st['new_tokens']} new tokens; loaded in {st['load_s']:.1f} s.", "",
           "| batch | prompt s | decode s/step | tokens/s (decode) | tokens/s (whole call) | GiB read a forward | "
           "disk s for it | / disk |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        disk = "—" if r["disk_s"] is None else f"{r['disk_s']:.3f}"
        to_disk = "—" if r["to_disk"] is None else f"{r['to_disk']:.2f}"
        out.append(f"| {r['batch']} | {r['prefill_s']:.3f} | {r['decode_s']:.3f} | {r['decode_tokens_per_s']:.1f} | "
                   f"{r['tokens_per_s']:.1f} | {r['read_bytes_per_forward'] / (1 << 30):.3f} | {disk} | {to_disk} |")
    return out + [""]
