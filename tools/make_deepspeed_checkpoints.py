"""The DeepSpeed checkpoints tests/test_zero_checkpoint_deepspeed.py loads, made by DeepSpeed itself.

    /opt/dsvenv/bin/python tools/make_deepspeed_checkpoints.py [--out tests/data/deepspeed_ckpt]

Run in a virtual environment that has DeepSpeed (0.19.8 made the committed
files) and torch, not nvmeio: it loads zero/examples.py by its path, the only
file of this repository it needs. For each fixture it starts two gloo ranks on
the CPU (``DS_ACCELERATOR=cpu``), trains the tiny GPT below for
``STEPS_BEFORE`` optimizer steps with ``deepspeed.initialize`` (AdamW with
``torch_adam``, a WarmupDecayLR schedule, gradient clipping), saves with
``engine.save_checkpoint(<out>/<name>)`` (``exclude_frozen_parameters=True`` for the
``*_exclude_frozen`` fixtures) and goes on for ``STEPS_AFTER``
more steps, recording each rank's loss and the learning rate of every step.
``<out>/<name>.json`` holds what a test needs to continue the same run: the
DeepSpeed config, the model's shape, the data, the counters at the
checkpoint, DeepSpeed's losses and learning rates after it, and the SHA-256 of
each fp32 tensor DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
consolidates from the checkpoint.

There is no fp16 fixture: DeepSpeed refuses fp16 on its CPU accelerator ("Type
fp16 is not supported on your device"); tests/test_zero_checkpoint_deepspeed.py
puts the DynamicLossScaler an fp16 run pickles into a copy of a fixture instead.

The recovery scripts DeepSpeed copies into the save directory (its
zero_to_fp32 and zero_to_torch scripts) are removed: they are DeepSpeed's code,
not part of the checkpoint's data.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZE = 2
STEPS_BEFORE = 3
STEPS_AFTER = 3
MODEL = {"vocab": 32, "d_model": 16, "heads": 2, "layers": 1, "seq": 8, "tie": True}
MICRO = 2  # per rank
DATA_SEED = 0
MODEL_SEED = 1234

# name: (stage, precision, gradient_accumulation_steps, frozen parameters, extra zero_optimization keys).
# A frozen parameter is saved outside the optimizer's flat groups: in the module's state dict
# (stages 1-2) or as each rank's fragment of it (stage 3).
FIXTURES = {
    "stage1": (1, "fp32", 2, ["pos"], {}),
    "stage2": (2, "fp32", 1, [], {}),
    "stage3": (3, "fp32", 1, ["pos"], {"sub_group_size": 1000, "stage3_param_persistence_threshold": 0}),
    "stage2_bf16": (2, "bf16", 1, [], {}),
    "stage1_exclude_frozen": (1, "fp32", 1, ["pos"], {}),
    "stage3_exclude_frozen": (3, "fp32", 1, ["pos"], {"sub_group_size": 1000, "stage3_param_persistence_threshold": 0}),
}
# Saved with engine.save_checkpoint(..., exclude_frozen_parameters=True): the frozen parameters are
# not in the files (what the HF Trainer saves for a peft model under DeepSpeed).
EXCLUDE_FROZEN = {"stage1_exclude_frozen", "stage3_exclude_frozen"}


def ds_config(stage: int, precision: str, accumulation: int, zero_extra: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": MICRO * accumulation * WORLD_SIZE,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 4, "total_num_steps": 20,
                                                          "warmup_type": "linear"}},
        "zero_optimization": dict({"stage": stage}, **zero_extra),
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def load_examples():
    spec = importlib.util.spec_from_file_location("gpt_examples", os.path.join(ROOT, "zero", "examples.py"))
    examples = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = examples  # dataclasses look their module up there
    spec.loader.exec_module(examples)
    return examples


def rank_main(rank: int, port: int, name: str, out: str, result_file: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    import deepspeed

    torch.set_num_threads(1)
    examples = load_examples()
    stage, precision, accumulation, frozen, zero_extra = FIXTURES[name]
    config = ds_config(stage, precision, accumulation, zero_extra)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = examples.GPTConfig(**MODEL)
    torch.manual_seed(MODEL_SEED)
    model = examples.GPT(cfg)
    for param_name in frozen:
        model.get_parameter(param_name).requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    micro_batches = (STEPS_BEFORE + STEPS_AFTER) * accumulation
    batches = examples.make_batches(cfg, micro_batches, MICRO * WORLD_SIZE, seed=DATA_SEED)

    def train(batch_list):
        losses, lrs = [], []
        for i, (x, y) in enumerate(batch_list):
            loss = engine(x.chunk(WORLD_SIZE)[rank], y.chunk(WORLD_SIZE)[rank])
            losses.append(loss.float().item())
            engine.backward(loss)
            engine.step()
            if (i + 1) % accumulation == 0:
                lrs.append(engine.get_lr()[0])
        return losses, lrs

    split = STEPS_BEFORE * accumulation
    before, lrs_before = train(batches[:split])
    engine.save_checkpoint(os.path.join(out, name), exclude_frozen_parameters=name in EXCLUDE_FROZEN)
    after, lrs_after = train(batches[split:])
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            path = os.path.join(out, name, script)
            if os.path.exists(path):
                os.unlink(path)
    result = {"rank": rank, "losses_before": before, "lrs_before": lrs_before, "losses_after": after,
              "lrs_after": lrs_after, "global_steps": STEPS_BEFORE, "ds_version": deepspeed.__version__,
              "torch_version": torch.__version__}
    with open(result_file, "w") as f:
        json.dump(result, f)


def consolidated_digests(checkpoint_dir: str) -> dict:
    """name -> SHA-256 of the fp32 bytes of each tensor DeepSpeed's zero_to_fp32 rebuilds."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
    return {n: hashlib.sha256(t.detach().contiguous().float().numpy().tobytes()).hexdigest() for n, t in state.items()}


