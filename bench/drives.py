"""Several drives, no RAID: a striped nvme_path on 1, 2 and 4 simulated drives of one speed.

    flock /tmp/bench.lock python -m bench.drives --out bench/out/drives.json --results-md bench/RESULTS.md
    python -m bench.drives --quick                      # a smoke test, small sizes
    python -m bench.drives --render bench/out/drives.json --results-md bench/RESULTS.md

[Note: what is measured]
The drives are simulated (tools/sim_drives.py [Note: a throttled loop device stands in for a
drive]): 4 loop devices over sparse files of this disk, each with its own ext4 file system and
mount, throttled by one cgroup v1 blkio group to ``--mib-per-s`` (default 200 MiB/s) for reads and
for writes, so that 4 of them stay below the real disk. The benchmark sets them up and tears them
down itself (root), and says so. Each measurement runs in a child process that first moves itself
into the throttled group; N drives are the first N.

fio on one drive is the per-drive reference: a sequential write, then a sequential read, of
``--io-bytes`` (O_DIRECT, io_uring, 8 MiB blocks, iodepth 32).

aio_handle over a striped file (nvmeio.StripedFile, one part per drive, stripe unit = the block
size): one op of ``--io-bytes`` written and read back, the best of ``--reps``, with
bench/io_bound.py's handle settings (block 8 MiB, queue depth 32, intra_op_parallelism 4).

The I/O-bound training iteration is bench/io_bound.py's ``child_train`` (parameters and AdamW
state on NVMe, ``max_in_cpu`` 0, micro-batch 1 x 8, k 1, fp32) with ``nvme_path`` the list of the
N drives' directories, on a smaller GPT than io_bound's 311M (``--model``, default 12 layers x d
768, 91M parameters, so that a run fits in minutes at 200 MiB/s; ``--model io_bound`` takes the
311M). Its bytes are the child's ``/proc/self/io`` around each iteration; its reference is those
bytes at the N drives' aggregate speed, N x fio's per-drive read and write, reads and writes one
after the other (a real drive shares its bandwidth between them; these simulated ones do not, so
an iteration that overlaps reads and writes may come in under it).

Goals (issue 32): aggregate read and write >= 0.9 x N x one drive (fio), N = 2 and 4; the
iteration <= 1.15 x its bytes at the N drives' aggregate speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from bench import harness, io_bound

SECTION = "## Several drives (bench/drives.py)"
GiB, MiB = harness.GiB, 1 << 20
MODELS = {"small": dict(vocab=8192, d_model=768, heads=12, layers=12, seq=128, tie=True),  # 91M
          "io_bound": io_bound.MODEL, "quick": io_bound.QUICK_MODEL}
DRIVES = (1, 2, 4)
FIO_BS, FIO_DEPTH = 8 << 20, 32


# -- the children: each first joins the throttled cgroup -------------------------------------------

def child(kind: str, spec: dict) -> dict:
    from tools.sim_drives import join

    join(spec["cgroup"], os.getpid())
    if kind == "fio":
        return child_fio(spec)
    if kind == "aio":
        return child_aio(spec)
    return io_bound.child_train(spec)


def child_fio(spec: dict) -> dict:
    from tools import fio

    path = os.path.join(spec["dir"], "fio.bin")
    out = {}
    for rw in ("write", "read"):  # the write leaves the file the read reads
        job = fio.FioJob(rw, spec["nbytes"], bs=FIO_BS, engine="io_uring", iodepth=FIO_DEPTH)
        out[f"{rw}_gibps"] = fio.run(job, path) / GiB
        out[f"{rw}_job"] = job.label()
    os.unlink(path)
    return out


def child_aio(spec: dict) -> dict:
    import torch

    import nvmeio
    from nvmeio.striping import stripe_unit

    settings = nvmeio.AioSettings(**io_bound.AIO)
    h = nvmeio.new_handle(settings)
    buf = h.new_cpu_locked_tensor(spec["nbytes"], torch.empty(0, dtype=torch.uint8))
    buf.copy_(torch.randint(0, 256, (spec["nbytes"],), dtype=torch.uint8))
    parts = tuple(os.path.join(d, "striped.bin") for d in spec["dirs"])
    target = nvmeio.StripedFile(parts, stripe_unit(settings.block_size)) if len(parts) > 1 else parts[0]
    times = {"write": [], "read": []}
    h.sync_pwrite(buf, target, 0)  # allocated once, untimed: every timed write overwrites, as a swap file's
    check = buf.clone()
    for _ in range(spec["reps"]):
        for rw in ("write", "read"):
            t0 = time.perf_counter()
            (h.sync_pwrite if rw == "write" else h.sync_pread)(buf, target, 0)
            times[rw].append(time.perf_counter() - t0)
    same = bool(torch.equal(buf, check))
    h.free_cpu_locked_tensor(buf)
    h.close()
    for p in parts:
        os.unlink(p)
    return {"write_gibps": spec["nbytes"] / min(times["write"]) / GiB,
            "read_gibps": spec["nbytes"] / min(times["read"]) / GiB,
            "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()}, "bytes_equal": same,
            "stripe_unit": stripe_unit(settings.block_size) if len(parts) > 1 else None}


# -- the run ---------------------------------------------------------------------------------------

def run_child(kind: str, spec: dict, timeout: int) -> dict:
    return harness.run_child("bench.drives", ["--child", kind, json.dumps(spec)], timeout=timeout)


def run(args) -> dict:
    from tools.sim_drives import SimulatedDrives

    model = MODELS["quick" if args.quick else args.model]
    root = tempfile.mkdtemp(prefix="nvmeio-drives-", dir=args.root)
    record = {"meta": {**harness.provenance(args.root), "command": "python -m bench.drives " + " ".join(args.argv),
                       "quick": args.quick, "model": model, "model_name": "quick" if args.quick else args.model,
                       "mib_per_s": args.mib_per_s, "io_bytes": args.io_bytes, "reps": args.reps,
                       "warmup": args.warmup, "iters": args.iters, "aio": io_bound.AIO, "seq": io_bound.SEQ},
              "fio": {}, "aio": {}, "train": {}, "log": []}

    def log(line: str) -> None:
        print(line, flush=True)
        record["log"].append(line)

    try:
        with SimulatedDrives(root, max(DRIVES), args.mib_per_s * MiB, size=args.drive_bytes, log=log) as drives:
            base = {"cgroup": drives.cgroup}
            record["fio"] = run_child("fio", {**base, "dir": drives.mounts[0], "nbytes": args.io_bytes}, args.timeout)
            log(f"fio, one drive: {json.dumps(record['fio'])}")
            for n in DRIVES:
                dirs = drives.mounts[:n]
                record["aio"][str(n)] = run_child("aio", {**base, "dirs": dirs, "nbytes": args.io_bytes,
                                                          "reps": args.reps}, args.timeout)
                log(f"aio_handle, {n} drives: {json.dumps(record['aio'][str(n)])}")
                spec = {**base, "contender": "ours", "dtype": "fp32", "k": 1, "model": model,
                        "nvme_path": dirs[0] if n == 1 else dirs, "warmup": args.warmup, "iters": args.iters,
                        "train_batch": "auto"}
                row = run_child("train", spec, args.timeout)
                row.pop("reads", None), row.pop("writes", None)
                record["train"][str(n)] = row
                log(f"training iteration, {n} drives: " + json.dumps(
                    {k: row.get(k) for k in ("error", "median_s", "read_bytes", "write_bytes", "times_s")}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    m = record["meta"]
    m["elapsed_s"] = round(time.time() - m.pop("t0"), 1)
    m["load_end"] = harness.load_average()
    return record


# -- the results -----------------------------------------------------------------------------------

def summary(record: dict) -> dict:
    """Per N: aggregate / (N x fio's drive) read and write; the iteration over its bytes at N x fio."""
    fio = record["fio"]
    out = {}
    for n, aio in record["aio"].items():
        row, s = record["train"].get(n, {}), {}
        if "error" not in aio and "error" not in fio:
            for rw in ("read", "write"):
                s[f"{rw}_scaling"] = aio[f"{rw}_gibps"] / (int(n) * fio[f"{rw}_gibps"])
        if "median_s" in row and "error" not in fio:
            ref = (row["read_bytes"] / (int(n) * fio["read_gibps"] * GiB)
                   + row["write_bytes"] / (int(n) * fio["write_gibps"] * GiB))
            s["bytes_s"], s["over_bytes"] = ref, row["median_s"] / ref
            # the bound where reads and writes overlap fully (the simulated drives' throttles are separate)
            s["overlap_s"] = max(row["read_bytes"] / (int(n) * fio["read_gibps"] * GiB),
                                 row["write_bytes"] / (int(n) * fio["write_gibps"] * GiB))
            one = record["train"].get("1", {})
            if "median_s" in one:
                s["speedup"] = one["median_s"] / row["median_s"]
        out[n] = s
    return out


def table(record: dict) -> list:
    s, fio = summary(record), record["fio"]
    rows = ["| drives | aio read GiB/s | aio write GiB/s | read / (N x fio) | write / (N x fio) | iteration s | "
            "read + written GiB | bytes at N x fio, s | iteration / that | iteration / max(read, write) at N x fio | "
            "speed-up over 1 drive |", "|---|" + "---:|" * 10]
    for n, aio in record["aio"].items():
        row, r = record["train"].get(n, {}), s.get(n, {})

        def f(x, fmt="{:.2f}"):
            return "—" if x is None else fmt.format(x)

        rows.append(f"| {n} | {f(aio.get('read_gibps'))} | {f(aio.get('write_gibps'))} | {f(r.get('read_scaling'))} | "
                    f"{f(r.get('write_scaling'))} | {f(row.get('median_s'))} | "
                    f"{f((row['read_bytes'] + row['write_bytes']) / GiB if 'read_bytes' in row else None)} | "
                    f"{f(r.get('bytes_s'))} | {f(r.get('over_bytes'))} | "
                    f"{f(row['median_s'] / r['overlap_s'] if 'overlap_s' in r else None)} | "
                    f"{f(r.get('speedup'))} |")
    if "read_gibps" in fio:
        rows.append(f"\nfio on one drive ({fio.get('read_job')}): read {fio['read_gibps']:.3f} GiB/s, "
                    f"write {fio['write_gibps']:.3f} GiB/s.")
    return rows


def figures(record: dict) -> list:
    s, when, out = summary(record), record["meta"]["when"], []
    for n in ("2", "4"):
        r = s.get(n, {})
        if "read_scaling" in r:
            worst = min(r["read_scaling"], r["write_scaling"])
            out.append(harness.Figure(f"{n} drives: aggregate / ({n} x one drive), read / write",
                                      f"**{r['read_scaling']:.2f} / {r['write_scaling']:.2f}**", "≥ 0.9 (issue 32)",
                                      worst >= 0.9, when))
    if "overlap_s" in s.get("4", {}):
        ratio = record["train"]["4"]["median_s"] / s["4"]["overlap_s"]
        out.append(harness.Figure("4 drives: iteration / max(its reads, its writes) at 4 x one drive (reads and "
                                  "writes overlapped: the simulated drives' throttles are separate)",
                                  f"**{ratio:.2f}x**", when=when))
    if "speedup" in s.get("4", {}):
        out.append(harness.Figure("4 drives: training iteration, speed-up over 1 drive", f"**{s['4']['speedup']:.2f}x**",
                                  when=when))
    for n in ("1", "2", "4"):
        r = s.get(n, {})
        if "over_bytes" in r:
            out.append(harness.Figure(f"{n} drive{'s' if n != '1' else ''}: iteration / its bytes at {n} x one drive",
                                      f"**{r['over_bytes']:.2f}x**", "≤ 1.15x (issue 32)", r["over_bytes"] <= 1.15,
                                      when))
    return out


def chart(record: dict, path: str) -> bool:
    plt = harness.pyplot()
    if plt is None:
        return False

    ns = [n for n in record["aio"] if "error" not in record["aio"][n]]
    fio, s = record["fio"], summary(record)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = [int(n) for n in ns]
    for rw, mark in (("read", "o"), ("write", "s")):
        axes[0].plot(xs, [record["aio"][n][f"{rw}_gibps"] for n in ns], marker=mark, label=f"aio_handle {rw}")
        if f"{rw}_gibps" in fio:
            axes[0].plot(xs, [x * fio[f"{rw}_gibps"] for x in xs], ls="--", marker=mark, alpha=0.5,
                         label=f"N x fio {rw} (one drive)")
    axes[0].set_xticks(xs)
    axes[0].set_xlabel("drives")
    axes[0].set_ylabel("GiB/s")
    axes[0].legend(fontsize=7)
    tn = [n for n in ns if "over_bytes" in s.get(n, {})]
    width = 0.27
    series = {"iteration": [record["train"][n]["median_s"] for n in tn],
              "its bytes at N x fio (reads, then writes)": [s[n]["bytes_s"] for n in tn],
              "max(reads, writes) at N x fio": [s[n]["overlap_s"] for n in tn]}
    for i, (label, values) in enumerate(series.items()):
        bars = axes[1].bar([x + (i - 1) * width for x in range(len(tn))], values, width, label=label)
        axes[1].bar_label(bars, fmt="%.1f", fontsize=7)
    axes[1].set_xticks(range(len(tn)), [f"{n} drive{'s' if n != '1' else ''}" for n in tn])
    axes[1].set_ylabel("s / iteration")
    axes[1].legend(fontsize=7)
    m = record["meta"]["model"]
    fig.suptitle(f"drives throttled to {record['meta']['mib_per_s']} MiB/s each; GPT {m['layers']} x d {m['d_model']}, "
                 f"params + optimizer on NVMe, micro-batch 1 x {record['meta']['seq']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(record: dict, png) -> str:
    m = record["meta"]
    doc = "\n\n".join(par.replace("\n", " ") for par in
                        __doc__.split("[Note: what is measured]", 1)[1].strip().split("\n\n"))
    body = [f"Latest run: {m['started']}, commit {m['commit']}; {m['nproc']} CPUs, {m['ram_bytes'] / GiB:.0f} GiB RAM, "
            f"disk {m['disk']} ({m['fstype']}), {m['fio']}; load average {m['load_start']} at the start, "
            f"{m['load_end']} at the end; {m['elapsed_s']} s in all. Model: {m['model_name']} "
            f"({m['model']['layers']} layers x d {m['model']['d_model']})."
            + (" **Quick run (--quick): a smoke test, not a measurement.**" if m["quick"] else ""), "",
            doc, "", *table(record), "", "Set-up and tear-down, as the run printed them:", "",
            *[f"- {line}" for line in record["log"] if line.startswith(("setting up", "tore down"))], ""]
    if png:
        body += [f"![Several drives]({os.path.basename(png)})", ""]
    return "\n".join(body)


def write_outputs(record: dict, args) -> None:
    print("\n".join(table(record)))
    png = os.path.join(os.path.dirname(os.path.abspath(args.results_md)), "drives.png") if args.results_md else None
    harness.publish(record, args.results_md, SECTION, png, chart, figures, markdown)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and model: a smoke test")
    p.add_argument("--model", choices=("small", "io_bound"), default="small")
    p.add_argument("--mib-per-s", type=int, default=200, help="each drive's read and write throttle")
    p.add_argument("--io-bytes", type=int, default=None, help="bytes of the fio and aio_handle ops (default 1 GiB)")
    p.add_argument("--drive-bytes", type=int, default=16 << 30, help="size of each drive (sparse)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--root", default="/var/tmp", help="where the drives' backing files go")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child")
    p.add_argument("--out", help="JSON of the run")
    p.add_argument("--results-md", help="replace this file's section (e.g. bench/RESULTS.md)")
    p.add_argument("--render", metavar="JSON", help="only write --results-md from a saved --out")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))), flush=True)
        return 0
    if args.render:
        with open(args.render) as f:
            write_outputs(json.load(f), args)
        return 0
    args.io_bytes = args.io_bytes or ((256 << 20) if args.quick else GiB)
    if args.quick:
        args.reps, args.iters = 1, 1
    args.argv = argv
    record = run(args)
    if args.out:
        harness.save_json(record, args.out, indent=1)
        print(f"wrote {args.out}")
    write_outputs(record, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
