"""Checkpoints at disk speed: engine save/load vs torch.save/load vs fio, side by side.

    flock /tmp/bench.lock python3 bench/checkpoint_io.py --dir /tmp/ckbench --results-md bench/RESULTS.md

In one run, on one directory, page cache dropped before every timed save and
load (root; else the figures are marked):
- fio's best write and read (bs 4M, huge-page buffers ``--mem=mmaphuge`` after
  reserving huge pages; a small grid of iodepth x numjobs, direct, fallocated);
- the fast writer alone on a 1 GiB tensor dict (8 x 128 MiB fp32): safetensors
  through nvmeio.SafetensorsWriter, and torch.save through FastFileWriter
  (CRC32 on, torch's default, and off); loads through the readers;
- the engine: the 311M GPT (zero.examples.GPT, vocab 8192, 24 layers, d 1024,
  seq 128) with parameters and optimizer on NVMe, one step trained, then
  ``save_checkpoint`` / ``load_checkpoint``;
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
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tools import fio  # noqa: E402
from tools.results_md import replace_section  # noqa: E402

GIB = 1 << 30


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- fio ---------------------------------------------------------------------------------

def fio_best(directory: str, size: str, repeats: int) -> dict:
    """fio's best write and read GiB/s over a small grid (bs 4M, direct, huge-page buffers;
    tools/fio.py), each job's best of ``repeats``, writes to a new file."""
    if not fio.available():
        return {"error": "fio not installed"}
    depths = ((8, 1), (32, 1), (16, 4))
    jobs = {rw: fio.sweep_jobs(rw, size, block_sizes=(4 << 20,), mems=("mmaphuge",),
                               engines=("libaio",), depths=depths) for rw in ("write", "read")}
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
    for name, fn in cases.items():
        times = []
        for _ in range(repeats):
            drop_caches()
            times.append(timed(fn))
        out[name] = nbytes / statistics.median(times) / GIB
    torch.serialization.set_crc32_options(False)
    try:
        times = []
        for _ in range(repeats):
            drop_caches()
            times.append(timed(torch_save_fast))
        out["torch.save via FastFileWriter (crc32 off)"] = nbytes / statistics.median(times) / GIB
    finally:
        torch.serialization.set_crc32_options(True)
    for p in (st_path, pt_path):
        os.unlink(p)
    return out


# -- the engine ---------------------------------------------------------------------------

def engine_and_torch(directory: str, repeats: int, layers: int, checksum: str, with_torch: bool) -> dict:
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
                                                            "checksum": checksum},
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
    numel = engine.parts.rank_layout.numel
    ckpt = os.path.join(directory, "ckpt")
    saves, loads, sizes = [], [], []
    for i in range(repeats):
        shutil.rmtree(ckpt, ignore_errors=True)
        drop_caches()
        saves.append(timed(lambda: engine.save_checkpoint(ckpt, tag="t")))
        sizes.append(tree_bytes(os.path.join(ckpt, "t")))
        drop_caches()
        loads.append(timed(lambda: engine.load_checkpoint(ckpt, tag="t")))
    ck_bytes = statistics.median(sizes)
    store = engine.parts.optimizer_store
    copied = sum(sg.numel * 4 * (1 + len(store.state_names)) for sg in engine.parts.rank_layout.sub_groups)
    shards = [os.path.join(ckpt, "t", "rank00000", f) for f in sorted(os.listdir(os.path.join(ckpt, "t", "rank00000")))
              if f.endswith(".safetensors")]
    engine.destroy()
    shutil.rmtree(swap, ignore_errors=True)
    out = {"params": numel, "setup_s": round(setup_s, 1), "checkpoint_bytes": ck_bytes, "checksum": checksum,
           "copied_bytes": copied, "save_s": saves, "load_s": loads}
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
        drop_caches()
        tsaves.append(timed(torch_save))
        drop_caches()
        tloads.append(timed(lambda: torch.load(pt, weights_only=True)))
    pt_bytes = os.path.getsize(pt)
    os.unlink(pt)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {**out, "torch_bytes": pt_bytes, "torch_save_s": tsaves, "torch_load_s": tloads}


