"""nvmeio's main job in one run: ZeRO-3 training with parameters and optimizer
states on NVMe, checked step by step against plain PyTorch.

    zero_demo [--nvme_dir DIR] [--steps 20] [--offload nvme|cpu|none]   (or python -m zero.demo)

A GPT-style model (4 layers, d_model 128, vocab 256) learns a synthetic
language. The DeepSpeed config below is the kind users already have
(stage 3, offload_param / offload_optimizer to NVMe, an aio block); the
same model trained by torch.optim.AdamW(fused=True) gives the reference
losses. Prints both, the step time, and what sits on the NVMe. Exit status 0
when the losses agree to rtol 1e-6 and fall.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch

import zero
from zero.examples import GPT, GPTConfig, make_batches, relative_error, train_reference

MODEL = GPTConfig(vocab=256, d_model=128, heads=4, layers=4, seq=64)
LR = 1e-3


def ds_config(offload: str, nvme_dir: str) -> dict:
    offload_param = {"device": offload, "pin_memory": True}
    offload_optimizer = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        offload_param.update(nvme_path=nvme_dir, buffer_count=5, max_in_cpu=0)
        offload_optimizer.update(nvme_path=nvme_dir, pipeline_read=True, pipeline_write=True)
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload_param,
            "offload_optimizer": offload_optimizer,
            "sub_group_size": 200_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 500_000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 2,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 10_000,
    }


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme_dir", default=None, help="directory on the NVMe (default: a temp dir)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--offload", choices=["nvme", "cpu", "none"], default="nvme")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(MODEL)
    reference_model = copy.deepcopy(model)
    batches = make_batches(MODEL, args.steps, 8)
    n_params = sum(p.numel() for p in model.parameters())

    t0 = time.perf_counter()
    reference = train_reference(reference_model, batches, args.steps, lr=LR, clip=1.0)
    torch_s = (time.perf_counter() - t0) / args.steps  # mean, first step included

    with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="nvmeio-demo-") as nvme:
        config_path = os.path.join(nvme, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(ds_config(args.offload, nvme), f, indent=1)
        engine, _, _, _ = zero.initialize(model=model, config=config_path)
        losses, times = [], []
        for x, y in batches:
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        on_disk = disk_bytes(nvme) - os.path.getsize(config_path)
        engine.destroy()

    print(f"ZeRO-3, offload {args.offload}: GPT {n_params / 1e6:.2f}M params, fp32, AdamW, "
          f"{args.steps} steps of batch 8 x {MODEL.seq} tokens")
    print(f"{'step':>4}  {'nvmeio zero':>12}  {'torch AdamW':>12}")
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{i:>4}  {losses[i]:>12.6f}  {reference[i]:>12.6f}")
    err = relative_error(losses, reference)
    print(f"max relative difference of the losses: {err:.2e} (rtol 1e-6)")
    print(f"mean step time: {statistics.mean(times) * 1e3:.0f} ms, plain torch {torch_s * 1e3:.0f} ms "
          "(bench/train_step.py measures both properly)")
    print(f"model states on NVMe during training: {on_disk / 2**20:.1f} MiB (fp32 params + master, "
          f"exp_avg, exp_avg_sq: {16 * n_params / 2**20:.1f} MiB)")
    ok = err <= 1e-6 and losses[-1] < losses[0]
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
