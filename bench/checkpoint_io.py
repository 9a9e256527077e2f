"""Checkpoints at disk speed: engine save/load vs torch.save/load vs fio, side by side.

    flock /tmp/bench.lock python -m bench.checkpoint_io --dir /tmp/ckbench --results-md bench/RESULTS.md

In one run, on one directory, page cache dropped before every timed save and
load (root; else the figures are marked):
- fio's best write and read (bs 4M, huge-page buffers ``--mem=mmaphuge`` after
  reserving huge pages; a small grid of iodepth x numjobs, direct, fallocated,
  a new file; several jobs split the file between them);
- the fast writer alone on a 1 GiB tensor dict (8 x 128 MiB fp32): safetensors
  through nvmeio.SafetensorsWriter, and torch.save through FastFileWriter
  (CRC32 on, torch's default, and off); loads through the readers;
- the engine: the 311M GPT (zero.examples.GPT, vocab 8192, 24 layers, d 1024,
  seq 128) with parameters and optimizer on NVMe, one step trained, then
  ``save_checkpoint`` / ``load_checkpoint``, three ways: swap checksums off and
  on (swap files hard-linked into the checkpoint, shards linked back), and with
  links refused (state copied, as onto another file system);
- ``torch.save`` / ``torch.load`` (buffered file, fsync) of the same state:
  every sub-group's master and Adam states, as the checkpoint holds them.

Goals (issue 11): save >= 10x torch.save and >= 0.7x the disk's limit for the
bytes it moves (fio's best write for bytes from memory, fio's best read for
bytes copied from swap files); load >= 0.7x fio's best read; the fast writer
alone >= 0.8x fio's best write. Medians of ``--repeats`` runs; GiB = 1024^3.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import harness
from tools import fio

GIB = 1 << 30
SECTION = "## Checkpoint I/O (bench/checkpoint_io.py)"


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = str(text).strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_io(fn) -> tuple:
    """(seconds, bytes read from storage, bytes written) of ``fn()``."""
    before = harness.proc_io()
    seconds = timed(fn)
    after = harness.proc_io()
    return seconds, after["read_bytes"] - before["read_bytes"], after["write_bytes"] - before["write_bytes"]


# -- fio ---------------------------------------------------------------------------------

def fio_best(directory: str, size: str, repeats: int) -> dict:
    """fio's best write and read GiB/s over a small grid (bs 4M, direct, huge-page buffers;
    tools/fio.py), each job's best of ``repeats``, writes to a new file."""
    if not fio.available():
        return {"error": "fio not installed"}
    depths = ((8, 1), (32, 1), (16, 4))
    # split: with several jobs each writes its own part of the one new file (fio's default has
    # every job write the whole file: the later ones rewrite allocated blocks, counted 4x)
    jobs = {rw: fio.sweep_jobs(rw, parse_size(size), block_sizes=(4 << 20,), mems=("mmaphuge",),
                               engines=("libaio",), depths=depths, split=True) for rw in ("write", "read")}
    try:
        huge = fio.reserve_huge_pages(fio.buffer_bytes(jobs["write"]))
        mem = "mmaphuge"
    except (OSError, RuntimeError):
        huge, mem = None, "malloc"
        jobs = {rw: [dataclasses.replace(j, mem=mem) for j in js] for rw, js in jobs.items()}
    path = os.path.join(directory, "fio.dat")
    rows = []
    try:
        for rw in ("write", "read"):
            sweep = fio.best_fio(path, jobs[rw], repeats, new_file=True)
            for job in jobs[rw]:
                row = {"iodepth": job.iodepth, "numjobs": job.numjobs, "rw": rw}
                if job in sweep.samples:
                    row["gibs"] = round(max(sweep.samples[job]) / GIB, 3)
                else:
                    row["error"] = sweep.errors[job][-300:]
                rows.append(row)
        if os.path.exists(path):
            os.unlink(path)
    finally:
        if huge is not None:
            fio.restore_huge_pages(huge)
    ok = [r for r in rows if "gibs" in r]
    return {"mem": mem, "rows": rows,
            "write": max((r["gibs"] for r in ok if r["rw"] == "write"), default=None),
            "read": max((r["gibs"] for r in ok if r["rw"] == "read"), default=None)}


