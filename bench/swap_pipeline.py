"""Swapper pipeline: plain vs pipelined optimizer swapping vs the step work alone.

    python -m bench.swap_pipeline                                  # 8 x 32M fp32 sub-groups in /tmp
    python -m bench.swap_pipeline --nvme_path /local_nvme --repeats 5
    python -m bench.swap_pipeline --numel 1M --sub_groups 4        # a quick look
    python -m bench.swap_pipeline --results-md bench/RESULTS.md    # also refresh that section

An optimizer state of --sub_groups sub-groups (fp32 master, exp_avg and
exp_avg_sq of --numel elements each) lives on NVMe. Timed, in rounds:

- I/O alone: the plain swapper with a step function that does nothing
  (every read and write, one after the other: the total I/O time);
- I/O alone, pipelined: the same with the pipelined swapper (reads and
  writes overlap each other);
- step alone: the step function on in-memory tensors, once per sub-group;
- plain: swap in, step, swap out, sub-group after sub-group;
- pipelined: read i+1 and write i-1 while i is stepped (both switches on).

The step function is a fixed amount of CPU work: --step_reps passes of
torch's fused AdamW over the sub-group (one torch thread), with the number of
passes calibrated at start so that one step takes about as long as one
sub-group's I/O. Goal: pipelined wall time <= 1.2 x max(total I/O time, total
step time), i.e. the I/O is hidden behind the compute. Each row shows the
median of --repeats rounds (and the minimum); the plain and pipelined swappers
end with bit-identical states, which is checked.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch.optim.adamw import adamw

from bench import harness
from swapper import PartitionedOptimizerSwapper, PipelinedOptimizerSwapper, StepStats

SECTION = "## Swapper pipeline"
IO_PLAIN = "I/O alone (plain, no-op step)"
IO_PIPED = "I/O alone (pipelined, no-op step)"
STEP = "step alone (in memory)"
PLAIN = "plain swapping + step"
PIPED = "pipelined swapping + step"


def parse_count(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def adam_pass(master, grad, exp_avg, exp_avg_sq, step):
    adamw([master], [grad], [exp_avg], [exp_avg_sq], [], [step], foreach=False, fused=True,
          capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
          amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)


class Work:
    """The step function: ``reps`` fused AdamW passes over a sub-group."""

    def __init__(self, numel: int, reps: int):
        self.grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
        self.reps = reps

    def __call__(self, sub_group_id, t):
        for _ in range(self.reps):
            # a fresh step count each pass (fused AdamW increments it): the same work in any order
            adam_pass(t.master, self.grad, t.exp_avg, t.exp_avg_sq, torch.tensor(1.0))


def noop(sub_group_id, t):
    return None


def machine(nvme_path: str) -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dev = fstype = "?"
    try:
        real = os.path.realpath(nvme_path)
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                d, mnt, fs = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, dev, fstype = mnt, d, fs
    except OSError:
        pass
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem / 2**30:.0f} GiB RAM, kernel {platform.release()}, "
            f"--nvme_path on {dev} ({fstype}), torch {torch.__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme_path", default=tempfile.gettempdir())
    p.add_argument("--sub_groups", type=int, default=8)
    p.add_argument("--numel", type=parse_count, default=parse_count("32M"), help="elements per sub-group")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step_reps", type=int, default=0, help="AdamW passes per step (0: calibrate)")
    p.add_argument("--block_size", type=parse_count, default=parse_count("1M"))
    p.add_argument("--queue_depth", type=int, default=32)
    p.add_argument("--intra_op_parallelism", type=int, default=4)
    p.add_argument("--results-md", dest="results_md", help="write the table into this file's section")
    args = p.parse_args()

    torch.set_num_threads(1)
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth,
           "intra_op_parallelism": args.intra_op_parallelism}
    n, groups = args.numel, args.sub_groups
    root = tempfile.mkdtemp(prefix="swap_pipeline_", dir=args.nvme_path)
    meta = harness.provenance(args.nvme_path)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        plain = PartitionedOptimizerSwapper(root, aio, job_id="plain")
        piped = PipelinedOptimizerSwapper(root, aio, job_id="pipelined")
        for s in (plain, piped):
            for i in range(groups):
                s.register_sub_group(i, n)
        for i in range(groups):
            master = torch.randn(n, generator=torch.Generator().manual_seed(i))
            for s in (plain, piped):
                s.initialize(i, master)
            del master
        backend = plain._reads.handle.get_backend()
        print(f"{groups} sub-groups x {n} fp32 elements x 3 tensors = "
              f"{groups * 3 * n * 4 / 2**30:.2f} GiB on NVMe per swapper; aio {aio}, backend {backend}")

        # Calibration: one sub-group's I/O against one AdamW pass (warm-up rounds, not reported).
        plain.step(noop)
        io_warm = plain.step(noop).wall_seconds
        mem = [torch.randn(n, generator=torch.Generator().manual_seed(9)) for _ in range(3)]
        mem[2].abs_()
        work = Work(n, 1)
        adam_pass(mem[0], work.grad, mem[1], mem[2], torch.tensor(1.0))
        t0 = time.perf_counter()
        for _ in range(3):
            adam_pass(mem[0], work.grad, mem[1], mem[2], torch.tensor(1.0))
        one_pass = (time.perf_counter() - t0) / 3
        work.reps = args.step_reps or max(1, round(io_warm / groups / one_pass))
        print(f"calibration: one sub-group's I/O {io_warm / groups:.3f} s, one AdamW pass {one_pass:.3f} s "
              f"-> {work.reps} passes per step")

        class Mem:
            master, exp_avg, exp_avg_sq = mem

        def step_alone() -> StepStats:
            t0 = time.perf_counter()
            for i in range(groups):
                work(i, Mem)
            wall = time.perf_counter() - t0
            return StepStats(sub_groups=groups, step_seconds=wall, wall_seconds=wall)

        runs = {
            IO_PLAIN: lambda: plain.step(noop),
            IO_PIPED: lambda: piped.step(noop),
            STEP: step_alone,
            PLAIN: lambda: plain.step(work),
            PIPED: lambda: piped.step(work),
        }
        samples = {k: [] for k in runs}
        for r in range(args.repeats):
            for name, fn in runs.items():
                samples[name].append(fn())
                st = samples[name][-1]
                print(f"round {r + 1}: {name}: {st.wall_seconds:.3f} s (in step fn {st.step_seconds:.3f} s, "
                      f"waiting on I/O {st.io_wait_seconds:.3f} s)", flush=True)

        # Both swappers ran the same steps in the same order: their states must match bit for bit.
        identical = True
        for i in range(groups):
            a, b = plain.swap_in(i), piped.swap_in(i)
            identical &= all(torch.equal(x, y) for x, y in
                             ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)))
            plain.release(i)
            piped.release(i)
        plain.cleanup()
        piped.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started

    def median(name, attr="wall_seconds"):
        return statistics.median(getattr(st, attr) for st in samples[name])

    io_total, step_total = median(IO_PLAIN), median(STEP)
    bound = max(io_total, step_total)
    # Per round, against that round's own I/O and step times: robust to a load that drifts.
    per_round = sorted(p.wall_seconds / max(i.wall_seconds, s.wall_seconds)
                       for p, i, s in zip(samples[PIPED], samples[IO_PLAIN], samples[STEP]))
    ratio = median(PIPED) / bound
    gib = groups * 3 * n * 4 * 2 / 2**30
    rows = []
    for name, sts in samples.items():
        rows.append(f"| {name} | {median(name):.2f} | {min(st.wall_seconds for st in sts):.2f} | "
                    f"{median(name, 'step_seconds'):.2f} | {median(name, 'io_wait_seconds'):.2f} | "
                    f"{median(name) / bound:.2f} |")
    table = "\n".join([
        f"| run | wall s (median of {args.repeats}) | min s | in step fn s | waiting on I/O s | / max(I/O, step) |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
    ])
    summary = [
        f"- pipelined / max(total I/O {io_total:.2f} s, total step {step_total:.2f} s) = **{ratio:.2f}** "
        f"({'meets' if ratio <= 1.2 else 'misses'} the 1.2 goal); the same ratio round by round: "
        f"{', '.join(f'{x:.2f}' for x in per_round)}; plain / max = {median(PLAIN) / bound:.2f}; "
        f"pipelined / plain = {median(PIPED) / median(PLAIN):.2f}",
        f"- unhidden I/O of the pipelined run (its 'waiting on I/O'): {median(PIPED, 'io_wait_seconds'):.2f} s, "
        f"the read of the first sub-group and the write of the last, which no step work can hide",
        f"- I/O per round: {gib:.2f} GiB ({gib / 2:.2f} read + {gib / 2:.2f} written), "
        f"{gib / io_total:.2f} GiB/s serial, {gib / median(IO_PIPED):.2f} GiB/s pipelined",
        f"- step function: {work.reps} fused AdamW passes per sub-group on one torch thread "
        f"(calibrated: one pass {one_pass * 1000:.0f} ms, one sub-group's I/O {io_warm / groups * 1000:.0f} ms)",
        f"- plain and pipelined final states bit-identical: {'yes' if identical else 'NO'}",
        f"- load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (2 CPUs shared with "
        f"other work); run took {elapsed:.0f} s",
    ]
    cmd = " ".join(["python -m bench.swap_pipeline"] + sys.argv[1:])
    section = "\n".join([
        SECTION,
        "",
        f"Latest run: {meta['started']} on {meta['host']}, commit {meta['commit']}.",
        "",
        f"{groups} sub-groups x {n} fp32 elements (master, exp_avg, exp_avg_sq) on NVMe; aio "
        f"block_size {args.block_size}, queue_depth {args.queue_depth}, intra_op_parallelism "
        f"{args.intra_op_parallelism}, backend {backend}; each swapper has its own read and write handle. "
        f"Machine: {machine(args.nvme_path)}.",
        "",
        table,
        "",
        *summary,
        "",
    ])
    print()
    print(section)
    if not identical:
        sys.exit("plain and pipelined states differ")
    if args.results_md:
        figure = harness.Figure(f"pipelined swapping + step / max(total I/O, total step), {groups} sub-groups x {n} "
                                "fp32", f"**{ratio:.2f}**", "≤ 1.2", ratio <= 1.2, meta["when"])
        harness.write_section(args.results_md, SECTION, [figure], cmd, section.split("\n", 1)[1])


if __name__ == "__main__":
    main()