# -- report -------------------------------------------------------------------------------

def report(r: dict) -> tuple[str, dict]:
    fio, alone, eng, ec = r["fio"], r["alone"], r["engine"], r["engine_checksums"]
    fw, fr = fio.get("write"), fio.get("read")
    ec_save = ec["checkpoint_bytes"] / statistics.median(ec["save_s"]) / GIB
    ec_load = ec["checkpoint_bytes"] / statistics.median(ec["load_s"]) / GIB
    save_s, load_s = statistics.median(eng["save_s"]), statistics.median(eng["load_s"])
    tsave_s, tload_s = statistics.median(eng["torch_save_s"]), statistics.median(eng["torch_load_s"])
    ck = eng["checkpoint_bytes"]
    mem_bytes = ck - eng["copied_bytes"]
    save_gibs, load_gibs = ck / save_s / GIB, ck / load_s / GIB
    tsave_gibs, tload_gibs = eng["torch_bytes"] / tsave_s / GIB, eng["torch_bytes"] / tload_s / GIB
    limit_s = (mem_bytes / GIB / fw + eng["copied_bytes"] / GIB / fr) if fw and fr else None
    ratios = {
        "save_vs_torch_save": save_gibs / tsave_gibs,
        "save_vs_disk_limit": limit_s / save_s if limit_s else None,
        "load_vs_fio_read": load_gibs / fr if fr else None,
        "load_vs_torch_load": load_gibs / tload_gibs,
        "writer_alone_vs_fio_write": alone["safetensors write"] / fw if fw else None,
        "torch_save_via_writer_crc_off_vs_fio_write": alone["torch.save via FastFileWriter (crc32 off)"] / fw
        if fw else None,
    }

    def f(x, d=2):
        return "—" if x is None else f"{x:.{d}f}"

    lines = [
        f"Latest run: {r['when']} on {r['host']}, commit {r['commit']}, `{r['command']}`.",
        "",
        f"Directory {r['dir']} ({r['fs']}); page cache dropped before every timed save and load: "
        f"{r['dropped']}. Medians of {r['repeats']}; GiB = 1024³. Load average {r['load_start']} at start, "
        f"{r['load_end']} at end (2 cores shared with other work: compare rows within this run).",
        "",
        "| what | bytes | write / save GiB/s | read / load GiB/s | goal |",
        "|---|---:|---:|---:|---|",
        f"| fio best (bs 4M, libaio, direct, --mem={fio.get('mem')}) | {r['fio_size']} | {f(fw)} | {f(fr)} | "
        "the disk's limit |",
        f"| fast writer alone: safetensors, 1 GiB dict | 1 GiB | {f(alone['safetensors write'])} | "
        f"{f(alone['safetensors read'])} | write ≥ 0.8× fio write: **{f(ratios['writer_alone_vs_fio_write'])}×** |",
        f"| torch.save / torch.load through FastFileWriter / Reader, crc32 on | 1 GiB | "
        f"{f(alone['torch.save via FastFileWriter (crc32 on)'])} | {f(alone['torch.load via FastFileReader'])} | |",
        f"| torch.save through FastFileWriter, crc32 off | 1 GiB | "
        f"{f(alone['torch.save via FastFileWriter (crc32 off)'])} | — | "
        f"{f(ratios['torch_save_via_writer_crc_off_vs_fio_write'])}× fio write |",
        f"| engine save_checkpoint / load_checkpoint ({eng['params'] / 1e6:.0f}M GPT, params + optimizer on "
        f"NVMe, swap checksums off: file to file) | {ck / GIB:.2f} GiB | {f(save_gibs)} | {f(load_gibs)} | save ≥ 10× torch.save: "
        f"**{f(ratios['save_vs_torch_save'], 1)}×**; save ≥ 0.7× disk limit: **{f(ratios['save_vs_disk_limit'])}×**; "
        f"load ≥ 0.7× fio read: **{f(ratios['load_vs_fio_read'])}×** |",
        f"| the same with swap checksums on (the default: the state is read and verified through the swapper, "
        f"then written) | {ec['checkpoint_bytes'] / GIB:.2f} GiB | {f(ec_save)} | {f(ec_load)} | "
        f"{f(ec_save / tsave_gibs, 1)}× torch.save; load {f(ec_load / fr if fr else None)}× fio read |",
        f"| torch.save / torch.load of the same state (buffered, fsync) | {eng['torch_bytes'] / GIB:.2f} GiB | "
        f"{f(tsave_gibs)} | {f(tload_gibs)} | |",
        "",
        f"- engine save {save_s:.2f} s, load {load_s:.2f} s (runs: save {', '.join(f'{x:.2f}' for x in eng['save_s'])};"
        f" load {', '.join(f'{x:.2f}' for x in eng['load_s'])}); torch.save {tsave_s:.2f} s, torch.load {tload_s:.2f} s",
        f"- of the checkpoint's {ck / GIB:.2f} GiB, {eng['copied_bytes'] / GIB:.2f} GiB (fp32 master + Adam states) "
        f"were copied file to file from the NVMe swap files (through locked buffers, O_DIRECT); the disk limit for the save is "
        f"{f(limit_s)} s = bytes from memory / fio write + copied bytes / fio read",
        f"- load vs torch.load of the same state: {f(ratios['load_vs_torch_load'])}×",
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
    ck, tb = eng["checkpoint_bytes"], eng["torch_bytes"]
    rows = [("fio best", fio.get("write") or 0, fio.get("read") or 0),
            ("safetensors\nwriter alone", alone["safetensors write"], alone["safetensors read"]),
            ("torch.save via\nFastFileWriter", alone["torch.save via FastFileWriter (crc32 on)"],
             alone["torch.load via FastFileReader"]),
            ("engine\ncheckpoint", ck / statistics.median(eng["save_s"]) / GIB,
             ck / statistics.median(eng["load_s"]) / GIB),
            ("torch.save /\ntorch.load", tb / statistics.median(eng["torch_save_s"]) / GIB,
             tb / statistics.median(eng["torch_load_s"]) / GIB)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [w for _, w, _ in rows], 0.4, label="write / save")
    ax.bar([x + 0.2 for x in xs], [rd for _, _, rd in rows], 0.4, label="read / load")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n for n, _, _ in rows], fontsize=8)
    ax.set_ylabel("GiB/s")
    ax.set_title("checkpoint I/O (median)")
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
    p.add_argument("--json", default=str(REPO / "bench" / "out" / "checkpoint_io.json"))
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    r = {"when": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "host": os.uname().nodename,
         "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip(),
         "command": "python3 bench/checkpoint_io.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "dir": args.dir, "repeats": args.repeats, "fio_size": args.fio_size,
         "fs": subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout.split("\n")[1].split()[1],
         "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()), "dropped": drop_caches()}
    r["fio"] = fio_best(args.dir, args.fio_size, args.repeats)
    print("fio", json.dumps(r["fio"]), flush=True)
    r["alone"] = writer_alone(args.dir, args.repeats)
    print("alone", json.dumps(r["alone"]), flush=True)
    r["engine"] = engine_and_torch(args.dir, args.repeats, args.layers, "none", True)
    print("engine", json.dumps(r["engine"]), flush=True)
    r["engine_checksums"] = engine_and_torch(args.dir, args.repeats, args.layers, "auto", False)
    print("engine_checksums", json.dumps(r["engine_checksums"]), flush=True)
    r["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    body, ratios = report(r)
    r["ratios"] = ratios
    print(body)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=1))
    if args.results_md:
        chart(r, os.path.join(os.path.dirname(os.path.abspath(args.results_md)), "checkpoint_io.png"))
        replace_section(Path(args.results_md), "## Checkpoint I/O (bench/checkpoint_io.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