def fio_copy(directory: str, nbytes: int, repeats: int) -> dict:
    """fio's time to read ``nbytes`` and write ``nbytes`` at once (tools/fio.py
    read_write_together: one read job and one write job, bs 4M, iodepth 32): the disk's limit
    for a copy, whose reads and writes share the disk."""
    return harness.fio_reference(nbytes, nbytes, directory, runs=repeats)


# -- the fast writer alone ----------------------------------------------------------------

def writer_alone(directory: str, repeats: int) -> dict:
    import nvmeio
    from nvmeio.safetensors_file import load_file, save_file

    tensors = {f"t{i}": torch.randn(32 << 20) for i in range(8)}  # 8 x 128 MiB = 1 GiB
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    out = {"bytes": nbytes}
    st_path = os.path.join(directory, "alone.safetensors")
    pt_path = os.path.join(directory, "alone.pt")

    def torch_save_fast():
        with nvmeio.FastFileWriter(pt_path) as f:
            torch.save(tensors, f)

    def torch_load_fast():
        with nvmeio.FastFileReader(pt_path) as f:
            torch.load(f, weights_only=True)

    cases = {"safetensors write": (lambda: save_file(tensors, st_path)),
             "safetensors read": (lambda: load_file(st_path)),
             "torch.save via FastFileWriter (crc32 on)": torch_save_fast,
             "torch.load via FastFileReader": torch_load_fast}

    def fresh(name):  # a write goes to a new file each time, as fio's: no old file freed in the timing
        target = {"safetensors write": st_path}.get(name, pt_path if "save" in name else None)
        if target is not None and os.path.exists(target):
            os.unlink(target)

    for name, fn in cases.items():
        times = []
        for _ in range(repeats):
            fresh(name)
            fio.drop_page_cache()
            times.append(timed(fn))
        out[name] = nbytes / statistics.median(times) / GIB
    torch.serialization.set_crc32_options(False)
    try:
        times = []
        for _ in range(repeats):
            fresh("torch.save")
            fio.drop_page_cache()
            times.append(timed(torch_save_fast))
        out["torch.save via FastFileWriter (crc32 off)"] = nbytes / statistics.median(times) / GIB
    finally:
        torch.serialization.set_crc32_options(True)
    for p in (st_path, pt_path):
        os.unlink(p)
    return out


# -- the engine ---------------------------------------------------------------------------

