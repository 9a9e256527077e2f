"""LoRA on a frozen base on NVMe, with and without ``zero_quantized_nontrainable_weights``.

    flock /tmp/bench.lock python -m bench.lora --out bench/out/lora.json --results-md bench/RESULTS.md
    python -m bench.lora --quick                     # smoke test, a small model, ~1 min
    python -m bench.lora --render bench/out/lora.json --results-md bench/RESULTS.md
    flock /tmp/bench.lock python -m bench.lora --optimizer nvme --out bench/out/lora_nvme_optimizer.json \
        --results-md bench/RESULTS.md               # AdamW's state on NVMe too (ZeRO-Infinity)

[Note: what is measured]
The LoRA stand-in: the 311M GPT of ``zero.examples`` (bench/io_bound.py's: vocab 8192, 24 layers x
d_model 1024, 128 positions, tied head) with ``zero.examples.add_lora`` (rank 8 adapters on every
block's qkv, proj, fc and out; every other parameter frozen), micro-batches of 1 x 8 tokens, one
optimizer step per iteration. Stage 3, the parameters on NVMe (``max_in_cpu`` 0, ``buffer_size``
2e7, bench/io_bound.py's aio settings; DeepSpeed's persistence threshold, 1e5 elements, and
smallest partition on NVMe, 1 MiB, so the adapters and layer norms stay gathered and in host
memory while the base weights are read; a smaller model's both scaled with d_model squared),
AdamW in host memory (``offload_optimizer`` cpu: the
trainable adapters are 0.6% of the model). Each of fp32 and bf16 compute runs without and with
``zero_quantized_nontrainable_weights`` (the frozen base int8 with an fp32 scale per 256 elements,
zero/stores/quantized.py), in a fresh process: bytes per iteration are the parameter swapper's own
counters (``io_bytes``: what it read and wrote) and the process's ``/proc/self/io`` around each
iteration; seconds the median of ``--iters`` after ``--warmup``. The frozen base is read once per
iteration (the default ``stage3_max_reuse_distance`` keeps a unit gathered from its forward to its
backward) and never written (a step writes back only the units it can change); with the flag each
fetch also dequantizes on the CPU (one vectorised native pass, zero/stores/quantized.py [Note: dequantizing
on the host]; before it torch's ops took about 8 ns per element here). Each row also has fio's best time for
its bytes (one read and one write job at once, bench/harness.py ``fio_reference``): the iteration's
floor where it is I/O-bound. The loss check trains a smaller LoRA model (4 layers x d_model 256, vocab 512, batch 4 x 64
tokens, rank 8, lr 1e-3) for ``--loss-steps`` steps on NVMe with and without the flag, from the
same weights and batches, and compares the losses step by step.

With ``--optimizer nvme`` the fp32 master and AdamW's states go to NVMe as well (``offload_optimizer``
nvme, ZeRO-Infinity's whole recipe): they cover the adapters only (zero/stores/layouts.py [Note: the
optimizer covers the trainable units only]), so each step reads and writes the adapters' 16 bytes a
parameter besides the base's reads; read / written count both swappers, the optimizer's also apart.

With ``--mib-per-s R`` the swap files go to one simulated drive of R MiB/s read and write
(tools/sim_drives.py [Note: a throttled loop device stands in for a drive]; set up and torn down by
the run, as root), the regime a GPU sees with a real one: this CPU computes the stand-in ~100x
slower than a GPU, so on the real disk here its quantized iteration is bound by compute, not by
its reads. Each row's floor is then fio's sequential read and write of that drive (O_DIRECT,
io_uring, 8 MiB blocks, iodepth 32, in the throttled group), one after the other, for the row's
bytes; the loss check is left to the unthrottled run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

from bench import harness, training
from bench.io_bound import AIO, MODEL, SEQ, scaled

SECTION = "## LoRA on a quantized frozen base (bench/lora.py)"
SECTIONS = {"cpu": SECTION, "nvme": "## LoRA with the optimizer on NVMe too (bench/lora.py --optimizer nvme)",
            "slow": "## LoRA on a slow drive (bench/lora.py --mib-per-s)"}
QUICK_MODEL = dict(vocab=8192, d_model=256, heads=4, layers=4, seq=128, tie=True)
LOSS_MODEL = dict(vocab=512, d_model=256, heads=4, layers=4, seq=64, tie=True)
LOSS_BATCH = 4
RANK = 8
GOALS = {"fp32": 0.3, "bf16": 0.55}  # bytes / iteration with the flag over without (issue 32)
LOSS_GOAL = 0.01
GiB = harness.GiB


def config(dtype: str, flag: bool, nvme_path: str, lr: float = 1e-4, micro: int = 1, d_model: int = 1024,
           optimizer: str = "cpu") -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "bf16": {"enabled": dtype == "bf16"}, "aio": AIO, "steps_per_print": 10 ** 6,
            "zero_optimization": {
                "stage": 3, "sub_group_size": int(2e7), "zero_quantized_nontrainable_weights": flag,
                "stage3_param_persistence_threshold": scaled(100_000, d_model),
                "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_size": int(2e7),
                                  "max_in_cpu": 0, "min_swap_bytes": scaled(1 << 20, d_model)},
                "offload_optimizer": {"device": optimizer, **({"nvme_path": nvme_path} if optimizer == "nvme" else {})}}}


def _engine(spec: dict, lr: float = 1e-4, micro: int = 1):
    import torch

    import zero

    ex = training.examples()
    conf = config(spec["dtype"], spec["flag"], spec["nvme_path"], lr, micro, spec["model"]["d_model"],
                  spec.get("optimizer", "cpu"))
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=conf):
        model = ex.GPT(ex.GPTConfig(**spec["model"]))
    torch.manual_seed(1)
    ex.add_lora(model, rank=RANK)
    engine, _, _, _ = zero.initialize(model=model, config=conf)
    return ex, engine, model


def child_iterations(spec: dict) -> dict:
    _join(spec)
    t0 = time.perf_counter()
    ex, engine, model = _engine(spec)
    init_s = time.perf_counter() - t0
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    cfg = ex.GPTConfig(**spec["model"])
    x, y = ex.make_batches(dataclasses.replace(cfg, seq=SEQ), 1, 1)[0]
    counts = engine.parts.param_store.swapper.io_bytes
    opt_swapper = getattr(engine.parts.optimizer_store, "swapper", None)  # offload_optimizer nvme
    opt_counts = opt_swapper.io_bytes if opt_swapper is not None else types.SimpleNamespace(read=0, written=0)
    times, swap_r, swap_w, opt_r, opt_w, reads, writes, losses = [], [], [], [], [], [], [], []
    w = spec["warmup"]
    for i in range(w + spec["iters"]):
        io0 = harness.settled_io() if i == w else harness.proc_io()
        c0 = (counts.read, counts.written, opt_counts.read, opt_counts.written)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.parts.param_store.flush()  # this iteration's writes count in it
        if opt_swapper is not None:
            opt_swapper.synchronize()
        times.append(time.perf_counter() - start)
        io1 = harness.settled_io() if i == w + spec["iters"] - 1 else harness.proc_io()
        opt_r.append(opt_counts.read - c0[2])
        opt_w.append(opt_counts.written - c0[3])
        swap_r.append(counts.read - c0[0] + opt_r[-1])
        swap_w.append(counts.written - c0[1] + opt_w[-1])
        reads.append(io1["read_bytes"] - io0["read_bytes"])
        writes.append((io1["write_bytes"] - io1["cancelled_write_bytes"]) - (io0["write_bytes"] - io0["cancelled_write_bytes"]))
        losses.append(float(loss.detach()))
    return {"params": params, "phases": profiled_iteration(engine, x, y), "trainable": trainable, "init_s": round(init_s, 1),
            "quantized_units": len(engine.frozen_shards.units), "units": len(engine.parts.units),
            "nvme_bytes": engine.parts.param_store.swapper.nvme_bytes,
            "optimizer_nvme_bytes": opt_swapper.nvme_bytes if opt_swapper is not None else 0,
            "optimizer_read_bytes": int(statistics.mean(opt_r[w:])),
            "optimizer_write_bytes": int(statistics.mean(opt_w[w:])),
            "median_s": statistics.median(times[w:]), "times_s": [round(t, 3) for t in times],
            "swap_read_bytes": int(statistics.mean(swap_r[w:])), "swap_write_bytes": int(statistics.mean(swap_w[w:])),
            "read_bytes": int(statistics.mean(reads[w:])), "write_bytes": int(statistics.mean(writes[w:])),
            "losses": losses, "peak_rss_bytes": harness.status_bytes("VmHWM")}


def profiled_iteration(engine, x, y) -> dict:
    """One more iteration, after the measured ones, timed phase by phase (the device synchronized at
    each phase's end, so each phase holds the work it queued): forward, backward, step and the
    writes' flush; beside them the seconds blocked on NVMe and the busiest thread's CPU seconds."""
    import torch

    from bench.io_bound import blocked_seconds

    def sync():
        if str(engine.device).startswith("cuda"):
            torch.cuda.synchronize(engine.device)

    out, holder = {}, {}
    blocked0, threads0 = blocked_seconds(engine), harness.thread_cpu()
    for name, phase in (("forward", lambda: holder.update(loss=engine(x, y))),
                        ("backward", lambda: engine.backward(holder["loss"])), ("step", engine.step),
                        ("flush", engine.parts.param_store.flush)):
        start = time.perf_counter()
        phase()
        sync()
        out[name] = round(time.perf_counter() - start, 4)
    out["blocked"] = round(blocked_seconds(engine) - blocked0, 4)
    out["busiest_thread"] = list(harness.busiest_thread(threads0, harness.thread_cpu()))
    return out


def _join(spec: dict) -> None:
    """With ``--mib-per-s``: this child's I/O to the simulated drive is held to its speed."""
    if spec.get("cgroup"):
        from tools.sim_drives import join

        join(spec["cgroup"], os.getpid())


def child_fio(spec: dict) -> dict:
    """fio's sequential write and read of the simulated drive, in its throttled group."""
    from bench import drives

    _join(spec)
    return drives.child_fio(spec)


def child_losses(spec: dict) -> dict:
    ex, engine, model = _engine(spec, lr=1e-3, micro=LOSS_BATCH)
    cfg = ex.GPTConfig(**spec["model"])
    losses = []
    for x, y in ex.make_batches(cfg, spec["steps"], LOSS_BATCH, seed=3):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses}


