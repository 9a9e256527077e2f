"""Crash anywhere, resume exactly: the GPT of zero.examples trains with parameters and
optimizer states on NVMe, checkpointing every few steps, and is SIGKILLed at random
instants, restarting from ``latest`` each time.

    result = soak(str(tmp_path), kills=12, max_delay=1.0)      # tests/test_crash_soak.py
    python -m bench.crash_soak --kills 200                     # the long soak, bench/RELIABILITY.md

Each kill lands in a phase the worker last recorded (start-up, load_checkpoint,
forward, backward, step, save_checkpoint, the end after the last step). What is checked:
- every restart loads the checkpoint ``latest`` names (a worker that fails to load
  exits with status 3 and the soak fails);
- the run ends bit-identical to an uninterrupted run of the same steps (a digest of
  every weight and optimizer state, and the losses of the steps the last worker ran);
- every checkpoint a worker reported complete still loads at the end (no byte of a
  completed checkpoint lost);
- the swap directories of killed workers are reclaimed by the next one (they share a
  job id), and a live job's directory beside them is untouched.

With ``ranks=2`` each life is two gloo ranks (each on its half of every batch, in a
group of its own with timeout ``pg_timeout``); one of them, at random, is killed (or
gets the ENOSPC), and the other must then exit with an error on its own within
``bound`` s: one still running is stopped (SIGABRT: its stacks in the report) and the
soak fails. A rank killed during start-up leaves its peer in the rendezvous, which gives
up after the group's timeout (and torch's retry: [Note: how long a survivor may take]); a
death later makes the peer's next collective fail at once (the TCP connection is reset).
Every rank's digest must equal the uninterrupted run's.

The soak imports nothing but the standard library: each life's ranks run this file
(``--worker``), and so does the check of the completed checkpoints, in Pythons that import
the installed (or PYTHONPATH's) nvmeio, as the tests' children do.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Tuple

PHASES = ("start", "load", "forward", "backward", "step", "save", "end")


def config(nvme: str, job: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0, "nvme_job_id": job,
                "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "min_swap_bytes": 0},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
            "steps_per_print": 10 ** 6}


def state_digest(engine) -> str:
    """sha256 of every weight (gathered) and every optimizer sub-group's master and states."""
    import torch

    from zero.partitioning.gathered import GatheredParameters

    h = hashlib.sha256()
    with GatheredParameters(list(engine.module.parameters())):
        for p in engine.module.parameters():
            h.update(p.detach().float().contiguous().numpy().tobytes())
    store = engine.parts.optimizer_store
    for sg in engine.rank_layout.sub_groups:
        with store.viewed(sg) as (master, states):
            h.update(master.detach().contiguous().numpy().tobytes())
            for name in sorted(states):
                h.update(states[name].detach().contiguous().to(torch.float32).numpy().tobytes())
    return h.hexdigest()