def engine_and_torch(directory: str, repeats: int, layers: int, checksum: str, with_torch: bool,
                     copy: bool = False) -> dict:
    """``copy``: the engine may not hard-link swap files into the checkpoint nor shards back
    (what happens where the checkpoint lies on another file system): the bytes move."""
    import zero
    from nvmeio.safetensors_file import load_file
    from zero.examples import GPT, GPTConfig, make_batches

    cfg = GPTConfig(vocab=8192, d_model=1024, heads=16, layers=layers, seq=128, tie=True)
    swap = os.path.join(directory, "swap")
    os.makedirs(swap, exist_ok=True)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0,
                                                            "min_swap_bytes": 0, "checksum": checksum},
                              "offload_optimizer": {"device": "nvme", "nvme_path": swap, "checksum": checksum}},
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4},
        "checkpoint": {"writer": {"type": "fast", "show_statistics": False}},
        "steps_per_print": 1000,
    }
    t0 = time.perf_counter()
    with zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    x, y = make_batches(cfg, 1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    setup_s = time.perf_counter() - t0
    if copy:
        store = engine.parts.optimizer_store
        store._link_state = lambda *args, **kwargs: False
        store._adopt_file = lambda *args, **kwargs: False
        store.link_on_load = False  # a staged load copies the shard too (zero/checkpoint/load.py [Note])
    numel = engine.parts.rank_layout.numel
    ckpt = os.path.join(directory, "ckpt")
    saves, loads, sizes, load_io = [], [], [], []
    for i in range(repeats):
        shutil.rmtree(ckpt, ignore_errors=True)
        fio.drop_page_cache()
        saves.append(timed(lambda: engine.save_checkpoint(ckpt, tag="t")))
        sizes.append(tree_bytes(os.path.join(ckpt, "t")))
        if i == 0:  # written by this save (not a hard link of a swap file)
            moved = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ckpt, "t"))
                        for f in fs if os.stat(os.path.join(d, f)).st_nlink == 1)
        fio.drop_page_cache()
        seconds, read, written = timed_io(lambda: engine.load_checkpoint(ckpt, tag="t"))
        loads.append(seconds)
        load_io.append([read, written])
    ck_bytes = statistics.median(sizes)
    store = engine.parts.optimizer_store
    copied = sum(sg.numel * 4 * (1 + (0 if sg.frozen else len(store.state_names)))
                 for sg in engine.parts.rank_layout.sub_groups)  # a frozen sub-group: its master alone
    shards = [os.path.join(ckpt, "t", "rank00000", f) for f in sorted(os.listdir(os.path.join(ckpt, "t", "rank00000")))
              if f.endswith(".safetensors")]
    engine.destroy()
    shutil.rmtree(swap, ignore_errors=True)
    out = {"params": numel, "setup_s": round(setup_s, 1), "checkpoint_bytes": ck_bytes, "checksum": checksum,
           "copy": copy, "state_bytes": copied, "written_bytes": moved, "save_s": saves, "load_s": loads,
           "load_io_bytes": load_io}
    if not with_torch:
        shutil.rmtree(ckpt, ignore_errors=True)
        return out

    # torch.save / torch.load of the same state: every sub-group's master and states (read back
    # from the checkpoint once the engine is gone: the state is then in memory once)
    state = {os.path.basename(p): load_file(p) for p in shards}
    pt = os.path.join(directory, "state.pt")
    tsaves, tloads = [], []

    def torch_save():
        with open(pt, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    for _ in range(repeats):
        fio.drop_page_cache()
        tsaves.append(timed(torch_save))
        fio.drop_page_cache()
        tloads.append(timed(lambda: torch.load(pt, weights_only=True)))
    pt_bytes = os.path.getsize(pt)
    os.unlink(pt)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {**out, "torch_bytes": pt_bytes, "torch_save_s": tsaves, "torch_load_s": tloads}


# -- report -------------------------------------------------------------------------------

def report(r: dict) -> tuple[str, dict]:
    fio, alone, eng = r["fio"], r["alone"], r["engine"]
    fw, fr = fio.get("write"), fio.get("read")
    med = statistics.median
    tsave_s, tload_s = med(eng["torch_save_s"]), med(eng["torch_load_s"])
    tsave_gibs, tload_gibs = eng["torch_bytes"] / tsave_s / GIB, eng["torch_bytes"] / tload_s / GIB

    def rates(e: dict) -> dict:
        ck, save_s, load_s = e["checkpoint_bytes"], med(e["save_s"]), med(e["load_s"])
        # the disk's limit for the bytes a save moves: those written from memory at fio's write
        # speed, those copied from swap files at fio's read speed (issue 11's definition)
        copied = e["state_bytes"] if e["copy"] else 0
        limit_s = ((e["written_bytes"] - copied) / GIB / fw + copied / GIB / fr) if fw and fr else None
        return {"save": ck / save_s / GIB, "load": ck / load_s / GIB, "save_s": save_s, "load_s": load_s,
                "limit_s": limit_s, "vs_torch_save": ck / save_s / GIB / tsave_gibs,
                "vs_limit": limit_s / save_s if limit_s else None,
                "load_vs_fio_read": ck / load_s / GIB / fr if fr else None}

    rows = {key: rates(r[key]) for key in ("engine", "engine_checksums", "engine_copy") if key in r}
    off, on = rows["engine"], rows["engine_checksums"]
    cp = rows.get("engine_copy")
    # a copy reads and writes each state byte: fio doing both at once on the same disk is its limit
    fc_s = r.get("fio_copy", {}).get("seconds")
    fc_runs = ", ".join(f"{x['seconds']:.2f}" for x in r.get("fio_copy", {}).get("runs", []))
    if cp:
        cp["vs_fio_copy_save"] = fc_s / cp["save_s"] if fc_s else None
        cp["vs_fio_copy_load"] = fc_s / cp["load_s"] if fc_s else None
    ratios = {
        "save_vs_torch_save": off["vs_torch_save"], "save_checksums_vs_torch_save": on["vs_torch_save"],
        "save_copy_vs_torch_save": cp["vs_torch_save"] if cp else None,
        "save_vs_disk_limit": off["vs_limit"], "save_checksums_vs_disk_limit": on["vs_limit"],
        "save_copy_vs_disk_limit": cp["vs_limit"] if cp else None,
        "load_vs_fio_read": off["load_vs_fio_read"], "load_checksums_vs_fio_read": on["load_vs_fio_read"],
        "load_copy_vs_fio_read": cp["load_vs_fio_read"] if cp else None,
        "save_copy_vs_fio_copy": cp.get("vs_fio_copy_save") if cp else None,
        "load_copy_vs_fio_copy": cp.get("vs_fio_copy_load") if cp else None,
        "load_vs_torch_load": off["load"] / tload_gibs,
        "writer_alone_vs_fio_write": alone["safetensors write"] / fw if fw else None,
        "torch_save_via_writer_crc_off_vs_fio_write": alone["torch.save via FastFileWriter (crc32 off)"] / fw
        if fw else None,
    }

    def f(x, d=2):
        return "—" if x is None else f"{x:.{d}f}"

    def engine_row(what: str, e: dict, x: dict) -> str:
        copy_load = ""
        if e["copy"]:
            moved = (f"**{f(x.get('vs_fio_copy_save'))}×** fio's copy (read + write at once, "
                     f"{f(fc_s, 2)} s), {f(x['vs_limit'])}× issue 11's disk limit ({f(x['limit_s'], 2)} s)")
            copy_load = f", **{f(x.get('vs_fio_copy_load'))}×** fio's copy"
        else:  # a few KiB written, fsynced: no disk-bandwidth limit applies
            moved = f"it writes {e['written_bytes'] / 1024:.0f} KiB (no state byte moves)"
        return (f"| {what} | {e['checkpoint_bytes'] / GIB:.2f} GiB | "
                f"{f(x['save'])} | {f(x['load'])} | save **{f(x['vs_torch_save'], 1)}×** torch.save, {moved}; "
                f"load **{f(x['load_vs_fio_read'])}×** fio read{copy_load} |")

    ck = eng["checkpoint_bytes"]
    lines = [
        f"Latest run: {r.get('started', r['when'])} on {r['host']}, commit {r['commit']}.",
        "",
        f"Directory {r['dir']} ({r['fs']}); page cache dropped before every timed save and load: "
        f"{r['dropped']}. Medians of {r['repeats']}; GiB = 1024³. Load average {r['load_start']} at start, "
        f"{r['load_end']} at end (2 cores shared with other work: compare rows within this run). Every write "
        f"goes to a new file (fio's too).",
        "",
        "Goals (issue 11): save ≥ 10× torch.save and ≥ 0.7× the disk's limit for the bytes it moves; load ≥ 0.7× "
        "fio's best read; the fast writer alone ≥ 0.8× fio's best write. Issue 23: a load with checksums on "
        "≥ 0.8× fio's read (each byte read once); with links refused, save and load ≥ 0.7× the disk's limit "
        "for a copy (fio reading and writing the state's bytes at once).",
        "",
        "| what | bytes | write / save GiB/s | read / load GiB/s | ratios |",
        "|---|---:|---:|---:|---|",
        f"| fio best (bs 4M, libaio, direct, --mem={fio.get('mem')}, new file; several jobs split the file) | "
        f"{r['fio_size']} | {f(fw)} | {f(fr)} | the disk's limit |",
        f"| fast writer alone: safetensors, 1 GiB dict | 1 GiB | {f(alone['safetensors write'])} | "
        f"{f(alone['safetensors read'])} | write **{f(ratios['writer_alone_vs_fio_write'])}×** fio write |",
        f"| torch.save / torch.load through FastFileWriter / Reader, crc32 on | 1 GiB | "
        f"{f(alone['torch.save via FastFileWriter (crc32 on)'])} | {f(alone['torch.load via FastFileReader'])} | |",
        f"| torch.save through FastFileWriter, crc32 off | 1 GiB | "
        f"{f(alone['torch.save via FastFileWriter (crc32 off)'])} | — | "
        f"{f(ratios['torch_save_via_writer_crc_off_vs_fio_write'])}× fio write |",
        engine_row(f"engine save_checkpoint / load_checkpoint ({eng['params'] / 1e6:.0f}M GPT, params + optimizer "
                   "on NVMe), swap checksums off: swap files hard-linked, shards linked back", eng, off),
        engine_row("the same, swap checksums on (the default): linked, digests carried; the load reads every "
                   "shard once, hashing it as it streams into the staging buffer, then links it back "
                   "(the masters come from that buffer)", r["engine_checksums"], on),
    ]
    if cp:
        lines.append(engine_row("the same, checksums on, links refused (a checkpoint on another file system): "
                                "state copied swap file → shard through locked buffers (O_DIRECT); the load "
                                "reads each shard once, hashing it, into the swapper's buffer while writing it "
                                "to a staging swap file, published once all verified",
                                r["engine_copy"], cp))
    lines += [
        f"| torch.save / torch.load of the same state (buffered, fsync) | {eng['torch_bytes'] / GIB:.2f} GiB | "
        f"{f(tsave_gibs)} | {f(tload_gibs)} | |",
        "",
        "- seconds (median; runs): " + "; ".join(
            f"{key} save {x['save_s']:.2f} ({', '.join(f'{v:.2f}' for v in r[key]['save_s'])}), load "
            f"{x['load_s']:.2f} ({', '.join(f'{v:.2f}' for v in r[key]['load_s'])})" for key, x in rows.items())
        + f"; torch.save {tsave_s:.2f}, torch.load {tload_s:.2f}",
        f"- of the checkpoint's {ck / GIB:.2f} GiB, {eng['state_bytes'] / GIB:.2f} GiB are fp32 masters + Adam "
        "states living in NVMe swap files; a linked save writes only engine.pt, buffers.pt, zero_meta.json and "
        "each shard's header page (the swap file's first 4 KiB); the disk limit (issue 11) = bytes written from "
        "memory / fio write + bytes copied from swap files / fio read; a copy both reads and writes each byte: "
        "with the two directions one after the other the disk needs copied bytes / fio read + copied bytes / fio "
        "write",
        "- the first save after a step waits for that step's last optimizer writes (the step leaves them in "
        "flight for the next forward): the first of each row's runs",
        f"- load vs torch.load of the same state: {f(ratios['load_vs_torch_load'])}×; the fp32 parameters live "
        "in the optimizer's master region (stores/param_store.py), so a load writes no parameter file",
        "- bytes each load moved (/proc/self/io, median over runs; the checkpoint holds "
        f"{ck / GIB:.2f} GiB): " + "; ".join(
            f"{key} read {med(v[0] for v in r[key]['load_io_bytes']) / GIB:.2f} GiB, wrote "
            f"{med(v[1] for v in r[key]['load_io_bytes']) / GIB:.2f} GiB"
            for key in rows if r[key].get("load_io_bytes")),
        (f"- fio's copy (bench/harness.py fio_reference; tools/fio.py read_write_together): read and write "
         f"{r['fio_copy']['read_bytes'] / GIB:.2f} GiB each at once, {r['fio_copy']['engine']}, bs 4M, iodepth "
         f"{r['fio_copy']['iodepth']}, --mem={r['fio_copy']['mem']}, fastest of {len(r['fio_copy']['runs'])}: "
         f"{f(fc_s, 2)} s (runs: {fc_runs})"
         if fc_s else "- fio's copy: not measured"),
        f"- fio grid (best of {r['repeats']} each): " + "; ".join(
            f"{x['rw']} iodepth {x['iodepth']} x {x['numjobs']} jobs "
            + (f"{x['gibs']:.2f}" if "gibs" in x else "failed") for x in fio.get("rows", [])),
        "",
        "![checkpoint I/O](checkpoint_io.png)",
    ]
    return "\n".join(lines), ratios


def chart(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fio, alone, eng = r["fio"], r["alone"], r["engine"]
    med = statistics.median
    tb = eng["torch_bytes"]

    def ck(key):
        e = r[key]
        return e["checkpoint_bytes"] / med(e["save_s"]) / GIB, e["checkpoint_bytes"] / med(e["load_s"]) / GIB

    rows = [("fio best", fio.get("write") or 0, fio.get("read") or 0),
            ("safetensors\nwriter alone", alone["safetensors write"], alone["safetensors read"]),
            ("torch.save via\nFastFileWriter", alone["torch.save via FastFileWriter (crc32 on)"],
             alone["torch.load via FastFileReader"]),
            ("engine, linked\nchecksums off", *ck("engine")),
            ("engine, linked\nchecksums on", *ck("engine_checksums"))]
    if "engine_copy" in r:
        rows.append(("engine, copied\nchecksums on", *ck("engine_copy")))
    rows.append(("torch.save /\ntorch.load", tb / med(eng["torch_save_s"]) / GIB, tb / med(eng["torch_load_s"]) / GIB))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [w for _, w, _ in rows], 0.4, label="write / save")
    ax.bar([x + 0.2 for x in xs], [rd for _, _, rd in rows], 0.4, label="read / load")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n for n, _, _ in rows], fontsize=7)
    ax.set_ylabel("GiB/s (log)")
    ax.set_yscale("log")
    ax.set_title("checkpoint I/O (median; a linked save moves almost no bytes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/ckbench", help="a directory on the disk to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=24, help="GPT layers (24: the 311M model)")
    p.add_argument("--fio_size", default="2G")
    p.add_argument("--results-md", dest="results_md")
    p.add_argument("--json", default=os.path.join(harness.ROOT, "bench", "out", "checkpoint_io.json"))
    p.add_argument("--render", metavar="JSON", help="write the section (and chart) from a saved run's JSON")
    args = p.parse_args(argv)
    if args.render:
        r = json.loads(Path(args.render).read_text())
        body, _ = report(r)
        print(body)
        if args.results_md:
            write_section(args.results_md, r, body)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    meta = harness.provenance(args.dir)
    r = {**meta, "command": "python -m bench.checkpoint_io " + " ".join(
             argv if argv is not None else sys.argv[1:]),
         "dir": args.dir, "repeats": args.repeats, "fio_size": args.fio_size, "fs": meta["fstype"],
         "dropped": fio.drop_page_cache()}
    r["fio"] = fio_best(args.dir, args.fio_size, args.repeats)
    print("fio", json.dumps(r["fio"]), flush=True)
    r["alone"] = writer_alone(args.dir, args.repeats)
    print("alone", json.dumps(r["alone"]), flush=True)
    r["engine"] = engine_and_torch(args.dir, args.repeats, args.layers, "none", True)
    print("engine", json.dumps(r["engine"]), flush=True)
    r["engine_checksums"] = engine_and_torch(args.dir, args.repeats, args.layers, "auto", False)
    print("engine_checksums", json.dumps(r["engine_checksums"]), flush=True)
    r["engine_copy"] = engine_and_torch(args.dir, args.repeats, args.layers, "auto", False, copy=True)
    print("engine_copy", json.dumps(r["engine_copy"]), flush=True)
    r["fio_copy"] = fio_copy(args.dir, r["engine_copy"]["state_bytes"], args.repeats)
    print("fio_copy", json.dumps(r["fio_copy"]), flush=True)
    r["load_end"] = harness.load_average()
    body, ratios = report(r)
    r["ratios"] = ratios
    print(body)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=1))
    if args.results_md:
        write_section(args.results_md, r, body)
    return 0


