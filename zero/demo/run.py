"""nvmeio's main job: ZeRO-3 training with parameters and optimizer states on NVMe.

    zero_demo [--steps 200] [--nvme_dir DIR] [--offload nvme|cpu|none] [--compute_device cpu|cuda]
    zero_demo --big          # a model whose states exceed this machine's RAM

A byte-level GPT (zero/examples.py: 4 layers, d_model 128, vocabulary 256)
learns to write Python from the standard library's own source files
(stdlib_corpus.py), through a DeepSpeed config of the kind users already have
(stage 3, offload_param / offload_optimizer to NVMe, an aio block). A progress
bar shows the loss and tokens/s; at the end come the held-out loss before and
after, peak memory and the bytes that sat on NVMe. The first ``--check_steps``
steps are also run by plain PyTorch (torch.optim.AdamW(fused=True)) on a copy
of the model, on the device the engine computes on: exit status 0 when the
losses agree to rtol 1e-6 and the held-out loss fell.

Swap files go to a fresh folder under ``--nvme_dir`` (default
``$XDG_CACHE_HOME/nvmeio``, else ``~/.cache/nvmeio``: a local disk, not the
tmpfs /tmp of many machines), removed at exit.

``--big`` builds, under ``zero.Init`` with parameters written straight to
NVMe, a model whose model states (16 bytes per parameter: fp32 parameter,
fp32 master, Adam's two moments) exceed this machine's RAM, after checking
that the disk has room, and trains it for a few steps.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Iterator, List, Tuple

import torch
from tqdm import tqdm

import zero
from nvmeio import env
from zero.examples import GPT, GPTConfig, relative_error, train_reference
from zero.demo.stdlib_corpus import ByteBatches, stdlib_source_bytes

MODEL = GPTConfig(vocab=256, d_model=128, heads=4, layers=4, seq=128)
BATCH = 8
LR = 2e-3
LR_BIG = 3e-5  # Adam's first steps move every weight by about lr: 2e-3 blows up a 2048-wide, 40-layer model
STATE_BYTES_PER_PARAM = 16  # fp32 parameter (its own master) + gradient + exp_avg + exp_avg_sq
# On NVMe for good: master, exp_avg, exp_avg_sq. The gradient goes there only past the host memory
# the engine may hold it in (zero/runtime/grad_stash.py [Note: partial sums held in host memory]).
NVME_BYTES_PER_PARAM = 12


def ds_config(offload: str, nvme_dir: str, batch: int = BATCH, sub_group_size: int = 200_000,
              buffer_size: int = 100_000_000, lr: float = LR) -> dict:
    offload_param = {"device": offload, "pin_memory": True}
    offload_optimizer = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        offload_param.update(nvme_path=nvme_dir, buffer_count=5, buffer_size=buffer_size, max_in_cpu=0)
        # pipeline_read/write off: on 2 cores the pipelined I/O threads compete with the Adam math and the
        # step is slower (bench/scale.py). (The drift they once showed was a lost gradient, fixed in
        # swapper/_optimizer_swapper.py and pinned by tests/test_zero_grad_stash.py.)
        offload_optimizer.update(nvme_path=nvme_dir, pipeline_read=False, pipeline_write=False)
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload_param,
            "offload_optimizer": offload_optimizer,
            "sub_group_size": sub_group_size,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 500_000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 2,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 1_000_000,
    }


def default_swap_root() -> str:
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "nvmeio")


@contextlib.contextmanager
def swap_folder(root: str) -> Iterator[str]:
    """A fresh folder under ``root`` for this run; removed afterwards, with ``root`` if this run made it."""
    made_root = not os.path.isdir(root)
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="zero-demo-", dir=root)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):
                os.rmdir(root)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def physical_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def held_out_loss(engine, batches) -> float:
    engine.eval()
    with torch.no_grad():
        loss = sum(engine(x, y).item() for x, y in batches) / len(batches)
    engine.train()
    return loss


def train(engine, batches, label: str) -> Tuple[List[float], float]:
    """Train on ``batches`` with a progress bar; the losses and the tokens per second."""
    losses: List[float] = []
    tokens, seconds = 0, 0.0
    bar = tqdm(batches, desc=label, unit="step", file=sys.stderr, mininterval=0.5)
    for x, y in bar:
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        seconds += time.perf_counter() - t0
        tokens += x.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / seconds:,.0f}", refresh=False)
    bar.close()
    return losses, tokens / seconds


def run_small(args, root: str) -> int:
    torch.manual_seed(0)
    model = GPT(MODEL)
    n_params = sum(p.numel() for p in model.parameters())
    data = ByteBatches(stdlib_source_bytes(args.corpus_mib << 20), MODEL.seq, BATCH)
    held_out = data.held_out_batches(4)
    batches = [data.next_batch() for _ in range(args.steps)]
    check = min(args.check_steps, args.steps)
    plain = copy.deepcopy(model)  # the engine takes the model's values; plain torch trains this copy

    print(f"ZeRO-3, offload {args.offload}: byte-level GPT, {n_params / 1e6:.2f}M params, fp32, AdamW lr {LR}, "
          f"{args.steps} steps of {BATCH} x {MODEL.seq} bytes of the Python standard library's source")
    with swap_folder(root) as nvme:
        if args.offload == "nvme":
            print(f"swap files under {nvme} (removed at exit)")
        engine, _, _, _ = zero.initialize(model=model, config=ds_config(args.offload, nvme),
                                          compute_device=args.compute_device)
        # Compared on the device the engine trains on: the CPU's and a GPU's float rounding differ.
        device = engine.device
        reference = train_reference(plain.to(device), [(x.to(device), y.to(device)) for x, y in batches[:check]],
                                    check, lr=LR, clip=1.0)
        del plain
        before = held_out_loss(engine, held_out)
        losses, tokens_per_s = train(engine, batches, f"zero-3 {args.offload}")
        on_disk = disk_bytes(nvme)
        after = held_out_loss(engine, held_out)
        engine.destroy()

    err = relative_error(losses[:check], reference)
    window = max(1, min(10, args.steps // 3))
    print(f"training loss (mean of {window} steps): {sum(losses[:window]) / window:.4f} first, "
          f"{sum(losses[-window:]) / window:.4f} last")
    print(f"held-out loss: {before:.4f} before, {after:.4f} after")
    print(f"checked against plain torch AdamW on {device} over the first {check} steps: "
          f"max relative difference of the losses {err:.2e} (rtol 1e-6)")
    print(f"throughput: {tokens_per_s:,.0f} tokens/s; peak RSS {peak_rss_bytes() / 2**20:,.0f} MiB")
    where = "on NVMe" if args.offload == "nvme" else f"on disk (offload {args.offload}: they stay in memory)"
    print(f"model states {where} during training: {on_disk / 2**20:.1f} MiB "
          f"(of {STATE_BYTES_PER_PARAM} bytes x {n_params:,} params = "
          f"{STATE_BYTES_PER_PARAM * n_params / 2**20:.1f} MiB; the gradient's {STATE_BYTES_PER_PARAM - NVME_BYTES_PER_PARAM} "
          f"go to NVMe only past the host memory the engine may hold it in)")
    ok = err <= 1e-6 and after < before
    print("OK" if ok else "MISMATCH" if err > 1e-6 else "LOSS DID NOT FALL")
    return 0 if ok else 1


def big_model(ram: int) -> GPTConfig:
    """A GPT whose model states are about 1.25x ``ram`` bytes."""
    d_model = 2048 if ram >= 8 << 30 else 256
    per_layer = 12 * d_model * d_model + 13 * d_model
    layers = math.ceil(1.25 * ram / STATE_BYTES_PER_PARAM / per_layer)
    return GPTConfig(vocab=256, d_model=d_model, heads=d_model // 128, layers=layers, seq=64)


def run_big(args, root: str) -> int:
    ram = int(args.ram_gib * 2**30) if args.ram_gib else physical_ram_bytes()
    cfg = big_model(ram)
    with torch.device("meta"):
        shapes = GPT(cfg)
    n_params = sum(p.numel() for p in shapes.parameters())
    # Each module's partition must fit one swap buffer.
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in shapes.modules())
    states = STATE_BYTES_PER_PARAM * n_params
    need = int(states * 1.05) + (256 << 20)
    os.makedirs(root, exist_ok=True)
    free = shutil.disk_usage(root).free
    print(f"--big: byte-level GPT, {cfg.layers} layers x d_model {cfg.d_model}, {n_params / 1e9:.3f}B params; "
          f"model states {states / 2**30:.2f} GiB > this machine's RAM {ram / 2**30:.2f} GiB")
    if free < need:
        print(f"not enough disk space under {root}: {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free; "
              "pass --nvme_dir on a larger disk", file=sys.stderr)
        return 2
    batch = 1
    data = ByteBatches(stdlib_source_bytes(1 << 20), cfg.seq, batch)
    batches = [data.next_batch() for _ in range(args.steps)]
    with swap_folder(root) as nvme:
        print(f"swap files under {nvme} (removed at exit); {free / 2**30:.1f} GiB free there")
        config = ds_config("nvme", nvme, batch=batch, sub_group_size=20_000_000, buffer_size=largest, lr=LR_BIG)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with zero.Init(config_dict_or_path=config, compute_device=args.compute_device):
            model = GPT(cfg)
        built_s = time.perf_counter() - t0
        engine, _, _, _ = zero.initialize(model=model, config=config, compute_device=args.compute_device)
        print(f"built under zero.Init straight to NVMe in {built_s:.0f} s; peak RSS so far "
              f"{peak_rss_bytes() / 2**30:.2f} GiB")
        losses, tokens_per_s = train(engine, batches, "zero-3 nvme (big)")
        on_disk = disk_bytes(nvme)
        engine.destroy()
    rss = peak_rss_bytes()
    print(f"losses: {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"throughput: {tokens_per_s:,.1f} tokens/s; peak RSS {rss / 2**30:.2f} GiB; "
          f"on NVMe during training {on_disk / 2**30:.2f} GiB (model states {states / 2**30:.2f} GiB, "
          f"RAM {ram / 2**30:.2f} GiB)")
    ok = all(math.isfinite(x) for x in losses) and on_disk >= NVME_BYTES_PER_PARAM * n_params
    print("OK: model states larger than RAM trained from NVMe" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme_dir", default=None,
                   help=f"folder on the NVMe for the swap files (default: {default_swap_root()})")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; 2 with --big)")
    p.add_argument("--check_steps", type=int, default=10, help="steps also run by plain torch to compare")
    p.add_argument("--offload", choices=["nvme", "cpu", "none"], default="nvme")
    p.add_argument("--compute_device", default=None,
                   help="cpu, cuda or cuda:N (default: $DS_ACCELERATOR, else CUDA when available)")
    p.add_argument("--corpus_mib", type=int, default=8, help="MiB of standard-library source to read")
    p.add_argument("--big", action="store_true", help="train a model whose states exceed this machine's RAM")
    p.add_argument("--ram_gib", type=float, default=None, help=argparse.SUPPRESS)  # --big's RAM, for tests
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.big else 200
    if args.steps < 1:
        p.error("--steps must be at least 1")
    root = os.path.abspath(args.nvme_dir or default_swap_root())
    return run_big(args, root) if args.big else run_small(args, root)


if __name__ == "__main__":
    raise SystemExit(main())