def make(name: str, out: str) -> None:
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = os.path.join(out, name)
    shutil.rmtree(target, ignore_errors=True)
    results = [os.path.join(out, f".{name}.rank{r}.json") for r in range(WORLD_SIZE)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--name", name,
                               "--out", out, "--result", results[r]]) for r in range(WORLD_SIZE)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"{name}: a rank failed ({codes})")
    ranks = []
    for path in results:
        with open(path) as f:
            ranks.append(json.load(f))
        os.unlink(path)
    stage, precision, accumulation, frozen, zero_extra = FIXTURES[name]
    record = {
        "made_by": f"tools/make_deepspeed_checkpoints.py with DeepSpeed {ranks[0]['ds_version']}, "
                   f"torch {ranks[0]['torch_version']}",
        "ds_config": ds_config(stage, precision, accumulation, zero_extra),
        "model": MODEL,
        "model_seed": MODEL_SEED,
        "frozen": frozen,
        "exclude_frozen_parameters": name in EXCLUDE_FROZEN,
        "world_size": WORLD_SIZE,
        "data": {"micro_batches": (STEPS_BEFORE + STEPS_AFTER) * accumulation, "batch": MICRO * WORLD_SIZE,
                 "seed": DATA_SEED, "rank_takes": "x.chunk(world_size)[rank]"},
        "tag": f"global_step{STEPS_BEFORE}",
        "global_steps": STEPS_BEFORE,
        "global_samples": STEPS_BEFORE * MICRO * accumulation * WORLD_SIZE,
        "losses_before": [r["losses_before"] for r in ranks],
        "lrs_before": ranks[0]["lrs_before"],
        "losses_after": [r["losses_after"] for r in ranks],
        "lrs_after": ranks[0]["lrs_after"],
        "zero_to_fp32_sha256": consolidated_digests(target),
    }
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(target) for n in ns)
    print(f"{name}: {size / 1024:.0f} KiB, losses after the checkpoint {record['losses_after']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "deepspeed_ckpt"))
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="make only these fixtures")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.name, args.out, args.result)
        return
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or FIXTURES:
        make(name, args.out)


if __name__ == "__main__":
    main()