# -- the run ---------------------------------------------------------------------------------------

def run_child(kind: str, spec: dict, timeout: int) -> dict:
    return harness.run_child("bench.lora", ["--child", kind, json.dumps(spec)], None, timeout)


def run(args) -> dict:
    model = QUICK_MODEL if args.quick else MODEL
    root = tempfile.mkdtemp(prefix="lora-", dir=args.nvme_dir)
    record = {"meta": {**harness.provenance(args.nvme_dir), "command": "python -m bench.lora " + " ".join(args.argv),
                       "quick": args.quick, "model": model, "seq": SEQ, "batch": 1, "rank": RANK,
                       "warmup": args.warmup, "iters": args.iters, "loss_model": LOSS_MODEL,
                       "loss_batch": LOSS_BATCH, "loss_steps": args.loss_steps, "nvme_dir": args.nvme_dir,
                       "optimizer": args.optimizer, "mib_per_s": args.mib_per_s, "log": []},
              "runs": [], "losses": []}

    def log(line: str) -> None:
        print(line, flush=True)
        record["meta"]["log"].append(line)

    try:
        with contextlib.ExitStack() as stack:
            swap_root, floor, cgroup = root, None, None
            if args.mib_per_s:
                from tools.sim_drives import SimulatedDrives

                drive = stack.enter_context(SimulatedDrives(os.path.join(root, "drive"), 1, args.mib_per_s << 20,
                                                            size=args.drive_bytes, log=log))
                swap_root, cgroup = drive.mounts[0], drive.cgroup
                record["drive_fio"] = fio = run_child("fio", {"cgroup": cgroup, "dir": swap_root,
                                                              "nbytes": args.fio_bytes}, args.timeout)
                log(f"fio, the simulated drive: {json.dumps(fio)}")
                if "error" in fio:
                    raise RuntimeError(f"fio on the simulated drive failed: {fio['error']}")
                floor = _drive_floor(fio)
            for dtype in args.dtypes:
                iterations(record, args, dtype, model, swap_root, cgroup, floor or _fio_together(root), log)
                if args.loss_steps:
                    losses(record, args, dtype, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record["meta"].update(load_end=harness.load_average(), elapsed_s=round(time.time() - record["meta"]["t0"]))
    return record


def _drive_floor(fio: dict):
    """A row's floor on the simulated drive: its reads and writes at fio's speeds, one after the other."""
    return lambda r, w: {"seconds": (r / fio["read_gibps"] + w / fio["write_gibps"]) / GiB,
                         "how": "the simulated drive's fio read and write speeds, one after the other"}


def _fio_together(work: str):
    """The disk's best time for a row's bytes: fio's read and write jobs at once, in ``work``."""
    return lambda r, w: harness.fio_reference(r, w, work)


def iterations(record, args, dtype, model, swap_root, cgroup, floor, log) -> None:
    for flag in (False, True):
        swap = tempfile.mkdtemp(dir=swap_root)
        spec = {"dtype": dtype, "flag": flag, "model": model, "nvme_path": swap, "warmup": args.warmup,
                "iters": args.iters, "optimizer": args.optimizer, "cgroup": cgroup}
        row = {"dtype": dtype, "flag": flag, **run_child("iterations", spec, args.timeout)}
        shutil.rmtree(swap, ignore_errors=True)
        if "error" not in row:  # the iteration's floor for its bytes, in this run
            row["fio"] = floor(row["swap_read_bytes"], row["swap_write_bytes"])
        record["runs"].append(row)
        harness.save_json(record, args.out, indent=1)
        log(f"{dtype} flag={flag}: {describe(row)}")


def losses(record, args, dtype, root) -> None:
    for flag in (False, True):
        swap = tempfile.mkdtemp(dir=root)
        spec = {"dtype": dtype, "flag": flag, "model": LOSS_MODEL, "nvme_path": swap, "steps": args.loss_steps,
                "optimizer": args.optimizer}
        row = {"dtype": dtype, "flag": flag, **run_child("losses", spec, args.timeout)}
        shutil.rmtree(swap, ignore_errors=True)
        record["losses"].append(row)
        harness.save_json(record, args.out, indent=1)
    print(f"{dtype} losses: {loss_text(record, dtype)}", flush=True)


def describe(row: dict) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    return (f"{row['median_s']:.3f} s/iteration; swapper read {row['swap_read_bytes'] / GiB:.3f} GiB, wrote "
            f"{row['swap_write_bytes'] / GiB:.4f} GiB; /proc read {row['read_bytes'] / GiB:.3f} GiB, written "
            f"{row['write_bytes'] / GiB:.4f} GiB; on NVMe {row['nvme_bytes'] / GiB:.3f} GiB"
            f"{optimizer_text(row)}; "
            f"peak RSS {row['peak_rss_bytes'] / GiB:.2f} GiB")


def optimizer_text(row: dict) -> str:
    """The optimizer swapper's part of a row (``--optimizer nvme``), or nothing."""
    if not row.get("optimizer_nvme_bytes"):
        return ""
    return (f" (optimizer: read {row['optimizer_read_bytes'] / GiB:.4f}, wrote {row['optimizer_write_bytes'] / GiB:.4f} "
            f"GiB an iteration, {row['optimizer_nvme_bytes'] / GiB:.3f} GiB on NVMe)")


# -- the report ------------------------------------------------------------------------------------

def _find(rows, dtype, flag):
    return next((r for r in rows if r["dtype"] == dtype and r["flag"] == flag and "error" not in r), None)


def _bytes(row) -> int:
    return row["swap_read_bytes"] + row["swap_write_bytes"]


def floor_s(row):
    """fio's time for the row's bytes (the I/O-bound floor of its iteration), or None."""
    return (row.get("fio") or {}).get("seconds")


def time_ratios(record: dict, dtype: str):
    """(s / iteration with the flag over without, the disk floors' same ratio), or None."""
    off, on = _find(record["runs"], dtype, False), _find(record["runs"], dtype, True)
    if not off or not on or not floor_s(off) or not floor_s(on):
        return None
    return on["median_s"] / off["median_s"], floor_s(on) / floor_s(off)


def bytes_ratio(record: dict, dtype: str):
    off, on = _find(record["runs"], dtype, False), _find(record["runs"], dtype, True)
    return _bytes(on) / _bytes(off) if off and on else None


def loss_diffs(record: dict, dtype: str):
    """(largest relative difference of a step's loss, relative difference of the last 20 steps' mean)."""
    off, on = _find(record["losses"], dtype, False), _find(record["losses"], dtype, True)
    if not off or not on:
        return None
    a, b = on["losses"], off["losses"]
    step = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    tail = abs(statistics.mean(a[-20:]) - statistics.mean(b[-20:])) / statistics.mean(b[-20:])
    return step, tail, b[0], b[-1]


def loss_text(record: dict, dtype: str) -> str:
    d = loss_diffs(record, dtype)
    if d is None:
        return "failed"
    return (f"largest step difference {d[0] * 100:.2f}%, last 20 steps' mean {d[1] * 100:.3f}% "
            f"(unquantized: {d[2]:.3f} -> {d[3]:.3f})")


def table(record: dict) -> list:
    lines = ["| compute dtype | frozen base | s / iteration | disk's time for its bytes s (fio) | read GiB | "
             "written GiB | bytes / unquantized | /proc read GiB | /proc written GiB | base on NVMe GiB | "
             "peak RSS GiB | optimizer read / written / on NVMe GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in record["runs"]:
        base = "int8 + scales" if row["flag"] else row["dtype"]
        head = f"| {row['dtype']} | {base} |"
        if "error" in row:
            lines.append(head + f" failed: {row['error'].replace('|', '/')} | | | | | | | | | |")
            continue
        off = _find(record["runs"], row["dtype"], False)
        ratio = f"**{_bytes(row) / _bytes(off):.3f}**" if row["flag"] and off else "1"
        floor = f"{floor_s(row):.3f}" if floor_s(row) else "—"
        lines.append(head + f" {row['median_s']:.3f} | {floor} | {row['swap_read_bytes'] / GiB:.3f} | "
                     f"{row['swap_write_bytes'] / GiB:.4f} | {ratio} | {row['read_bytes'] / GiB:.3f} | "
                     f"{row['write_bytes'] / GiB:.4f} | {row['nvme_bytes'] / GiB:.3f} | {row['peak_rss_bytes'] / GiB:.2f} | "
                     f"{_optimizer_cells(row)} |")
    return lines


def _optimizer_cells(row: dict) -> str:
    if not row.get("optimizer_nvme_bytes"):
        return "— (host memory)"
    return (f"{row['optimizer_read_bytes'] / GiB:.4f} / {row['optimizer_write_bytes'] / GiB:.4f} / "
            f"{row['optimizer_nvme_bytes'] / GiB:.3f}")


def figures(record: dict) -> list:
    m = record["meta"]
    when = m.get("when", m["started"])
    out = []
    on_nvme = m.get("optimizer", "cpu") == "nvme"  # issue 32's byte goals are for the optimizer in host memory
    for dtype in sorted({r["dtype"] for r in record["runs"]}, key=lambda d: d != "fp32"):
        ratio = bytes_ratio(record, dtype)
        if ratio is not None:
            off, on = _find(record["runs"], dtype, False), _find(record["runs"], dtype, True)
            out.append(harness.Figure(
                f"{dtype} base: bytes / iteration, int8 over {dtype} (s / iteration {on['median_s']:.2f} vs "
                f"{off['median_s']:.2f})", f"**{ratio:.3f}x**",
                "— (issue 32's goal is with the optimizer in host memory)" if on_nvme
                else f"≤ {GOALS[dtype]}x (issue 32)", None if on_nvme else ratio <= GOALS[dtype], when))
            if on_nvme:
                moved = off["optimizer_read_bytes"] + off["optimizer_write_bytes"]
                per_param = moved / off["trainable"]
                out.append(harness.Figure(
                    f"{dtype}: optimizer bytes / iteration per trainable parameter (read + written; "
                    f"{off['params'] / 1e6:.0f}M parameters, {off['trainable'] / 1e6:.2f}M trainable)",
                    f"**{per_param:.1f} B**", "24 B: the adapters' master and 2 states, each way (not every "
                    "parameter's: zero/stores/layouts.py)", per_param <= 24 * 1.02, when))
        t = time_ratios(record, dtype)
        if t is not None:
            off, on = _find(record["runs"], dtype, False), _find(record["runs"], dtype, True)
            bound = [r["median_s"] / floor_s(r) for r in (off, on)]
            regime = ("both I/O-bound" if max(bound) <= 1.15 else
                      f"{bound[0]:.2f}x and {bound[1]:.2f}x their disk times")
            drive = f" on a {m['mib_per_s']} MiB/s drive" if m.get("mib_per_s") else ""
            out.append(harness.Figure(
                f"{dtype}{drive}: s / iteration, int8 over {dtype} base (the disk's time for their bytes: "
                f"{t[1]:.3f}x; unquantized and int8 {regime})", f"**{t[0]:.3f}x**",
                "falls with the bytes where I/O-bound: ≤ 1.15x their ratio (issue 32)",
                None if bound[0] > 1.15 else t[0] <= 1.15 * t[1], when))
        d = loss_diffs(record, dtype)
        if d is not None:
            out.append(harness.Figure(f"{dtype}: LoRA loss over {m['loss_steps']} steps (small model), largest "
                                      f"step difference int8 vs {dtype} base", f"**{d[0] * 100:.2f}%**",
                                      f"≤ {LOSS_GOAL * 100:.0f}% (issue 32)", d[0] <= LOSS_GOAL, when))
    return out


def chart(record: dict, path: str) -> bool:
    plt = harness.pyplot()
    if plt is None:
        return False

    dtypes = sorted({r["dtype"] for r in record["runs"]}, key=lambda d: d != "fp32")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in ((axes[0], "bytes", "GiB / iteration (swapper)"), (axes[1], "median_s", "s / iteration")):
        for i, flag in enumerate((False, True)):
            values = []
            for d in dtypes:
                row = _find(record["runs"], d, flag)
                values.append(None if row is None else (_bytes(row) / GiB if key == "bytes" else row[key]))
            xs = [g + (i - 0.5) * 0.4 for g in range(len(dtypes))]
            bars = ax.bar(xs, [v or 0 for v in values], 0.4, label="int8 + scales" if flag else "compute dtype")
            ax.bar_label(bars, labels=["" if v is None else f"{v:.2f}" for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(dtypes)), [f"{d} compute" for d in dtypes], fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
        ax.legend(fontsize=7, title="frozen base", title_fontsize=7)
    for row in record["losses"]:
        if "losses" in row:
            axes[2].plot(row["losses"], lw=0.8, ls="--" if row["flag"] else "-",
                         label=f"{row['dtype']} {'int8' if row['flag'] else row['dtype']} base")
    if record["losses"]:
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("loss (small model)")
        axes[2].legend(fontsize=7)
    else:
        axes[2].axis("off")
        axes[2].text(0.5, 0.5, "loss check: the unthrottled run", ha="center", fontsize=8)
    m, rate = record["meta"]["model"], record["meta"].get("mib_per_s")
    fig.suptitle(f"LoRA rank {RANK} on GPT {m['layers']} x d {m['d_model']} (base frozen on "
                 f"{f'a {rate} MiB/s drive' if rate else 'NVMe'}), micro-batch 1 x {SEQ}; median of "
                 f"{record['meta']['iters']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(record: dict, png, notes=()) -> str:
    m = record["meta"]
    doc = "\n\n".join(par.replace("\n", " ") for par in
                        __doc__.split("[Note: what is measured]", 1)[1].strip().split("\n\n"))
    runs = [r for r in record["runs"] if "params" in r]
    sizes = (f"{runs[0]['params'] / 1e6:.1f}M parameters, {runs[0]['trainable'] / 1e6:.2f}M trainable; "
             f"{runs[-1]['quantized_units']} of {runs[-1]['units']} units quantized with the flag. ") if runs else ""
    body = [f"Latest run: {m['started']}, commit {m['commit']}; {m['nproc']} CPUs, {m['ram_bytes'] / GiB:.0f} GiB "
            f"RAM, disk {m['disk']}; load average {m['load_start']} at the start, {m['load_end']} at the end; "
            f"{m['elapsed_s']} s in all." + (" **Quick run (--quick): a smoke test.**" if m["quick"] else ""), "",
            doc, "", *_drive_lines(record), sizes + "read / written: the parameter swapper's bytes per iteration; bytes / unquantized: "
            "(read + written) over the same compute dtype's run without the flag.", "", *table(record), "",
            *[f"- {d} losses: {loss_text(record, d)}." for d in sorted({r['dtype'] for r in record['losses']})],
            *[f"- {n}" for n in notes], ""]
    if png:
        body += [f"![LoRA on a quantized base]({os.path.basename(png)})", ""]
    return "\n".join(body)


def _drive_lines(record: dict) -> list:
    fio = record.get("drive_fio")
    if not fio:
        return []
    return [f"The simulated drive ({record['meta']['mib_per_s']} MiB/s, set up and torn down by the run): fio "
            f"wrote it at {fio['write_gibps'] * 1024:.0f} MiB/s and read it at {fio['read_gibps'] * 1024:.0f} "
            f"MiB/s ({fio['write_job']}; {fio['read_job']}).", ""]


def write_outputs(record: dict, args) -> None:
    print("\n".join(table(record)))
    kind = "slow" if record["meta"].get("mib_per_s") else record["meta"].get("optimizer", "cpu")
    name = {"cpu": "lora.png", "slow": "lora_slow_drive.png"}.get(kind, f"lora_{kind}_optimizer.png")
    png = args.png or (os.path.join(os.path.dirname(os.path.abspath(args.results_md)), name)
           if args.results_md else None)
    harness.publish(record, args.results_md, SECTIONS[kind], png, chart, figures,
                    lambda r, p: markdown(r, p, args.note))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (4 layers x d 256), 20 loss steps")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(GOALS))
    p.add_argument("--optimizer", default="cpu", choices=list(SECTIONS),
                   help="where AdamW's master and states live (offload_optimizer device)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--loss-steps", type=int, default=None, help="steps of the loss check (default 200; --quick 20)")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="swap files go under it")
    p.add_argument("--mib-per-s", type=int, default=0,
                   help="swap on one simulated drive of this speed, read and write (root; see the note)")
    p.add_argument("--drive-bytes", type=int, default=8 << 30, help="the simulated drive's size (sparse)")
    p.add_argument("--fio-bytes", type=int, default=1 << 30, help="fio's bytes on the simulated drive")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per child")
    p.add_argument("--out", help="JSON of the run")
    p.add_argument("--results-md", help="replace this file's section (e.g. bench/RESULTS.md)")
    p.add_argument("--png", help="the chart (default: lora.png beside --results-md)")
    p.add_argument("--note", action="append", default=[], help="a line for RESULTS.md (repeatable)")
    p.add_argument("--render", metavar="JSON", help="only write --results-md / --png from a saved --out")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        harness.print_result({"iterations": child_iterations, "fio": child_fio, "losses": child_losses}[kind](spec))
        return 0
    if args.render:
        with open(args.render) as f:
            write_outputs(json.load(f), args)
        return 0
    if args.loss_steps is None:  # a throttled drive changes the seconds, not the losses
        args.loss_steps = 0 if args.mib_per_s else 20 if args.quick else 200
    args.argv = argv
    record = run(args)
    harness.save_json(record, args.out, indent=1)
    write_outputs(record, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
