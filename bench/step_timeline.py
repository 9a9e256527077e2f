"""Where an I/O-bound step's time goes: the disk's reads and writes over time, against the step's phases.

    python -m bench.step_timeline --results-md bench/RESULTS.md        # 311M, k = 1, fp32
    python -m bench.step_timeline --quick                              # a small model, a smoke run

The stand-in of bench/io_bound.py (the 311M GPT of zero.examples, batch 1 x 8 tokens,
parameters and optimizer states on NVMe) trains a few iterations while a sampler thread
reads the block device's counters every ``--interval`` ms (/sys/block/<dev>/stat:
sectors read and written, and the time the device had requests in flight; .../inflight:
reads and writes in flight) together with the phase the main thread is in (forward,
backward, step, or between) and the engine's time blocked on NVMe reads and writes.

Per phase it reports the seconds, the bytes this process read and wrote (/proc/self/io),
the time the disk was busy (io_ticks: any request in flight, from any process: run it on a
quiet machine) and idle, and the time the engine waited on reads and
on writes. A disk idle while the step runs is time the floor does not have; a phase
reading at a fraction of the disk's read speed while it waits on reads is one whose
reads are not deep enough. The samples go to the JSON (``--json``), a chart of read
and write throughput over time with the phases behind it to ``bench/step_timeline.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time

from bench import harness, io_bound  # io_bound: the stand-in's model and config

HERE = os.path.dirname(os.path.abspath(__file__))

SECTION = "## Step timeline (bench/step_timeline.py)"
PHASES = ("forward", "backward", "step", "between")


def block_device(path: str) -> str:
    """The /sys/block name of the disk holding ``path`` (a partition's parent disk)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    link = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
    if os.path.exists(os.path.join(link, "partition")):
        link = os.path.dirname(link)
    return os.path.basename(link)


class Sampler:
    """Every ``interval`` s: the disk's counters, the main thread's phase and the engine's waits."""

    def __init__(self, disk: str, interval: float, waits):
        self.stat = f"/sys/block/{disk}/stat"
        self.inflight = f"/sys/block/{disk}/inflight"
        self.interval = interval
        self.waits = waits  # () -> (read wait s, write wait s) so far
        self.phase = "between"
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict:
        with open(self.stat) as f:
            s = f.read().split()
        with open(self.inflight) as f:
            r, w = f.read().split()
        io = harness.proc_io()
        read_wait, write_wait = self.waits()
        # bytes: this process's (/proc/self/io); busy: the device's io_ticks (stat field 9, ms with
        # requests in flight), which counts every process's requests
        return {"t": time.perf_counter(), "phase": self.phase, "read": io["read_bytes"],
                "written": io["write_bytes"] - io["cancelled_write_bytes"], "busy_ms": int(s[9]),
                "in_flight": (int(r), int(w)), "read_wait": read_wait, "write_wait": write_wait}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            self._stop.wait(self.interval)

    def start(self) -> None:
        self.samples.append(self._sample())
        self._thread.start()

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._sample())
        return self.samples


def engine_waits(engine):
    stores = [engine.parts.param_store, engine.parts.optimizer_store]

    def waits():
        return (sum(getattr(s, "read_wait_seconds", 0.0) for s in stores if s is not None),
                sum(getattr(s, "write_wait_seconds", 0.0) for s in stores if s is not None))
    return waits


ENGINE_PHASES = {"forward": "forward", "backward": "backward", "optimizer": "step"}


def sample_engine_phases(engine, sampler) -> None:
    """train_batch runs its window's forwards, backwards and step inside the engine: the sampler
    takes the phase from the engine's timers (wall_clock_breakdown's), the outermost one."""
    timed = engine.timers.phase

    @contextlib.contextmanager
    def phase(name):
        outer = sampler.phase
        if outer == "between" and name in ENGINE_PHASES:
            sampler.phase = ENGINE_PHASES[name]
        try:
            with timed(name):
                yield
        finally:
            sampler.phase = outer
    engine.timers.phase = phase