def write_section(results_md: str, r: dict, body: str) -> None:
    chart(r, os.path.join(os.path.dirname(os.path.abspath(results_md)), "checkpoint_io.png"))
    harness.write_section(results_md, SECTION, figures(r["ratios"], r["when"]), r["command"], body)


def figures(ratios: dict, when: str) -> list:
    """The headline: issue 11's and issue 23's goals, each against its ratio."""
    rows = (("save_checksums_vs_torch_save", "save (linked, checksums on: the default) / torch.save", 10, "x", ""),
            ("load_vs_fio_read", "load (checksums off) / fio's read", 0.7, "x", " (issue 11)"),
            ("load_checksums_vs_fio_read", "load (checksums on) / fio's read", 0.8, "x", " (issue 23)"),
            ("save_copy_vs_fio_copy", "save, links refused (state copied) / fio's copy", 0.7, "x", " (issue 23)"),
            ("load_copy_vs_fio_copy", "load, links refused / fio's copy", 0.7, "x", " (issue 23)"),
            ("writer_alone_vs_fio_write", "fast writer alone (safetensors, 1 GiB) / fio's write", 0.8, "x",
             " (issue 11)"))
    out = []
    for key, what, goal, unit, issue in rows:
        x = ratios.get(key)
        if x is not None:
            out.append(harness.Figure(what, f"**{x:.2f}{unit}**", f"≥ {goal}{unit}{issue or ' (issue 11)'}", x >= goal,
                                      when))
    return out


if __name__ == "__main__":
    sys.exit(main())