def _join_group(timeout_s: float) -> None:
    """The gloo group of a multi-rank life (RANK, WORLD_SIZE, MASTER_* come from the soak), made
    here so that its timeout is ours: zero.initialize uses a group that exists, and without
    one it would make gloo's default, 30 minutes, the time a survivor may wait for a dead peer."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a few shared cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def worker(args) -> int:
    """One life of one rank of the training job: resume from latest, train to the end, or die trying."""
    phase_file = os.path.join(args.work, f"phase{args.rank}")

    def phase(name: str) -> None:
        with open(phase_file + ".tmp", "w") as f:  # read by the parent when it kills us: replaced
            f.write(name)                          # whole, so that it never reads an empty file
        os.replace(phase_file + ".tmp", phase_file)

    phase("start")
    import torch

    import zero
    from zero.examples import GPT, GPTConfig, make_batches

    if args.world_size > 1:
        _join_group(args.pg_timeout)
    torch.manual_seed(0)
    c = GPTConfig(layers=args.layers, d_model=args.d_model)
    engine, _, _, _ = zero.initialize(model=GPT(c), config=config(args.nvme, args.job))
    # Each rank takes its part of the same batches, so the reference of a world size is one run of it.
    batches = [(x.chunk(args.world_size)[args.rank], y.chunk(args.world_size)[args.rank])
               for x, y in make_batches(c, args.steps, 4 * args.world_size, seed=1)]
    ckpt = os.path.join(args.work, "ckpt")
    phase("load")
    if os.path.exists(os.path.join(ckpt, "latest")):
        try:
            path, _ = engine.load_checkpoint(ckpt)
        except Exception as error:  # noqa: BLE001 - the soak's failure, reported
            print(f"LOAD FAILED: {type(error).__name__}: {error}", flush=True)
            return 3
        print(f"loaded {path}", flush=True)
    losses = {}
    while engine.global_steps < args.steps:
        x, y = batches[engine.global_steps]
        phase("forward")
        loss = engine(x, y)
        phase("backward")
        engine.backward(loss)
        phase("step")
        engine.step()
        losses[engine.global_steps] = loss.item()
        if engine.global_steps % args.save_every == 0:
            phase("save")
            engine.save_checkpoint(ckpt)
            print(f"saved global_step{engine.global_steps}", flush=True)
    phase("end")  # the digest (collectives), destroy, the result: a peer killed here may leave us done
    result = {"digest": state_digest(engine), "losses": losses}
    engine.destroy()
    out = os.path.join(args.work, f"result{args.rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    return 0


@dataclass
class Job:
    """The training job every life runs, and how its ranks are started."""

    steps: int = 12
    save_every: int = 3
    layers: int = 2
    d_model: int = 32
    ranks: int = 1
    pg_timeout: float = 30.0  # the gloo group's timeout of a multi-rank life (_join_group)

    def spawn(self, work: str, nvme: str, faults: Optional[dict] = None) -> list:
        """One process per rank, each printing into ``work``/rank<r>.log; ``faults``: rank -> NVMEIO_FAULTS."""
        port = _free_port()
        procs = []
        for rank in range(self.ranks):
            with open(os.path.join(work, f"phase{rank}"), "w") as f:
                f.write("start")  # not the last life's phase
            env = dict(os.environ, PYTHONFAULTHANDLER="1")  # a hung rank stopped by SIGABRT prints its stacks
            if (faults or {}).get(rank):
                env["NVMEIO_FAULTS"] = faults[rank]
            if self.ranks > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks), OMP_NUM_THREADS="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(os.path.join(work, f"rank{rank}.log"), "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--worker", "--work", work, "--nvme", nvme,
                     "--job", "soak", "--steps", str(self.steps), "--save-every", str(self.save_every),
                     "--layers", str(self.layers), "--d-model", str(self.d_model), "--rank", str(rank),
                     "--world-size", str(self.ranks), "--pg-timeout", str(self.pg_timeout)],
                    stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir(), env=env))
        return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Life:
    """What happened to the ranks of one life."""

    codes: list
    logs: list
    killed: Optional[int] = None  # the rank the soak SIGKILLed
    phase: str = ""  # ... in this phase
    first: Optional[int] = None  # the rank that died first (killed, or exited with an error)
    survivor_s: dict = field(default_factory=dict)  # other rank -> seconds from that death to its exit
    hung: list = field(default_factory=list)  # ranks still running ``bound`` s after it: stopped
    trained_s: Optional[float] = None  # from every rank leaving "start" to the last exit


def run_life(procs: list, work: str, kill: Optional[tuple], bound: float, timeout: float, suspect: int = 0) -> Life:
    """Wait for the ranks of one life. ``kill`` = (wait_started, delay, victim): SIGKILL rank
    ``victim`` ``delay`` s after every rank's phase left "start" (at once without wait_started),
    unless a rank has exited by then. Once one rank is dead, every other must exit within
    ``bound`` s; one that does not is stopped (SIGABRT: its stacks; then SIGKILL). Ranks seen
    dead in the same poll: the death is ``suspect``'s (the one given a fault)."""
    t0 = time.monotonic()
    started = None if kill and kill[0] else t0
    exited, life, death, left_start = {}, Life(codes=[], logs=[]), None, None
    order = sorted(range(len(procs)), key=lambda r: r != suspect)
    while len(exited) < len(procs):
        now = time.monotonic()
        if left_start is None and all(_phase(work, r) != "start" for r in range(len(procs))):
            left_start = now
        for rank in order:
            p = procs[rank]
            if rank not in exited and p.poll() is not None:
                exited[rank] = now
                if p.returncode != 0 and death is None:
                    life.first, death = rank, now
        if kill and death is None:
            if started is None and (exited or left_start is not None):
                started = now
            if started is not None and now >= started + kill[1]:
                if not exited:
                    life.killed, life.phase, life.first, death = kill[2], _phase(work, kill[2]), kill[2], now
                    procs[kill[2]].send_signal(signal.SIGKILL)
                kill = None
        if (death is not None and now - death > bound) or now - t0 > timeout:
            life.hung = [r for r, p in enumerate(procs) if p.poll() is None]
            _stop([procs[r] for r in life.hung])  # not exits of their own: no survivor time
            break
        time.sleep(0.01)
    if death is not None:
        life.survivor_s = {r: round(t - death, 3) for r, t in exited.items() if r != life.first}
    if left_start is not None and exited:
        life.trained_s = max(exited.values()) - left_start
    life.codes = [p.returncode for p in procs]
    for rank in range(len(procs)):
        with open(os.path.join(work, f"rank{rank}.log")) as f:
            life.logs.append(f.read())
    return life