def train(model: dict, k: int, dtype: str, iters: int, warmup: int, nvme: str, interval: float,
          checksum: str = "auto", loop: bool = False) -> dict:
    import torch

    import zero
    from zero import examples as ex

    cfg = ex.GPTConfig(**model)
    conf = io_bound.config("ours", dtype, k, nvme)
    for key in ("offload_param", "offload_optimizer"):
        conf["zero_optimization"][key]["checksum"] = checksum
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=conf):
        gpt = ex.GPT(cfg)
    engine, _, _, _ = zero.initialize(model=gpt, config=conf)
    micro_batches = ex.make_batches(dataclasses.replace(cfg, seq=io_bound.SEQ), k, 1)
    sampler = Sampler(block_device(nvme), interval, engine_waits(engine))

    def phase(name, fn, *args):
        sampler.phase = name
        try:
            return fn(*args)
        finally:
            sampler.phase = "between"

    def iteration():
        if k > 1 and not loop:
            engine.train_batch(micro_batches)  # its phases come from the engine's timers (below)
            return
        for x, y in micro_batches:
            loss = phase("forward", engine, x, y)
            phase("backward", engine.backward, loss)
            phase("step", engine.step)

    if k > 1 and not loop:
        sample_engine_phases(engine, sampler)

    for _ in range(warmup):
        iteration()
    harness.settled_io()
    bounds = []
    sampler.start()
    for _ in range(iters):
        t0 = time.perf_counter()
        iteration()
        bounds.append((t0, time.perf_counter()))
    harness.settled_io()
    samples = sampler.stop()
    engine.destroy()
    return {"samples": samples, "iterations": bounds,
            "params": sum(int(getattr(p, "ds_numel", p.numel())) for p in gpt.parameters())}


def summarise(run: dict) -> dict:
    """Per phase over the measured iterations: seconds, bytes, disk busy and idle, engine waits.
    The tail after the last iteration (writes landing) counts as "between"."""
    per = {p: dict(seconds=0.0, read=0, written=0, busy_s=0.0, read_wait=0.0, write_wait=0.0, idle_s=0.0)
           for p in PHASES}
    samples = run["samples"]
    for a, b in zip(samples, samples[1:]):
        d = per[a["phase"]]
        dt = b["t"] - a["t"]
        busy = min(dt, (b["busy_ms"] - a["busy_ms"]) / 1000.0)
        d["seconds"] += dt
        d["read"] += b["read"] - a["read"]
        d["written"] += b["written"] - a["written"]
        d["busy_s"] += busy
        d["idle_s"] += dt - busy
        d["read_wait"] += b["read_wait"] - a["read_wait"]
        d["write_wait"] += b["write_wait"] - a["write_wait"]
    n = len(run["iterations"])
    iteration_s = sum(b - a for a, b in run["iterations"]) / n
    return {"iterations": n, "iteration_s": iteration_s,
            "per_iteration": {p: {k: v / n for k, v in d.items()} for p, d in per.items()}}


