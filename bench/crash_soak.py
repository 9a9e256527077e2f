"""Crash anywhere, resume exactly: the GPT of zero.examples trains with parameters and
optimizer states on NVMe, checkpointing every few steps, and is SIGKILLed at random
instants, restarting from ``latest`` each time.

    python bench/crash_soak.py --kills 200 --results-md bench/RELIABILITY.md

Each kill lands in a phase the worker last recorded (start-up, load_checkpoint,
forward, backward, step, save_checkpoint). What is checked:
- every restart loads the checkpoint ``latest`` names (a worker that fails to load
  exits with status 3 and the soak fails);
- the run ends bit-identical to an uninterrupted run of the same steps (a digest of
  every weight and optimizer state, and the losses of the steps the last worker ran);
- every checkpoint a worker reported complete still loads at the end (no byte of a
  completed checkpoint lost);
- the swap directories of killed workers are reclaimed by the next one (they share a
  job id), and a live job's directory beside them is untouched.

The test suite runs a small version (tests/test_crash_soak.py); this script is the
long one, results in bench/RELIABILITY.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Crash anywhere, resume exactly (bench/crash_soak.py)"
PHASES = ("start", "load", "forward", "backward", "step", "save")


def config(nvme: str, job: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0, "nvme_job_id": job,
                "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
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


def worker(args) -> int:
    """One life of the training job: resume from latest, train to the end, or die trying."""
    phase_file = os.path.join(args.work, "phase")

    def phase(name: str) -> None:
        with open(phase_file, "w") as f:  # read by the parent when it kills us
            f.write(name)

    phase("start")
    import torch

    import zero
    from zero.examples import GPT, GPTConfig, make_batches

    torch.manual_seed(0)
    c = GPTConfig(layers=args.layers, d_model=args.d_model)
    engine, _, _, _ = zero.initialize(model=GPT(c), config=config(args.nvme, args.job))
    batches = make_batches(c, args.steps, 4, seed=1)
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
    result = {"digest": state_digest(engine), "losses": losses}
    engine.destroy()
    with open(os.path.join(args.work, "result.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(args.work, "result.json.tmp"), os.path.join(args.work, "result.json"))
    return 0


def _spawn(work: str, nvme: str, job: str, steps: int, save_every: int, layers: int, d_model: int,
           faults: str = ""):
    env = dict(os.environ, NVMEIO_FAULTS=faults) if faults else None
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--work", work, "--nvme", nvme, "--job", job,
         "--steps", str(steps), "--save-every", str(save_every), "--layers", str(layers), "--d-model", str(d_model)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir(), env=env)


def _finish(proc, timeout: float):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def reference(root: str, steps: int, save_every: int, layers: int, d_model: int, timeout: float) -> dict:
    work, nvme = os.path.join(root, "reference"), os.path.join(root, "reference-nvme")
    os.makedirs(work)
    os.makedirs(nvme)
    code, out = _finish(_spawn(work, nvme, "soak", steps, save_every, layers, d_model), timeout)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed ({code}):\n{out[-3000:]}")
    with open(os.path.join(work, "result.json")) as f:
        return json.load(f)


def soak(root: str, kills: int, steps: int = 12, save_every: int = 3, layers: int = 2, d_model: int = 32,
         max_delay: float = 2.0, seed: int = 0, timeout: float = 600.0, enospc: float = 0.0,
         enospc_nth_max: int = 200) -> dict:
    """The uninterrupted reference, then a run killed ``kills`` times; what happened. With
    ``enospc`` > 0 that fraction of lives instead gets ENOSPC at a random write (nvmeio.faults):
    it must fail with an error naming the file, and the next life resume from ``latest``
    (the Nth write under ``root``, N uniform in 1 .. ``enospc_nth_max``)."""
    rng = random.Random(seed)
    ref = reference(root, steps, save_every, layers, d_model, timeout)
    work, nvme = os.path.join(root, "soak"), os.path.join(root, "soak-nvme")
    os.makedirs(work)
    os.makedirs(nvme)
    live = _live_job(nvme)  # another job's directory under the same nvme_path: never touched
    phases, loads, saved, failures, lives, full = Counter(), 0, [], [], 0, 0
    t0 = time.perf_counter()
    while True:
        with open(os.path.join(work, "phase"), "w") as f:
            f.write("start")  # not the last life's phase
        faults = ""
        if enospc and rng.random() < enospc and sum(phases.values()) < kills:
            faults = f"fail_nth={rng.randint(1, enospc_nth_max)},errno=ENOSPC,op=write,path_contains={root}"
        proc = _spawn(work, nvme, "soak", steps, save_every, layers, d_model, faults)
        lives += 1
        if sum(phases.values()) < kills and not faults:
            # one kill in ten during start-up; the others at a uniform instant of the training
            delay = rng.uniform(0.0, max_delay)
            if rng.random() >= 0.1:
                _wait_started(proc, os.path.join(work, "phase"))
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                with open(os.path.join(work, "phase")) as f:
                    at = f.read().strip() or "start"
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                phases[at] += 1
        code, out = _finish(proc, timeout)
        loads += sum(1 for line in out.splitlines() if line.startswith("loaded "))
        saved += [line.split()[1] for line in out.splitlines() if line.startswith("saved ")]
        if faults and code not in (0, -signal.SIGKILL) and "LOAD FAILED" not in out:
            if "No space left on device" not in out or not re.search(re.escape(root) + r"\S+", out):
                failures.append(f"life {lives} (ENOSPC injected) failed without naming the file: {out[-2000:]}")
                break
            full += 1
            continue
        if "LOAD FAILED" in out or code not in (0, -signal.SIGKILL):
            failures.append(f"life {lives} exited {code}: {out[-2000:]}")
            break
        if code == 0:
            if sum(phases.values()) >= kills:
                break
            os.remove(os.path.join(work, "result.json"))  # finished before enough kills: start over
            _reset(work)
    result = _check(work, nvme, ref, saved, live, failures, steps, layers, d_model)
    result.update(kills=sum(phases.values()), phases=dict(phases), lives=lives, loads=loads, enospc_failures=full,
                  checkpoints_completed=len(set(saved)), seconds=round(time.perf_counter() - t0, 1))
    live["close"]()
    return result


def _wait_started(proc, phase_file: str) -> None:
    """Until the worker has imported and built its engine (its phase leaves "start")."""
    while proc.poll() is None:
        try:
            with open(phase_file) as f:
                if f.read().strip() not in ("", "start"):
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.005)


def _reset(work: str) -> None:
    """Start the training over (the soak needs more kills than one run gave)."""
    import shutil

    shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)


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


def _check(work, nvme, ref, saved, live, failures, steps, layers, d_model) -> dict:
    result = {"failures": list(failures)}
    path = os.path.join(work, "result.json")
    if not os.path.exists(path):
        result["failures"].append("the killed run never finished")
        return result
    with open(path) as f:
        final = json.load(f)
    result["bit_identical"] = final["digest"] == ref["digest"]
    if not result["bit_identical"]:
        result["failures"].append("the final state differs from the uninterrupted run's")
    same = all(ref["losses"].get(k) == v for k, v in final["losses"].items())
    result["losses_equal"] = same
    if not same:
        result["failures"].append("losses of the last life differ from the uninterrupted run's")
    leftovers = sorted(e for e in os.listdir(nvme) if e != "live-job")
    result["swap_leftovers"] = leftovers
    if leftovers:
        result["failures"].append(f"swap directories left under nvme_path: {leftovers}")
    if _files(live["dir"]) != live["files"]:
        result["failures"].append("the live job's swap directory was changed")
    lost = _completed_checkpoints_lost(work, sorted(set(saved)), steps, layers, d_model)
    result["completed_checkpoints_lost"] = lost
    if lost:
        result["failures"].append(f"completed checkpoints that no longer load: {lost}")
    return result


def _completed_checkpoints_lost(work, tags, steps, layers, d_model) -> list:
    """Tags a worker reported saved that do not load now (a fresh process loads each)."""
    if not tags:
        return []
    nvme = tempfile.mkdtemp(prefix="soak-verify-", dir=work)
    code = (
        "import json, sys, torch, zero\n"
        "from zero.examples import GPT, GPTConfig\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from bench.crash_soak import config\n"
        f"engine, *_ = zero.initialize(model=GPT(GPTConfig(layers={layers}, d_model={d_model})), "
        f"config=config({nvme!r}, 'verify'))\n"
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


def markdown(result: dict, command: str) -> str:
    phases = ", ".join(f"{p} {result['phases'].get(p, 0)}" for p in PHASES)
    verdict = "0 failures" if not result["failures"] else f"{len(result['failures'])} failure(s)"
    lines = [f"Latest run: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, `{command}`; {result['seconds']} s.", "",
             "The GPT of zero.examples, parameters and AdamW state on NVMe, a checkpoint every few steps; "
             "each life of the job resumes from `latest` and is SIGKILLed at a random instant; the last life "
             "runs to the end. Compared with an uninterrupted run of the same steps.", "",
             "| kills | lives failed by ENOSPC | lives | loads from latest | completed checkpoints | bit-identical end | "
             "checkpoints lost | swap leftovers | live job touched | result |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
             f"| {result['kills']} | {result.get('enospc_failures', 0)} | {result['lives']} | {result['loads']} | "
             f"{result['checkpoints_completed']} | "
             f"{'yes' if result.get('bit_identical') else 'NO'} | {len(result.get('completed_checkpoints_lost', []))} | "
             f"{len(result.get('swap_leftovers', []))} | "
             f"{'yes' if any('live job' in f for f in result['failures']) else 'no'} | {verdict} |", "",
             f"- kills by phase: {phases}.",
             *[f"- failure: {f[:500]}" for f in result["failures"]], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--nvme", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--max-delay", type=float, default=2.0,
                   help="kills land uniformly in [0, this) s after the engine is built (one in ten after start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enospc", type=float, default=0.0,
                   help="this fraction of lives gets ENOSPC at a random write instead of a kill")
    p.add_argument("--dir", default=None, help="where the runs' files go (default: a fresh temporary folder)")
    p.add_argument("--out", help="JSON of the result")
    p.add_argument("--results-md", help="replace this file's section (bench/RELIABILITY.md)")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    root = tempfile.mkdtemp(prefix="crash-soak-", dir=args.dir)
    result = soak(root, args.kills, args.steps, args.save_every, args.layers, args.d_model, args.max_delay, args.seed,
                  enospc=args.enospc)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.results_md:
        sys.path.insert(0, ROOT)
        from pathlib import Path

        from tools.results_md import replace_section

        replace_section(Path(args.results_md), SECTION,
                        markdown(result, "python bench/crash_soak.py " + " ".join(argv or sys.argv[1:])))
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
