"""The ZeRO ladder, rung by rung: step time, peak memory and bytes moved of each ZeRO stage and
offload on one model that fits, against plain PyTorch / DDP and DeepSpeed's same rungs.

    flock /tmp/bench.lock python -m bench.ladder                 # 1 and 2 ranks, every rung
    flock /tmp/bench.lock python -m bench.ladder --rounds 3      # each rung 3 times, interleaved
    flock /tmp/bench.lock python -m bench.ladder --model 311m    # the 311M GPT of bench/scale.py
    python -m bench.ladder --quick                                # a small model, to check it runs

Rungs (ours): stage 0, 1, 2, 2 + offload_optimizer cpu, 2 + nvme, 3, 3 + offload cpu (parameters
and optimizer), 3 + nvme; ``torch``: plain PyTorch with fused AdamW on one rank, DDP on two
(the reference). DeepSpeed 0.19.8 (its own venv, ``--ds-python``): stage 1, 2 and 2 +
offload_optimizer cpu with its cpu_adam, its best working configuration for that rung. Every
contender runs in a fresh process (two ranks: two processes on gloo), the same model, data and
config; a step is ``engine(x, y); engine.backward(loss); engine.step()``. Figures: the median of
``--steps`` steps after ``--warmup``, the peak RSS of the largest rank (VmHWM), the bytes each
rank read and wrote (/proc/self/io), and the optimizer-state bytes a rank holds. With
``--rounds R`` every rung runs R times, round after round (so a slow minute of this shared
machine falls on every rung alike), and its step is the median of its rounds' medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench import harness, training

MODELS = {"112m": dict(vocab=8192, d_model=768, heads=12, layers=15, seq=128, tie=True),
          "311m": dict(vocab=8192, d_model=1024, heads=16, layers=24, seq=128, tie=True),
          "quick": dict(vocab=1024, d_model=128, heads=4, layers=2, seq=32, tie=True)}  # to check it runs
MODEL = MODELS["112m"]
BATCH = 2  # sequences per rank
LR = 1e-4
OURS = {  # name: (stage, offload_optimizer, offload_param)
    "stage 0": (0, "none", "none"), "stage 1": (1, "none", "none"), "stage 2": (2, "none", "none"),
    "stage 2 + offload cpu": (2, "cpu", "none"), "stage 2 + offload nvme": (2, "nvme", "none"),
    "stage 3": (3, "none", "none"), "stage 3 + offload cpu": (3, "cpu", "cpu"),
    "stage 3 + offload nvme": (3, "nvme", "nvme"),
}
DEEPSPEED = {"DeepSpeed stage 1": (1, "none"), "DeepSpeed stage 2": (2, "none"),
             "DeepSpeed stage 2 + offload cpu": (2, "cpu")}
SECTION = "## The ZeRO ladder (bench/ladder.py)"
DS_VENV_HOWTO = ("python -m venv /opt/dsvenv && /opt/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8 "
                 "ninja && apt-get install -y libaio-dev")


def config(name: str, nvme_path: str, world: int) -> dict:
    """The same DeepSpeed config dict for ours and DeepSpeed's, but for the rung."""
    conf = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "train_batch_size": BATCH * world, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    if name in DEEPSPEED:
        stage, opt = DEEPSPEED[name]
        zc = {"stage": stage}
        if opt == "cpu":
            zc["offload_optimizer"] = {"device": "cpu"}  # DeepSpeedCPUAdam (built just in time)
        else:
            conf["optimizer"]["params"]["torch_adam"] = True  # its FusedAdam needs CUDA
        conf["zero_optimization"] = zc
        return conf
    stage, opt, param = OURS[name]
    zc = {"stage": stage, "offload_optimizer": {"device": opt}}
    if stage == 3:
        zc["offload_param"] = {"device": param}
    for section in ("offload_optimizer", "offload_param"):
        if zc.get(section, {}).get("device") == "nvme":
            zc[section]["nvme_path"] = nvme_path
    conf["zero_optimization"] = zc
    return conf


# -- one rank's measurement (a child process; two ranks: two of them) -----------------------------------

