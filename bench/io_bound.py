"""The GPU regime measured on a CPU: training iterations whose compute is nearly nothing, against fio.

    flock /tmp/bench.lock python -m bench.io_bound --out bench/out/io_bound.json --results-md bench/RESULTS.md
    python -m bench.io_bound --quick --contenders ours      # smoke test, ~2 min
    python -m bench.io_bound --render bench/out/io_bound.json --results-md bench/RESULTS.md

[Note: what is measured]
Compute here is ~100x slower than a GPU's and hides I/O. The stand-in: the
311M GPT of ``zero.examples`` (vocab 8192, 24 layers x d_model 1024, 16
heads, 128 positions, tied head), fed micro-batches of 1 x 8 tokens so that
compute is nearly nothing and each iteration is bound by the disk. ``ours``:
``zero.initialize`` with parameters and AdamW state on NVMe (``max_in_cpu``
0, ``sub_group_size`` and ``buffer_size`` 2e7, aio block 8 MiB / queue depth
32 / ``intra_op_parallelism`` 4). ``ds``: DeepSpeed 0.19.8's best working
configuration, parameters in host memory and optimizer on NVMe (with
parameters on NVMe too it crashed on this model in bench/scale.py, 'Not
enough buffers 0 for swapping 1'; ``ds-params-nvme`` tries it once, at k 4,
and records how it ends). One iteration = k micro-batches
(``gradient_accumulation_steps`` k) and one optimizer step:
``engine.train_batch(micro_batches)`` where the engine has it
(``--train-batch``), else the loop ``engine(x, y); engine.backward(loss);
engine.step()`` k times. Each contender runs in a fresh process: its bytes
are ``read_bytes`` / ``write_bytes`` of its ``/proc/self/io`` around each
iteration, its peak RSS its VmHWM; ``--warmup`` iterations, then the median
time of ``--iters`` and their mean bytes (writes still in flight when an
iteration returns count in the next one; the counters settle before the
first measured iteration and after the last, 0.5 s without I/O, so the
window holds their bytes).

fio's reference, on the same disk in the same run, right after each
contender: one read job and one write job at once (io_uring, 4 MiB blocks,
iodepth 32, huge-page memory), moving the bytes the contender's iteration
moved; the fastest of ``--fio-runs`` runs (more bytes than
``--fio-file-cap`` wrap around a file of that size). The iteration's
minimum bytes: fp32, 16 per parameter read (the weights once for forward,
4; the fp32 master, which is the weights, exp_avg and exp_avg_sq for the
step, 12) and 12 written (the three back); bf16, 14 read and 14 written:
the bf16 weights are a copy of their own on NVMe (2 bytes read for forward,
2 written after the step) beside the 12 of fp32 state each way (reading
the weights from the fp32 master instead would be 16 + 12, the same 28
bytes in all). It is the minimum of this layout with nothing kept in
memory: an engine that keeps the sub-group it stepped last can move less
(bytes / minimum below 1 on a model of one sub-group, as ``--quick``'s). The
floor of an iteration: fio's time for one step's minimum bytes + k x the
in-memory compute of one micro-batch (forward + backward by plain torch on
the same model in memory, batch 1 x 8, that dtype, with the glibc malloc
settings our engine applies to CPU training: plain torch at its best, 1.45x
faster in fp32 and 2x in bf16 here than with glibc's defaults; DeepSpeed runs
with the defaults, as its users do).
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

SECTION = "## I/O-bound training (bench/io_bound.py)"
MODEL = dict(vocab=8192, d_model=1024, heads=16, layers=24, seq=128, tie=True)  # 311M
QUICK_MODEL = dict(vocab=8192, d_model=256, heads=4, layers=4, seq=128, tie=True)
SEQ = 8  # tokens per micro-batch: compute is nearly nothing
LR = 1e-4
AIO = {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
       "overlap_events": True}
MIN_BYTES = {"fp32": (16, 12), "bf16": (14, 14)}  # per parameter (read, written): see the module's Note
CONTENDERS = ("ours", "ours-loop", "ds", "ds-params-nvme")  # ours-loop: ours, the micro-batch loop
DS_VENV_HOWTO = ("python -m venv /opt/dsvenv && /opt/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8 "
                 "ninja && apt-get install -y libaio-dev")
GiB = harness.GiB


# -- the children ----------------------------------------------------------------------------------

def scaled(default: int, d_model: int) -> int:
    """A size DeepSpeed sets for every model (the persistence threshold, the smallest partition
    its swapper puts on NVMe) as it is at the 311M's d_model 1024, scaled with d_model squared, so
    a smaller model (the rehearsal's, --quick) keeps the same kinds of units in memory and reads
    its weight matrices from NVMe as the 311M does."""
    return default * d_model * d_model // (1024 * 1024)


def config(contender: str, dtype: str, k: int, nvme_path: str, d_model: int = 1024) -> dict:
    """The DeepSpeed-style config of one contender (our engine and DeepSpeed read the same keys, but
    ``min_swap_bytes``: ours, DeepSpeed's 1 MiB rule scaled, see :func:`scaled`)."""
    zc = {"stage": 3, "sub_group_size": int(2e7),
          "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_size": int(2e7), "max_in_cpu": 0,
                            **({} if contender.startswith("ds") else {"min_swap_bytes": scaled(1 << 20, d_model)})},
          "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                                "pipeline_write": True}}
    if contender.startswith("ds"):
        zc["offload_optimizer"]["buffer_count"] = 16  # DeepSpeed's pipelining needs more than 4
    if contender == "ds":  # its best working configuration: parameters in host memory
        zc["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": k,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zc, "aio": AIO,
            "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}


def child_compute(spec: dict) -> dict:
    """Plain torch, the model in memory on ``spec["device"]`` (default the CPU): forward + backward of
    one micro-batch (batch 1 x SEQ); with ``spec["iteration_ks"]``, also whole iterations per k: k
    micro-batches and a fused AdamW step (bench/gpu_check.py's plain torch on the GPU)."""
    import dataclasses

    import torch

    ex = training.examples()
    device = torch.device(spec.get("device", "cpu"))
    if spec.get("malloc_tuning", True):  # plain torch at its best: the engine's glibc malloc settings
        from zero.stores import malloc_settings

        malloc_settings.hold()
    cfg = ex.GPTConfig(**spec["model"])
    torch.manual_seed(0)
    model = ex.GPT(cfg).to(device)
    if spec["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    ks = spec.get("iteration_ks", [])
    batches = [(x.to(device), y.to(device)) for x, y in
               ex.make_batches(dataclasses.replace(cfg, seq=SEQ), max([1, *ks]), 1)]
    x, y = batches[0]

    def synced(fn) -> float:  # seconds, the device's queued work included
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    times = []
    for _ in range(spec["warmup"] + spec["iters"]):
        times.append(synced(lambda: model(x, y).backward()))
        model.zero_grad(set_to_none=True)
    measured = times[spec["warmup"]:]
    out = {"params": sum(p.numel() for p in model.parameters()), "compute_s": statistics.median(measured),
           "compute_min_s": min(measured), "times_s": [round(t, 4) for t in times], "device": str(device)}
    if ks:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)

        def iteration(k: int) -> None:
            for bx, by in batches[:k]:
                (model(bx, by) / k).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["iteration_s"] = {}  # per k: the median of spec["iteration_iters"], after one warm-up
        for k in ks:
            seconds = [synced(lambda: iteration(k)) for _ in range(1 + spec["iteration_iters"])]
            out["iteration_s"][str(k)] = statistics.median(seconds[1:])
    out["peak_rss_bytes"] = harness.status_bytes("VmHWM")
    if device.type == "cuda":
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def child_train(spec: dict) -> dict:
    import dataclasses

    import torch

    contender, dtype, k = spec["contender"], spec["dtype"], spec["k"]
    ex = training.examples(deepspeed=contender.startswith("ds"))
    cfg = ex.GPTConfig(**spec["model"])
    conf = config(contender, dtype, k, spec["nvme_path"], cfg.d_model)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if contender.startswith("ds"):
        training.join_as_single_rank()
        import deepspeed as runtime

        init = runtime.zero.Init(config_dict_or_path=conf)
    else:
        import zero as runtime

        init = runtime.Init(config_dict_or_path=conf)
    with init:
        model = ex.GPT(cfg)
    engine, _, _, _ = runtime.initialize(model=model, config=conf)
    init_s = time.perf_counter() - t0
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    micro_batches = ex.make_batches(dataclasses.replace(cfg, seq=SEQ), k, 1)
    has = hasattr(engine, "train_batch")  # DeepSpeed 0.19.8: only its PipelineEngine has one
    if spec["train_batch"] == "yes" and not has:
        raise SystemExit(f"--train-batch yes: {type(engine).__name__} has no train_batch")
    use_train_batch = has and spec["train_batch"] != "no" and contender != "ours-loop"

    def iteration() -> float:
        if use_train_batch:
            return float(engine.train_batch(micro_batches))
        total = 0.0
        for x, y in micro_batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / k

    init_peak = harness.status_bytes("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from the current RSS
        f.write("5")
    times, reads, writes, losses = [], [], [], []
    busiest, cpu, waits = [], [], []  # where an iteration's time went (see blocked_seconds)
    w = spec["warmup"]

    def written(io: dict) -> int:
        return io["write_bytes"] - io["cancelled_write_bytes"]

    for i in range(w + spec["iters"]):
        io0 = harness.settled_io() if i == w else harness.proc_io()  # the warm-up's writes land outside the window
        wait0, threads0, cpu0 = blocked_seconds(engine), harness.thread_cpu(), time.process_time()
        start = time.perf_counter()
        losses.append(iteration())
        seconds = time.perf_counter() - start
        busiest.append(harness.busiest_thread(threads0, harness.thread_cpu()))
        cpu.append(time.process_time() - cpu0)
        waits.append(blocked_seconds(engine) - wait0)
        io1 = harness.settled_io() if i == w + spec["iters"] - 1 else harness.proc_io()  # the last one's: inside
        times.append(seconds)
        reads.append(io1["read_bytes"] - io0["read_bytes"])
        writes.append(written(io1) - written(io0))
    train_peak = harness.status_bytes("VmHWM")
    device = getattr(engine, "device", None)
    on_cuda = {"cuda_peak_bytes": torch.cuda.max_memory_allocated(device)} if str(device).startswith("cuda") else {}
    return {"params": params, "init_s": round(init_s, 1), "device": str(device), **on_cuda,
            "path": "train_batch" if use_train_batch else "loop" + ("" if has else " (engine has no train_batch)"),
            # bytes: the mean (writes in flight at the end of one iteration count in the next)
            "median_s": statistics.median(times[w:]), "read_bytes": int(statistics.mean(reads[w:])),
            "write_bytes": int(statistics.mean(writes[w:])), "times_s": [round(t, 3) for t in times],
            "reads": reads, "writes": writes, "losses": losses,
            "busiest_thread": [[name, round(t, 3)] for name, t in busiest], "cpu_s": [round(t, 3) for t in cpu],
            "blocked_s": [round(t, 3) for t in waits], "warmup": w,
            "peak_rss_bytes": max(init_peak, train_peak), "train_peak_rss_bytes": train_peak}


def blocked_seconds(engine) -> float:
    """Seconds the engine's stores have been blocked on NVMe reads and writes (ours; 0 for
    DeepSpeed). Beside them the CPU seconds of an iteration's busiest thread say whether the
    host's own work, rather than the disk, is what the iteration waits for."""
    parts = getattr(engine, "parts", None)
    stores = [getattr(parts, "param_store", None), getattr(parts, "optimizer_store", None)]
    return sum(getattr(s, "read_wait_seconds", 0.0) + getattr(s, "write_wait_seconds", 0.0) for s in stores if s)


# -- the run ---------------------------------------------------------------------------------------

def run_child(kind: str, spec: dict, python, timeout: int) -> dict:
    return harness.run_child("bench.io_bound", ["--child", kind, json.dumps(spec)], python, timeout)


def min_bytes(dtype: str, params: int) -> tuple:
    r, w = MIN_BYTES[dtype]
    return r * params, w * params


def fio_for(read_bytes: int, write_bytes: int, args, work: str) -> dict:
    """fio's time for these bytes; its files stay in ``work`` for the next contender's reference."""
    return harness.fio_reference(read_bytes, write_bytes, work, runs=args.fio_runs, file_cap=args.fio_file_cap,
                                 keep_files=True)


def disk_needed(params: int, fio_file_cap: int) -> int:
    """Swap bytes of the largest contender (ours: 12 per parameter of fp32 state, 2 of bf16 weights and 4
    of gradient partial sums under accumulation; DeepSpeed: fp32 weights, master, two Adam states and
    gradients, 20) and fio's two files."""
    return int(20 * params * 1.05) + 2 * fio_file_cap


def run(args) -> dict:
    model = QUICK_MODEL if args.quick else MODEL
    nvme_root = tempfile.mkdtemp(prefix="io-bound-", dir=args.nvme_dir)
    ds_ok = os.path.exists(args.ds_python)
    crash_k = 4 if 4 in args.ks else args.ks[0]
    record = {"meta": {**harness.provenance(args.nvme_dir),
                       "command": "python -m bench.io_bound " + " ".join(args.argv), "quick": args.quick,
                       "model": model, "seq": SEQ, "batch": 1, "warmup": args.warmup, "iters": args.iters,
                       "fio_runs": args.fio_runs, "fio_file_cap": args.fio_file_cap, "train_batch": args.train_batch,
                       "nvme_dir": args.nvme_dir, "ds_python": args.ds_python, "min_bytes_per_param": MIN_BYTES},
              "compute": {}, "fio_min": {}, "runs": []}
    try:
        for dtype in args.dtypes:
            comp = run_child("compute", {"model": model, "dtype": dtype, "warmup": 3, "iters": args.compute_iters},
                             None, args.timeout)
            record["compute"][dtype] = comp
            if "error" in comp:
                print(f"{dtype} compute: failed: {comp['error']}", flush=True)
                continue
            params = comp["params"]
            need, free = disk_needed(params, args.fio_file_cap), shutil.disk_usage(nvme_root).free
            if need > free:
                raise SystemExit(f"{nvme_root}: {free / GiB:.1f} GiB free, this run needs {need / GiB:.1f} GiB")
            r, w = min_bytes(dtype, params)
            record["fio_min"][dtype] = fio_for(r, w, args, nvme_root)
            fm = record["fio_min"][dtype]
            print(f"{dtype}: {params / 1e6:.1f}M parameters; in-memory compute of one micro-batch "
                  f"{comp['compute_s'] * 1e3:.1f} ms; fio for one step's minimum bytes ({r / GiB:.2f} GiB read, "
                  f"{w / GiB:.2f} GiB written): " + (f"{fm['seconds']:.3f} s ({fm['mem']})" if "seconds" in fm
                                                     else f"failed: {fm['error']}"), flush=True)
            for k in args.ks:
                for contender in args.contenders:
                    if contender == "ds-params-nvme" and (dtype != args.dtypes[0] or k != crash_k):
                        continue  # one attempt records how it fails
                    row = {"contender": contender, "dtype": dtype, "k": k}
                    if contender.startswith("ds") and not ds_ok:
                        row["skipped"] = (f"no DeepSpeed venv at {args.ds_python}; create it with: {DS_VENV_HOWTO} "
                                          f"(or pass --ds-python)")
                        print(f"{dtype} k={k} {contender}: skipped: {row['skipped']}", flush=True)
                        record["runs"].append(row)
                        continue
                    swap = tempfile.mkdtemp(prefix=f"{contender}-", dir=nvme_root)
                    spec = {"contender": contender, "dtype": dtype, "k": k, "model": model, "nvme_path": swap,
                            "warmup": args.warmup, "iters": args.iters, "train_batch": args.train_batch}
                    try:
                        row.update(run_child("train", spec, args.ds_python if contender.startswith("ds") else None,
                                             args.timeout))
                    finally:
                        shutil.rmtree(swap, ignore_errors=True)
                    if "error" not in row:
                        row["fio"] = fio_for(row["read_bytes"], row["write_bytes"], args, nvme_root)
                    record["runs"].append(row)
                    save(record, args.out)  # a run cut short keeps what it measured
                    print(f"{dtype} k={k} {contender}: {describe(row)}", flush=True)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    record["meta"].update(load_end=harness.load_average(), elapsed_s=round(time.time() - record["meta"]["t0"]))
    return record


def save(record: dict, path) -> None:
    harness.save_json(record, path, indent=1)


def describe(row: dict) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    f = row["fio"]
    fio_text = f"fio {f['seconds']:.3f} s ({f['mem']})" if f.get("seconds") else f"fio: {f.get('error')}"
    return (f"{row['median_s']:.3f} s/iteration ({row['path']}), read {row['read_bytes'] / GiB:.3f} GiB, written "
            f"{row['write_bytes'] / GiB:.3f} GiB, {fio_text}, peak RSS {row['peak_rss_bytes'] / GiB:.2f} GiB")


# -- the report ------------------------------------------------------------------------------------

def _ok(row) -> bool:
    return row is not None and "median_s" in row


def _find(record: dict, contender: str, dtype: str, k: int):
    return next((r for r in record["runs"] if (r["contender"], r["dtype"], r["k"]) == (contender, dtype, k)), None)


def floor_s(record: dict, dtype: str, k: int):
    """fio's time for one step's minimum bytes + k x the in-memory compute of one micro-batch."""
    fm, comp = record["fio_min"].get(dtype, {}), record["compute"].get(dtype, {})
    if fm.get("seconds") is None or "compute_s" not in comp:
        return None
    return fm["seconds"] + k * comp["compute_s"]


def summary(record: dict) -> dict:
    """The ratios the issue asks for, from the saved runs (so --render recomputes them)."""
    out = {}
    for row in record["runs"]:
        if not _ok(row):
            continue
        c, d, k = row["contender"], row["dtype"], row["k"]
        s = out.setdefault(f"{c} {d} k={k}", {})
        if row.get("fio", {}).get("seconds"):
            s["over_fio_same_bytes"] = row["median_s"] / row["fio"]["seconds"]
        floor = floor_s(record, d, k)
        if floor:
            s["over_floor"] = row["median_s"] / floor
        one = _find(record, c, d, 1)
        if k != 1 and _ok(one):
            s["bytes_over_k1"] = {"read": row["read_bytes"] / max(1, one["read_bytes"]),
                                  "written": row["write_bytes"] / max(1, one["write_bytes"]),
                                  "total": (row["read_bytes"] + row["write_bytes"])
                                  / max(1, one["read_bytes"] + one["write_bytes"])}
        for ds_name in ("ds", "ds-params-nvme") if c == "ours" else ():
            ds = _find(record, ds_name, d, k)
            if _ok(ds):
                s[f"{ds_name}_over_ours"] = ds["median_s"] / row["median_s"]
                s[f"peak_rss_ours_{ds_name}_bytes"] = [row["peak_rss_bytes"], ds["peak_rss_bytes"]]
    return out


def table(record: dict) -> list:
    lines = ["| dtype | k | contender | s / iteration | read GiB | written GiB | minimum read / written GiB | "
             "bytes / minimum | fio s, same bytes | / fio | floor s | / floor | peak RSS GiB | how |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in record["runs"]:
        head = f"| {row['dtype']} | {row['k']} | {row['contender']} |"
        if not _ok(row):
            why = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error']}"
            lines.append(head + f" {why.replace('|', '/')} | | | | | | | | | | |")
            continue
        r, w = min_bytes(row["dtype"], row["params"])
        f, s = row.get("fio", {}), row["median_s"]
        fio_s = f.get("seconds")
        floor = floor_s(record, row["dtype"], row["k"])
        lines.append(head + f" {s:.3f} | {row['read_bytes'] / GiB:.3f} | {row['write_bytes'] / GiB:.3f} | "
                     f"{r / GiB:.3f} / {w / GiB:.3f} | {(row['read_bytes'] + row['write_bytes']) / (r + w):.2f} | "
                     + (f"{fio_s:.3f} | **{s / fio_s:.2f}** | " if fio_s else "— | — | ")
                     + (f"{floor:.3f} | {s / floor:.2f} | " if floor else "— | — | ")
                     + f"{row['peak_rss_bytes'] / GiB:.2f} | {row['path']} |")
    return lines


def verdicts(record: dict) -> list:
    """One line per ratio the issue names."""
    out, ratios = [], summary(record)
    for dtype in record["compute"]:
        comp, fm = record["compute"][dtype], record["fio_min"].get(dtype, {})
        if "compute_s" in comp:
            r, w = min_bytes(dtype, comp["params"])
            fio_text = (f"{fm['seconds']:.3f} s ({fm['mem']} memory{'; ' + fm['mem_note'] if fm.get('mem_note') else ''})"
                        if fm.get("seconds") is not None else f"failed: {fm.get('error')}")
            out.append(f"- {dtype}: in-memory forward + backward of one micro-batch {comp['compute_s'] * 1e3:.1f} ms "
                       f"(plain torch with our engine's malloc settings, median of {len(comp['times_s']) - 3}); fio for one step's minimum bytes "
                       f"({r / GiB:.2f} GiB read + {w / GiB:.2f} GiB written at once): {fio_text}.")
        for c in ("ours", "ds"):
            top = max((row["k"] for row in record["runs"] if row["contender"] == c and row["dtype"] == dtype
                       and _ok(row)), default=None)
            s = ratios.get(f"{c} {dtype} k={top}", {})
            if top and top > 1 and "bytes_over_k1" in s:
                b = s["bytes_over_k1"]
                floor = f"; iteration / floor {s['over_floor']:.2f}" if "over_floor" in s else ""
                out.append(f"- {c} {dtype} k={top}: bytes(k={top}) / bytes(k=1) = {b['total']:.2f} (read {b['read']:.2f}, "
                           f"written {b['written']:.2f}){floor}.")
        s = ratios.get(f"ours {dtype} k=4", {})
        for ds_name, what in (("ds", "DeepSpeed (parameters in host memory)"), ("ds-params-nvme", "DeepSpeed with "
                                                                                "parameters on NVMe")):
            if f"{ds_name}_over_ours" in s:
                ours_rss, ds_rss = s[f"peak_rss_ours_{ds_name}_bytes"]
                out.append(f"- {dtype} k=4: {what} / ours = {s[f'{ds_name}_over_ours']:.2f} (time per iteration); "
                           f"peak RSS ours {ours_rss / GiB:.2f} GiB, DeepSpeed {ds_rss / GiB:.2f} GiB.")
    for row in record["runs"]:
        if "error" in row:
            out.append(f"- {row['contender']} {row['dtype']} k={row['k']} failed: `{row['error']}` "
                       f"(exit code {row.get('returncode')}).")
    return out


def chart(record: dict, path: str) -> bool:
    """Seconds per iteration (ours, DeepSpeed, fio for ours' bytes, the floor) and each over fio; False
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["k"]) for r in record["runs"]}, key=lambda g: (g[0] != "fp32", g[0], g[1]))
    names = [g[0] + f" k={g[1]}" for g in groups]

    def value(contender, key):
        out = []
        for d, k in groups:
            row = _find(record, contender, d, k)
            if not _ok(row):
                out.append(None)
            elif key == "s":
                out.append(row["median_s"])
            elif key == "fio":
                out.append(row.get("fio", {}).get("seconds"))
            else:
                f = row.get("fio", {}).get("seconds")
                out.append(row["median_s"] / f if f else None)
        return out

    seconds = {"ours": value("ours", "s"), "DeepSpeed (params in RAM)": value("ds", "s"),
               "fio, ours' bytes": value("ours", "fio"),
               "floor: fio(minimum bytes) + k x compute": [floor_s(record, d, k) for d, k in groups]}
    over = {"ours / fio": value("ours", "over"), "DeepSpeed / fio": value("ds", "over")}
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(groups)), 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for ax, series, ylabel in ((axes[0], seconds, "s / iteration"), (axes[1], over, "iteration / fio, same bytes")):
        series = {n: v for n, v in series.items() if any(x is not None for x in v)}
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, [v or 0 for v in values], width, label=name)
            ax.bar_label(bars, labels=["" if v is None else f"{v:.2f}" for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(groups)), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    axes[1].axhline(1.0, color="k", lw=0.8, ls="--")
    model = record["meta"]["model"]
    fig.suptitle(f"GPT {model['layers']} x d {model['d_model']}, micro-batch 1 x {SEQ}, params + optimizer on NVMe; "
                 f"median of {record['meta']['iters']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figures(record: dict) -> list:
    """The headline, per dtype: k=1 over fio moving the same bytes, the largest k over its floor
    (issue 21: 1.3x), DeepSpeed over ours at k=4."""
    m, ratios = record["meta"], summary(record)
    when = m.get("when", m["started"])
    out = []
    for dtype in record["compute"]:
        s = ratios.get(f"ours {dtype} k=1", {})
        if "over_fio_same_bytes" in s:
            out.append(harness.Figure(f"{dtype} k=1: iteration / fio moving the same bytes",
                                      f"**{s['over_fio_same_bytes']:.2f}x**", when=when))
        top = max((r["k"] for r in record["runs"] if (r["contender"], r["dtype"]) == ("ours", dtype) and _ok(r)),
                  default=None)
        s = ratios.get(f"ours {dtype} k={top}", {})
        if top and top > 1 and "over_floor" in s:
            out.append(harness.Figure(f"{dtype} k={top}: iteration / its floor", f"**{s['over_floor']:.2f}x**",
                                      "≤ 1.3x (issue 21)", s["over_floor"] <= 1.3, when))
        s = ratios.get(f"ours {dtype} k=4", {})
        if "ds_over_ours" in s:
            ours_rss, ds_rss = s["peak_rss_ours_ds_bytes"]
            out.append(harness.Figure(f"{dtype} k=4: DeepSpeed (parameters in host memory) / ours, peak RSS "
                                      f"{ds_rss / GiB:.2f} / {ours_rss / GiB:.2f} GiB", f"**{s['ds_over_ours']:.2f}x**",
                                      when=when))
    return out


def markdown(record: dict, png: str | None, notes=()) -> str:
    m = record["meta"]
    doc = "\n\n".join(par.replace("\n", " ") for par in
                        __doc__.split("[Note: what is measured]", 1)[1].strip().split("\n\n"))
    fios = [r["fio"] for r in record["runs"] if r.get("fio", {}).get("mem")] + list(record["fio_min"].values())
    mems = sorted({f["mem"] for f in fios if "mem" in f})
    body = [f"Latest run: {m['started']}, commit {m['commit']}; {m['nproc']} CPUs, "
            f"{m['ram_bytes'] / GiB:.0f} GiB RAM, disk {m['disk']}, {m['fio']}; load average {m['load_start']} at the "
            f"start, {m['load_end']} at the end; {m['elapsed_s']} s in all."
            + (" **Quick run (--quick): a small model, a smoke test, not a measurement.**" if m["quick"] else ""), "",
            doc, "",
            f"fio's memory: {', '.join(mems) or '—'}. bytes / minimum: (read + written) over the minimum's. floor: fio's "
            f"time for one step's minimum bytes + k x the in-memory compute of one micro-batch. how: `train_batch` or "
            f"the micro-batch loop.", "", *table(record), "", *verdicts(record), *[f"- {n}" for n in notes], ""]
    if png:
        body += [f"![I/O-bound iterations]({os.path.basename(png)})", ""]
    return "\n".join(body)


def write_outputs(record: dict, args) -> None:
    rows = table(record)
    print("\n".join(rows + [""] + verdicts(record)))
    png = args.png or (os.path.join(os.path.dirname(os.path.abspath(args.results_md)), "io_bound.png")
           if args.results_md else None)
    harness.publish(record, args.results_md, SECTION, png, chart, figures,
                    lambda r, p: markdown(r, p, args.note))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (4 layers x d 256), k 1 and 4: a smoke test")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="micro-batches per iteration (default 1 4 16; "
                   "--quick: 1 4)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(MIN_BYTES))
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS,
                   help="ds-params-nvme runs once (the first dtype, k 4) to record how DeepSpeed fails")
    p.add_argument("--train-batch", choices=("auto", "yes", "no"), default="auto",
                   help="engine.train_batch(micro_batches) where the engine has it (auto; DeepSpeed 0.19.8 has none), always (yes: an "
                        "engine without it fails), or the micro-batch loop (no)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3, help="measured iterations (the median is reported)")
    p.add_argument("--compute-iters", type=int, default=20, help="plain torch micro-batches timed (median)")
    p.add_argument("--fio-runs", type=int, default=3, help="fio runs per byte count (the fastest is kept)")
    p.add_argument("--fio-file-cap", type=int, default=8 * GiB,
                   help="largest fio file; more bytes wrap around it (fio's io_size)")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="swap files and fio files go under it")
    p.add_argument("--ds-python", default="/opt/dsvenv/bin/python", help="python of a venv with deepspeed==0.19.8")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per contender")
    p.add_argument("--out", help="JSON of the run")
    p.add_argument("--results-md", help="replace this file's section (e.g. bench/RESULTS.md)")
    p.add_argument("--png", help="the chart (default: io_bound.png beside --results-md)")
    p.add_argument("--note", action="append", default=[], help="a line for RESULTS.md (repeatable)")
    p.add_argument("--render", metavar="JSON", help="only write --results-md / --png from a saved --out")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        print(json.dumps(child_compute(spec) if kind == "compute" else child_train(spec)), flush=True)
        return 0
    if args.render:
        with open(args.render) as f:
            write_outputs(json.load(f), args)
        return 0
    args.ks = args.ks or ([1, 4] if args.quick else [1, 4, 16])
    args.argv = argv
    record = run(args)
    if args.out:
        save(record, args.out)
        print(f"wrote {args.out}")
    write_outputs(record, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