def table(summary: dict, fio_s) -> list:
    gib = 1 << 30
    rows = ["| phase | s / iteration | GiB read | GiB written | disk busy s | disk idle s | read GiB/s | "
            "write GiB/s | engine read wait s | engine write wait s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = {k: 0.0 for k in ("seconds", "read", "written", "busy_s", "idle_s", "read_wait", "write_wait")}
    for p, d in summary["per_iteration"].items():
        for k in total:
            total[k] += d[k]
        s = d["seconds"] or 1e-9
        rows.append(f"| {p} | {d['seconds']:.2f} | {d['read'] / gib:.2f} | {d['written'] / gib:.2f} | "
                    f"{d['busy_s']:.2f} | {d['idle_s']:.2f} | {d['read'] / gib / s:.2f} | {d['written'] / gib / s:.2f} | "
                    f"{d['read_wait']:.2f} | {d['write_wait']:.2f} |")
    s = total["seconds"] or 1e-9
    rows.append(f"| **all** | {total['seconds']:.2f} | {total['read'] / gib:.2f} | {total['written'] / gib:.2f} | "
                f"{total['busy_s']:.2f} | {total['idle_s']:.2f} | {total['read'] / gib / s:.2f} | "
                f"{total['written'] / gib / s:.2f} | {total['read_wait']:.2f} | {total['write_wait']:.2f} |")
    if fio_s:
        rows.append(f"| fio, the same bytes at once (fastest of its runs) | {fio_s:.2f} | | | | | | | | |")
    return rows


def chart(run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = run["samples"]
    t0 = samples[0]["t"]
    colors = {"forward": "#cfe8ff", "backward": "#ffe0c2", "step": "#d9f2d0", "between": "#ffffff"}
    fig, ax = plt.subplots(figsize=(11, 3.6))
    xs, rd, wr = [], [], []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if a["phase"] != "between":
            ax.axvspan(a["t"] - t0, b["t"] - t0, color=colors[a["phase"]], lw=0)
        if dt > 0:
            xs.append(a["t"] - t0)
            rd.append((b["read"] - a["read"]) / dt / 2 ** 30)
            wr.append((b["written"] - a["written"]) / dt / 2 ** 30)
    ax.plot(xs, rd, lw=0.8, label="read GiB/s", color="#1f5fa8")
    ax.plot(xs, wr, lw=0.8, label="write GiB/s", color="#c0392b")
    handles, labels = ax.get_legend_handles_labels()
    from matplotlib.patches import Patch

    handles += [Patch(color=colors[p], label=p) for p in ("forward", "backward", "step")]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB/s")
    ax.set_title("disk throughput over the measured iterations, phases behind")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (a smoke run)")
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--loop", action="store_true",
                   help="k > 1: the micro-batch loop (forward/backward/step k times) instead of train_batch")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--checksum", default="auto", help="offload_*.checksum (auto: xxhash, the default)")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--json")
    p.add_argument("--results-md")
    args = p.parse_args(argv)
    model = io_bound.QUICK_MODEL if args.quick else io_bound.MODEL
    work = tempfile.mkdtemp(prefix="step-timeline-", dir=args.nvme_dir)
    meta = harness.provenance(args.nvme_dir)
    try:
        run = train(model, args.k, args.dtype, args.iters, args.warmup, work, args.interval_ms / 1000,
                    args.checksum, loop=args.loop)
        summary = summarise(run)
        per = summary["per_iteration"]
        read = int(sum(d["read"] for d in per.values()))
        written = int(sum(d["written"] for d in per.values()))
        fio = harness.fio_reference(read, written, work, args.fio_runs) if read or written else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fio_s = fio.get("seconds")
    rows = table(summary, fio_s)
    print("\n".join(rows))
    record = {**meta, "load_end": harness.load_average(), "model": model, "k": args.k, "dtype": args.dtype,
              "params": run["params"], "summary": summary, "fio": fio,
              "command": "python -m bench.step_timeline " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**record, "samples": run["samples"], "iterations": run["iterations"]}, f)
    png = os.path.join(HERE, "step_timeline.png")
    chart(run, png)
    if args.results_md:
        ratio = summary["iteration_s"] / fio_s if fio_s else None
        details = [f"Run {meta['started']}, commit {meta['commit']}; load average {meta['load_start']} at the start, "
                   f"{record['load_end']} at the end. {run['params'] / 1e6:.0f}M parameters, k = {args.k}, {args.dtype}, "
                   f"{summary['iterations']} measured iterations of {summary['iteration_s']:.2f} s"
                   + (f"; the iteration is **{ratio:.2f}x** fio's time" if ratio else "")
                   + f"; the disk sampled every {args.interval_ms:g} ms. Per iteration:", "", *rows, "",
                   "![step timeline](step_timeline.png)"]
        idle, seconds = sum(d["idle_s"] for d in per.values()), sum(d["seconds"] for d in per.values())
        figures = [harness.Figure(f"{run['params'] / 1e6:.0f}M, k = {args.k}, {args.dtype}: iteration / fio moving the "
                                  "same bytes", f"**{ratio:.2f}x**" if ratio else "—", when=meta["when"]),
                   harness.Figure("disk idle per iteration (all phases, the writes landing after it included)",
                                  f"{idle:.2f} of {seconds:.2f} s", when=meta["when"])]
        harness.write_section(args.results_md, SECTION, figures, record["command"], "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