def _phase(work: str, rank: int) -> str:
    try:
        with open(os.path.join(work, f"phase{rank}")) as f:
            return f.read().strip() or "start"
    except FileNotFoundError:
        return "start"


def _stop(procs: list) -> None:
    """SIGABRT (a Python with faulthandler prints every thread's stack), then SIGKILL."""
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        if sig == signal.SIGABRT:
            time.sleep(5.0)
    for p in procs:
        p.wait()


def _results(work: str, ranks: int) -> Optional[list]:
    """Each rank's result of the life that ran to the end (None if one is missing)."""
    out = []
    for rank in range(ranks):
        path = os.path.join(work, f"result{rank}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            out.append(json.load(f))
    return out


def reference(root: str, job: Job, timeout: float) -> Tuple[list, float]:
    """Each rank's result of an uninterrupted run, and how long its training took (s)."""
    work, nvme = os.path.join(root, "reference"), os.path.join(root, "reference-nvme")
    os.makedirs(work)
    os.makedirs(nvme)
    life = run_life(job.spawn(work, nvme), work, None, timeout, timeout)
    if any(life.codes):
        logs = "\n".join(log[-3000:] for log in life.logs)
        raise RuntimeError(f"the uninterrupted run failed ({life.codes}):\n{logs}")
    return _results(work, job.ranks), life.trained_s or 0.0


def soak(root: str, kills: int, steps: int = 12, save_every: int = 3, layers: int = 2, d_model: int = 32,
         max_delay: float = 2.0, seed: int = 0, timeout: float = 600.0, enospc: float = 0.0,
         enospc_nth_max: int = 200, ranks: int = 1, pg_timeout: float = 30.0, bound: float = 0.0,
         start_kills: float = 0.1) -> dict:
    """The uninterrupted reference, then a run killed ``kills`` times; what happened. With
    ``enospc`` > 0 that fraction of lives (one at least) instead gets ENOSPC at a random write (nvmeio.faults):
    it must fail with an error naming the file, and the next life resume from ``latest``
    (the Nth write under ``root``, N uniform in 1 .. ``enospc_nth_max``). With ``ranks`` > 1 a
    life is that many gloo ranks; one (at random) is killed or gets the ENOSPC, and every other
    must then fail on its own within ``bound`` s (default: ``pg_timeout`` + 120, see the
    [Note] below)."""
    rng = random.Random(seed)
    job = Job(steps, save_every, layers, d_model, ranks, pg_timeout)
    # [Note: how long a survivor may take] A rank dying in a collective fails its peer at once
    # (the connection resets: ~1-4 s here). One dying in start-up, before rank 0's TCPStore
    # listens, leaves the peer's store client connecting until the timeout; torch then sleeps
    # one jittered backoff (c10d ExponentialBackoffWithJitter: up to 1.5 x 60 s) and tries
    # once more before it raises: the peer's imports + the timeout + up to 90 s.
    bound = bound or pg_timeout + 120.0
    ref, ref_s = reference(root, job, timeout)
    # [Note: kills reach a checkpoint] A kill lands within ``max_delay`` s of the training's start,
    # or within twice the reference's time for ``save_every`` steps where that is longer: on a
    # slow or busy machine lives killed before their first save would all start over, none load.
    reach = max(max_delay, 2.0 * ref_s * save_every / steps)
    work, nvme = os.path.join(root, "soak"), os.path.join(root, "soak-nvme")
    os.makedirs(work)
    os.makedirs(nvme)
    live = _live_job(nvme)  # another job's directory under the same nvme_path: never touched
    phases, loads, saved, failures, lives, full = Counter(), 0, [], [], 0, 0
    survivor_s, survivor_errors = [], Counter()  # [phase of the kill, s], exception names
    t0 = time.perf_counter()
    while True:
        faults, kill, victim = {}, None, rng.randrange(ranks)
        if _trained(work, steps):
            pass  # a life from the last step only loads and ends: it runs out, and the training starts over
        # ENOSPC lives: a fraction ``enospc``, and with one kill left and none failed by ENOSPC yet, each
        # until one has: which lives draw one depends on the machine's speed (a life that runs out before
        # its kill starts the training over), and with ~20 lives all could miss it.
        elif (enospc and (rng.random() < enospc or not full and sum(phases.values()) == kills - 1)
              and sum(phases.values()) < kills):
            faults[victim] = f"fail_nth={rng.randint(1, enospc_nth_max)},errno=ENOSPC,op=write,path_contains={root}"
        elif sum(phases.values()) < kills:
            # a fraction ``start_kills`` from the start (start-up); the others at a uniform instant
            # of the training
            delay = rng.uniform(0.0, reach)
            kill = (rng.random() >= start_kills, delay, victim)
        life = run_life(job.spawn(work, nvme, faults), work, kill, bound, timeout, suspect=victim)
        lives += 1
        if life.killed is not None:
            phases[life.phase] += 1
        loads += sum(1 for line in life.logs[0].splitlines() if line.startswith("loaded "))
        saved += [line.split()[1] for line in life.logs[0].splitlines() if line.startswith("saved ")]
        for rank, seconds in life.survivor_s.items():
            # Of a kill only: after an ENOSPC every rank raises together (the engine agrees on a
            # failed backward), the faulted one often last. Exit 0: the kill came after the last collective.
            if life.killed is not None and life.codes[rank] != 0:
                survivor_s.append([life.phase, seconds])
                survivor_errors[_error_name(life.logs[rank])] += 1
        print(f"life {lives}: exits {life.codes}, killed {life.killed} in {life.phase or '-'}, faults {faults or '-'}, "
              f"the others exited {life.survivor_s or '-'} s after", file=sys.stderr, flush=True)  # progress
        problem = _life_problem(life, faults, root, lives, bound)
        if problem:
            failures.append(problem)
            break
        if faults and life.codes[victim] != 0:
            full += 1
            continue
        if not any(life.codes):
            if sum(phases.values()) >= kills:
                break
            _reset(work, ranks)  # finished before enough kills: start over
    result = _check(work, nvme, ref, saved, live, failures, job)
    result.update(kills=sum(phases.values()), phases=dict(phases), lives=lives, loads=loads, enospc_failures=full,
                  checkpoints_completed=len(set(saved)), seconds=round(time.perf_counter() - t0, 1), ranks=ranks,
                  survivor_fail_s=survivor_s, survivor_errors=dict(survivor_errors), bound_s=bound,
                  kill_reach_s=round(reach, 2), reference_s=round(ref_s, 2))
    live["close"]()
    return result


def _life_problem(life: Life, faults: dict, root: str, number: int, bound: float) -> str:
    """Why this life fails the soak ("" if it does not)."""
    logs = "\n".join(f"--- rank {r} (exit {c}):\n{log[-2000:]}"
                     for r, (c, log) in enumerate(zip(life.codes, life.logs)))
    if life.hung and life.first is None:
        return f"life {number}: rank(s) {life.hung} did not finish within the life's timeout; stopped:\n{logs}"
    if life.hung:
        return (f"life {number}: rank(s) {life.hung} still running {bound:g} s after rank {life.first} died "
                f"(killed in: {life.phase or '-'}); stopped:\n{logs}")
    for rank in faults:
        log = life.logs[rank]
        if life.codes[rank] == 0:
            continue  # the Nth write never came
        if "No space left on device" not in log or not re.search(re.escape(root) + r"\S+", log):
            return f"life {number}: rank {rank} (ENOSPC injected) failed without naming the file:\n{logs}"
        # It failed as it must (in load_checkpoint too: the disk was full, the checkpoint is
        # intact, and the next life loads it); the others after it, in any way.
        return ""
    if life.killed is not None and life.first == life.killed:
        return ""  # the survivors may fail in any way (their peer is gone); the next life must load
    if any(life.codes) or any("LOAD FAILED" in log for log in life.logs):
        return f"life {number} failed on its own (exits {life.codes}):\n{logs}"
    return ""


def _error_name(log: str) -> str:
    """The exception a survivor died of (the last line naming one, up to its colon)."""
    lines = [line for line in log.splitlines() if re.match(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception)\b", line)]
    if not lines:
        return "LOAD FAILED" if "LOAD FAILED" in log else "no traceback"
    return re.sub(r"^\[rank\d+\]: ", "", lines[-1]).split(":")[0]


def _trained(work: str, steps: int) -> bool:
    """``latest`` names the checkpoint of the last step."""
    try:
        with open(os.path.join(work, "ckpt", "latest")) as f:
            return f.read().strip() == f"global_step{steps}"
    except FileNotFoundError:
        return False


def _reset(work: str, ranks: int) -> None:
    """Start the training over (the soak needs more kills than one run gave)."""
    import shutil

    shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
    for rank in range(ranks):
        os.remove(os.path.join(work, f"result{rank}.json"))


def _live_job(nvme: str) -> dict:
    """A live job beside the soak: a process holding its own swap directory under the same
    nvme_path, whose files the soak's restarts must not touch."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, torch, swapper\n"
        f"s = swapper.PartitionedParamSwapper({nvme!r}, buffer_count=1, buffer_size=1024, max_in_cpu=0, "
        "job_id='live-job', pin_memory=False)\n"
        "s.register(0, 1024); s.swap_out_tensors([0], [torch.arange(1024.)]); s.synchronize()\n"
        "print('ready', flush=True); sys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=tempfile.gettempdir())
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        raise RuntimeError(f"the live job did not start: {line}{proc.stdout.read()[-2000:]}")
    directory = os.path.join(nvme, "live-job")
    snapshot = _files(directory)

    def close():
        proc.stdin.close()
        proc.wait(timeout=60)

    return {"dir": directory, "files": snapshot, "close": close}


def _files(directory: str) -> dict:
    out = {}
    for d, _, fs in os.walk(directory):
        for f in fs:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _check(work, nvme, ref, saved, live, failures, job: Job) -> dict:
    result = {"failures": list(failures)}
    final = _results(work, job.ranks)
    if final is None:
        result["failures"].append("the killed run never finished")
        return result
    result["bit_identical"] = all(mine["digest"] == theirs["digest"] for mine, theirs in zip(final, ref))
    if not result["bit_identical"]:
        result["failures"].append("the final state differs from the uninterrupted run's")
    same = all(theirs["losses"].get(k) == v for mine, theirs in zip(final, ref) for k, v in mine["losses"].items())
    result["losses_equal"] = same
    if not same:
        result["failures"].append("losses of the last life differ from the uninterrupted run's")
    leftovers = sorted(e for e in os.listdir(nvme) if e != "live-job")
    result["swap_leftovers"] = leftovers
    if leftovers:
        result["failures"].append(f"swap directories left under nvme_path: {leftovers}")
    if _files(live["dir"]) != live["files"]:
        result["failures"].append("the live job's swap directory was changed")
    lost = _completed_checkpoints_lost(work, sorted(set(saved)), job.layers, job.d_model)
    result["completed_checkpoints_lost"] = lost
    if lost:
        result["failures"].append(f"completed checkpoints that no longer load: {lost}")
    return result


def _completed_checkpoints_lost(work, tags, layers, d_model) -> list:
    """Tags a worker reported saved that do not load now: a fresh process of one rank loads each
    (a checkpoint of several ranks through all of their shards)."""
    if not tags:
        return []
    nvme = tempfile.mkdtemp(prefix="soak-verify-", dir=work)
    code = (
        "import json, zero\n"
        "from zero.examples import GPT, GPTConfig\n"
        f"engine, *_ = zero.initialize(model=GPT(GPTConfig(layers={layers}, d_model={d_model})), "
        f"config=json.loads({json.dumps(config(nvme, 'verify'))!r}))\n"
        "lost = []\n"
        f"for tag in {tags!r}:\n"
        "    try:\n"
        f"        engine.load_checkpoint({os.path.join(work, 'ckpt')!r}, tag=tag)\n"
        "    except Exception as e:\n"
        "        lost.append(f'{tag}: {type(e).__name__}: {e}')\n"
        "engine.destroy()\n"
        "print(json.dumps(lost))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=tempfile.gettempdir())
    if run.returncode != 0:
        return [f"the verification failed: {run.stdout[-1000:]}{run.stderr[-2000:]}"]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _worker_args(argv=None):
    p = argparse.ArgumentParser(description="one life of one rank of the crash soak's training job")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--work", required=True)
    p.add_argument("--nvme", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=30.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(worker(_worker_args()))