def _rank(rank: int, world: int, port: int, name: str, shape: dict, steps: int, warmup: int, nvme_path: str,
          out: str) -> None:
    import json

    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    deepspeed = name in DEEPSPEED
    ex = training.examples(deepspeed=deepspeed)
    cfg = ex.GPTConfig(**shape)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, cfg.seq), generator=g)
    torch.manual_seed(0)
    states = 0
    if name == "torch":
        from zero.stores import malloc_settings

        malloc_settings.hold()  # plain torch at its best: the engine's glibc malloc settings too
        model = ex.GPT(cfg)
        if world > 1:
            torch.distributed.init_process_group("gloo")
            model = torch.nn.parallel.DistributedDataParallel(model)
        step = training.torch_step(model, x, y, LR)
        states = 12 * sum(p.numel() for p in model.parameters())  # master is the model; exp_avg, exp_avg_sq
    elif deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
        engine, _, _, _ = ds.initialize(model=ex.GPT(cfg), config=config(name, nvme_path, world))
        step = training.engine_step(engine, x, y)
    else:
        import zero

        engine, _, _, _ = zero.initialize(model=ex.GPT(cfg), config=config(name, nvme_path, world))
        store = engine.parts.optimizer_store
        states = sum(t.nbytes for t in [getattr(store, "master", None), *getattr(store, "states", {}).values()]
                     if isinstance(t, torch.Tensor))
        step = training.engine_step(engine, x, y)
    io0 = harness.proc_io()
    times, losses = training.timed_steps(step, warmup, steps)
    io1 = harness.proc_io()
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
    done = steps + warmup
    result = {"rank": rank, "times": times[warmup:], "loss": losses[-1],
              "peak_rss": harness.status_bytes("VmHWM"), "states_bytes": states,
              "read_per_step": (io1["read_bytes"] - io0["read_bytes"]) / done,
              "written_per_step": (io1["write_bytes"] - io0["write_bytes"]) / done}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def child(name: str, world: int, shape: dict, steps: int, warmup: int) -> dict:
    """Runs the rung on ``world`` ranks; rank 0's median step, the largest rank's peak RSS."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=os.environ.get("LADDER_NVME")) as nvme, \
            tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, harness.free_port(), name, shape, steps, warmup, nvme, out),
                           nprocs=world, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    return {"name": name, "world": world, "step_s": statistics.median(ranks[0]["times"]),
            "times": ranks[0]["times"], "loss": ranks[0]["loss"],
            "peak_rss": max(r["peak_rss"] for r in ranks), "states_bytes": ranks[0]["states_bytes"],
            "read_per_step": max(r["read_per_step"] for r in ranks),
            "written_per_step": max(r["written_per_step"] for r in ranks)}


# -- the run --------------------------------------------------------------------------------------------

def measure(args) -> list:
    runs = {}  # (world, name): each round's result
    for round_ in range(args.rounds):
        for world in args.world:
            for name in args.rungs:
                deepspeed = name in DEEPSPEED
                if deepspeed and not os.path.exists(args.ds_python):
                    runs[world, name] = [{"name": name, "world": world, "skipped": (
                        f"no DeepSpeed venv at {args.ds_python}; create it with: {DS_VENV_HOWTO}")}]
                    continue
                child_args = ["--child", name, "--world", world, "--steps", args.steps, "--warmup", args.warmup,
                              "--model", args.model]
                t0 = time.perf_counter()
                result = harness.run_child("bench.ladder", child_args, python=args.ds_python if deepspeed else None,
                                           timeout=args.timeout)
                result.setdefault("name", name)
                result.setdefault("world", world)
                print(f"round {round_ + 1}: {world} rank(s) {name}: {result.get('step_s', result.get('error'))} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                runs.setdefault((world, name), []).append(result)
    return [_rounds_merged(results) for results in runs.values()]


def _rounds_merged(results: list) -> dict:
    """One rung's rounds as one row: the median of the rounds' median steps, the largest peak RSS
    and bytes moved; a rung that failed in any round is reported failed."""
    done = [r for r in results if "step_s" in r]
    if len(done) < len(results):
        return next(r for r in results if "step_s" not in r)
    row = dict(done[0])
    row.update(step_s=statistics.median(r["step_s"] for r in done), round_steps=[r["step_s"] for r in done],
               times=[t for r in done for t in r["times"]], peak_rss=max(r["peak_rss"] for r in done),
               read_per_step=max(r["read_per_step"] for r in done),
               written_per_step=max(r["written_per_step"] for r in done))
    return row


def _by(rows, world, name):
    return next((r for r in rows if r["world"] == world and r["name"] == name and "step_s" in r), None)


def _spread(row) -> float:
    """How far apart a rung's rounds were (max / min - 1): this machine's noise for that rung, measured."""
    steps = row.get("round_steps") or [row["step_s"]]
    return max(steps) / min(steps) - 1


def figures(rows, when: str) -> list:
    """The headline: the goals of issue 33 against this run."""
    out = []
    for world in sorted({r["world"] for r in rows}):
        ref = _by(rows, world, "torch")
        if ref is None:
            continue
        base = "plain torch" if world == 1 else "DDP"
        for name in ("stage 0", "stage 1", "stage 2"):
            r = _by(rows, world, name)
            if r:
                ratio = r["step_s"] / ref["step_s"]
                out.append(harness.Figure(f"{name}, {world} rank(s) / {base}", f"{ratio:.2f}x", "≤ 1.05x",
                                          ratio <= 1.05, when))
        r, ds = _by(rows, world, "stage 2 + offload cpu"), _by(rows, world, "DeepSpeed stage 2 + offload cpu")
        if r:
            ratio = r["step_s"] / ref["step_s"]
            out.append(harness.Figure(f"stage 2 + offload cpu, {world} rank(s) / {base}", f"{ratio:.2f}x",
                                      "≤ 1.1x", ratio <= 1.1, when))
        if r and ds:
            speed = ds["step_s"] / r["step_s"]
            mem = r["peak_rss"] / ds["peak_rss"]
            out.append(harness.Figure(f"DeepSpeed stage 2 + offload cpu / ours, {world} rank(s)",
                                      f"{speed:.2f}x faster, {mem:.2f}x its peak RSS", "> 1x at ≤ 1x memory",
                                      speed > 1 and mem <= 1, when))
        for stage in (1, 2):
            r, ds = _by(rows, world, f"stage {stage}"), _by(rows, world, f"DeepSpeed stage {stage}")
            if r and ds:
                speed = ds["step_s"] / r["step_s"]
                out.append(harness.Figure(f"DeepSpeed stage {stage} / ours, {world} rank(s)", f"{speed:.2f}x",
                                          "≥ 1.5x", speed >= 1.5, when))
        order = [_by(rows, world, n) for n in ("stage 0", "stage 1", "stage 2", "stage 2 + offload cpu",
                                               "stage 3", "stage 3 + offload cpu")]
        if all(order):
            times = [r["step_s"] for r in order]
            holds = all(b >= a * (1 - max(0.05, _spread(ra), _spread(rb)))
                        for ra, rb, a, b in zip(order, order[1:], times, times[1:]))
            out.append(harness.Figure(f"speed order 0 ≤ 1 ≤ 2 ≤ 2+offload ≤ 3 ≤ 3+offload, {world} rank(s)",
                                      " / ".join(f"{t:.2f}" for t in times) + " s",
                                      "holds within noise (5% or the rounds' spread)", holds, when))
    return out


def table(rows) -> str:
    lines = ["| ranks | rung | step s | / reference | rounds s | peak RSS GiB (largest rank) | "
             "optimizer states GiB / rank | read MB / step | written MB / step |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if "step_s" not in r:
            why = r.get("skipped") or f"failed: {r.get('error')}"
            lines.append(f"| {r['world']} | {r['name']} | {why} | | | | | | |")
            continue
        ref = _by(rows, r["world"], "torch")
        ratio = f"{r['step_s'] / ref['step_s']:.2f}x" if ref else "—"
        states = f"{r['states_bytes'] / harness.GiB:.2f}" if r.get("states_bytes") else "—"
        rounds = " / ".join(f"{t:.2f}" for t in r.get("round_steps", [r["step_s"]]))
        lines.append(f"| {r['world']} | {r['name']} | {r['step_s']:.2f} | {ratio} | {rounds} | "
                     f"{r['peak_rss'] / harness.GiB:.2f} | {states} | {r['read_per_step'] / 1e6:.0f} | "
                     f"{r['written_per_step'] / 1e6:.0f} |")
    return "\n".join(lines)


def chart(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        done = [r for r in rows if r["world"] == world and "step_s" in r]
        ax.barh([r["name"] for r in done], [r["step_s"] for r in done],
                color=["gray" if r["name"] == "torch" else "tab:orange" if r["name"].startswith("DeepSpeed")
                       else "tab:blue" for r in done])
        ax.invert_yaxis()
        ax.set_xlabel("seconds a step (median)")
        ax.set_title(f"{world} rank(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the small model, to check the script runs (--model quick)")
    p.add_argument("--model", choices=sorted(MODELS), default="112m")
    p.add_argument("--rounds", type=int, default=1, help="runs of every rung, interleaved; the median is shown")
    p.add_argument("--rungs", nargs="+", default=["torch", *OURS, *DEEPSPEED], metavar="RUNG",
                   help="which rungs (names as in the table; default: all)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--ds-python", default="/opt/dsvenv/bin/python", help="python of a venv with deepspeed==0.19.8")
    p.add_argument("--nvme-dir", default=None, help="where the NVMe rungs swap (default: a temporary folder)")
    p.add_argument("--json", default=os.path.join(harness.ROOT, "bench", "out", "ladder.json"))
    p.add_argument("--no-results", action="store_true", help="do not write bench/RESULTS.md and the chart")
    p.add_argument("--render", action="store_true",
                   help="no run: the table, section and chart again from the JSON of an earlier run (--json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model = "quick"
    unknown = [r for r in args.rungs if r not in ("torch", *OURS, *DEEPSPEED)]
    if unknown:
        p.error(f"--rungs: unknown {unknown}; the rungs are {['torch', *OURS, *DEEPSPEED]}")
    if args.nvme_dir:
        os.environ["LADDER_NVME"] = args.nvme_dir
    if args.child:
        harness.print_result(child(args.child, args.world[0], MODELS[args.model], args.steps, args.warmup))
        return 0
    if args.render:
        with open(args.json) as f:
            return publish(json.load(f), args.no_results)
    meta = harness.provenance(args.nvme_dir or tempfile.gettempdir())
    rows = measure(args)
    record = {"meta": meta, "model_name": args.model, "model": MODELS[args.model], "rounds": args.rounds,
              "steps": args.steps, "warmup": args.warmup, "world": args.world, "rungs": args.rungs,
              "batch_per_rank": BATCH, "rows": rows}
    harness.save_json(record, args.json, indent=1)
    return publish(record, args.no_results or args.quick)


def publish(record: dict, table_only: bool) -> int:
    """The table on stdout and, for a full run, its section of bench/RESULTS.md and its chart."""
    rows, shape, model = record["rows"], record["model"], record["model_name"]
    print(table(rows))
    if table_only:
        return 0
    meta, rounds = record["meta"], record["rounds"]
    when = meta.get("when", "")
    details = (f"{table(rows)}\n\nModel: zero.examples GPT {shape} ({model.upper()} parameters), batch "
               f"{BATCH} × {shape['seq']} per rank, fp32, AdamW, clipping 1.0; {record['warmup']} warm-up steps, "
               f"median of {record['steps']}; {rounds} round(s), the median of their medians. Two ranks: gloo on "
               f"this machine's 2 CPUs, one thread each. DeepSpeed 0.19.8: stage 1 and 2 with torch_adam (its "
               f"FusedAdam needs CUDA), stage 2 + offload with DeepSpeedCPUAdam. {meta}\n\n![ladder](ladder.png)")
    if set(record["rungs"]) != {"torch", *OURS, *DEEPSPEED} or record["world"] != [1, 2]:
        print("bench/RESULTS.md not written: that needs every rung on 1 and 2 ranks")
        return 0
    command = "flock /tmp/bench.lock python -m bench.ladder" + (f" --rounds {rounds}" if rounds > 1 else "")
    section, png = SECTION, "ladder.png"
    if model != "112m":  # a section of its own
        command += f" --model {model} --steps {record['steps']} --warmup {record['warmup']}"
        section, png = f"## The ZeRO ladder, {model.upper()} (bench/ladder.py --model {model})", \
            f"ladder_{model}.png"
        details = details.replace("![ladder](ladder.png)", f"![ladder]({png})")
    harness.write_section(os.path.join(harness.ROOT, "bench", "RESULTS.md"), section, figures(rows, when),
                          command, details)
    chart(rows, os.path.join(harness.ROOT, "bench", png))
    return 0

if __name__ == "__main__":
    sys.exit(main())
