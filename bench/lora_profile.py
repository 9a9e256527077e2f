"""Where a LoRA iteration's time goes that is not the disk's: bench/lora.py's stand-in, profiled.

    python -m bench.lora_profile --dtype fp32 --flag --out bench/out/lora_profile.json
    python -m bench.lora_profile --quick                  # a small model, a smoke run
    python -m bench.lora_profile --flag --d-model 64 --nvme-dir /dev/shm   # the 339 units' own cost

On a GPU the quantized base's iteration took 2.4x the disk's time for its bytes (bench/gpu_runs/,
the lora stage): about 0.2 s an iteration went to something other than the reads. This script
takes one run of bench/lora.py's child configuration (``--dtype``, ``--flag`` for
``zero_quantized_nontrainable_weights``) and, after ``--warmup`` iterations:

- ``--iters`` iterations timed phase by phase (the device synchronized at each phase's end) while
  bench/step_timeline.py's sampler reads the disk's counters every millisecond: per phase the
  seconds, the engine's time blocked on reads, and the time the disk had nothing in flight;
  every parameter fetch timed (its wait for the read and the decode);
- the same number of iterations under cProfile (the main thread): the functions with the most
  time of their own and the most time below them.

The JSON (``--out``) holds all of it; a summary goes to stdout. Nothing is written to RESULTS.md:
it is a tool for finding the cost, not a figure.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import shutil
import statistics
import tempfile
import time

from bench import harness, lora, step_timeline
from bench.io_bound import MODEL

PHASES = ("forward", "backward", "step", "flush")


def _sync(engine):
    import torch

    if str(engine.device).startswith("cuda"):
        torch.cuda.synchronize(engine.device)


def timed_fetches(store, names):
    """Wraps ``store.fetch``: each call's unit, start and seconds (the read's wait and the decode)."""
    calls = []
    fetch = store.fetch

    def timed(layout, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fetch(layout, *args, **kwargs)
        finally:
            calls.append((names[layout.index], t0, time.perf_counter() - t0))
    store.fetch = timed
    return calls


def timeline(engine, x, y, iters: int, nvme: str) -> dict:
    store = engine.parts.param_store
    names = {u.index: u.module_name or "<root>" for u in store.rank_layout.units}
    calls = timed_fetches(store, names)
    disk = step_timeline.block_device(nvme)
    if not os.path.exists(f"/sys/block/{disk}/stat"):  # tmpfs: no disk to watch
        disk = None
    sampler = step_timeline.Sampler(disk, 0.001, step_timeline.engine_waits(engine)) if disk else None
    holder, spans = {}, []
    steps = {"forward": lambda: holder.update(loss=engine(x, y)), "backward": lambda: engine.backward(holder["loss"]),
             "step": engine.step, "flush": store.flush}
    waits = step_timeline.engine_waits(engine)
    blocked = {name: 0.0 for name in PHASES}
    if sampler:
        sampler.start()
    for _ in range(iters):
        for name in PHASES:
            if sampler:
                sampler.phase = name
            t0, w0 = time.perf_counter(), waits()[0]
            steps[name]()
            _sync(engine)
            spans.append((name, t0, time.perf_counter()))
            blocked[name] += waits()[0] - w0
        if sampler:
            sampler.phase = "between"
    samples = sampler.stop() if sampler else []
    del store.fetch  # the class's again
    per_phase = {}
    for name in PHASES:
        mine = [(a, b) for n, a, b in spans if n == name]
        seconds = sum(b - a for a, b in mine)
        idle = 0.0
        for prev, cur in zip(samples, samples[1:]):  # the disk idle: no request in flight at either end
            if any(a <= cur["t"] <= b for a, b in mine):
                if sum(prev["in_flight"]) == 0 and sum(cur["in_flight"]) == 0:
                    idle += cur["t"] - prev["t"]
        fetched = [(u, t0, s) for u, t0, s in calls if any(a <= t0 <= b for a, b in mine)]
        per_phase[name] = {"seconds": round(seconds / iters, 4),
                           "disk_idle_s": round(idle / iters, 4) if sampler else None,
                           "blocked_s": round(blocked[name] / iters, 4), "fetches": len(fetched) // iters,
                           "fetch_s": round(sum(s for _, _, s in fetched) / iters, 4)}
    longest = sorted(calls, key=lambda c: -c[2])[:15]
    return {"phases": per_phase, "longest_fetches": [(u, round(s * 1e3, 2)) for u, _, s in longest],
            "fetch_ms_median": round(statistics.median(s for _, _, s in calls) * 1e3, 3) if calls else None}


def profiled(engine, x, y, iters: int, top: int) -> dict:
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(iters):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.parts.param_store.flush()
        _sync(engine)
    prof.disable()
    wall = (time.perf_counter() - start) / iters
    out = {"seconds_per_iteration": round(wall, 4)}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats(key).print_stats(top)
        out[key] = text.getvalue()
    return out


def run(args) -> dict:
    model = dict(lora.QUICK_MODEL) if args.quick else dict(MODEL)
    if args.d_model:  # the same units, less to compute and read: what the hooks cost (bench/lora.py scales the split)
        model["d_model"] = args.d_model
    nvme = tempfile.mkdtemp(prefix="lora-profile-", dir=args.nvme_dir)
    try:
        spec = {"dtype": args.dtype, "flag": args.flag, "model": model, "nvme_path": nvme}
        ex, engine, _ = lora._engine(spec)
        cfg = ex.GPTConfig(**model)
        x, y = ex.make_batches(dataclasses.replace(cfg, seq=lora.SEQ), 1, 1)[0]
        for _ in range(args.warmup):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        engine.parts.param_store.flush()
        harness.settled_io()
        record = {"spec": {k: v for k, v in spec.items() if k != "nvme_path"}, "device": str(engine.device),
                  "units": len(engine.parts.units), "quantized_units": len(engine.frozen_shards.units),
                  "timeline": timeline(engine, x, y, args.iters, nvme),
                  "profile": profiled(engine, x, y, args.iters, args.top)}
        engine.destroy()
        return record
    finally:
        shutil.rmtree(nvme, ignore_errors=True)


def summary(record: dict) -> str:
    lines = [f"{record['device']}, {record['spec']}, {record['units']} units ({record['quantized_units']} quantized)"]
    for name, p in record["timeline"]["phases"].items():
        idle = "no disk watched" if p["disk_idle_s"] is None else f"disk idle {p['disk_idle_s']:.4f} s"
        lines.append(f"  {name:8s} {p['seconds']:.4f} s; blocked on reads {p['blocked_s']:.4f} s; {idle}; "
                     f"{p['fetches']} fetches taking {p['fetch_s']:.4f} s")
    lines.append(f"  median fetch {record['timeline']['fetch_ms_median']} ms; longest (ms): "
                 + ", ".join(f"{u} {ms}" for u, ms in record["timeline"]["longest_fetches"]))
    lines.append(f"  under cProfile: {record['profile']['seconds_per_iteration']} s an iteration")
    return "\n".join(lines + [record["profile"]["tottime"], record["profile"]["cumulative"]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--flag", action="store_true", help="zero_quantized_nontrainable_weights")
    p.add_argument("--quick", action="store_true", help="bench/lora.py's small model")
    p.add_argument("--d-model", type=int, help="another width (e.g. 64: the units' overhead alone)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=30, help="functions listed per cProfile table")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--out", help="JSON of the run")
    args = p.parse_args(argv)
    record = run(args)
    harness.save_json(record, args.out, indent=1)
    print(summary(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
