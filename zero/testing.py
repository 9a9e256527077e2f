"""A small GPT and the plain-PyTorch reference loop the tests and benchmark compare against.

``GPT`` is nanoGPT-shaped: token embedding tied to the output head (a shared
parameter), a position embedding held by the root module itself, pre-norm
blocks of causal attention and an MLP. ``train_reference`` trains a copy with
``torch.optim.AdamW(fused=True)``, ``loss / accumulation`` per micro-batch and
``clip_grad_norm_``, the loop a ZeRO engine must reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    tie: bool = True


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised with std 0.02 (GPT-2's), inside its own constructor so
    that :class:`zero.Init` partitions the final values."""

    def __init__(self, num: int, dim: int):
        super().__init__(num, dim)
        with torch.no_grad():
            self.weight.mul_(0.02)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.wte = Embedding(c.vocab, c.d_model)
        self.pos = nn.Parameter(torch.randn(c.seq, c.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        if c.tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor = None):
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(c: GPTConfig, count: int, batch: int, seed: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed (inputs, targets) micro-batches of a learnable language.

    Each sequence starts at a random token and follows a fixed random
    permutation of the vocabulary, so the loss falls quickly from ln(vocab).
    """
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(c.vocab, generator=g)
    out = []
    for _ in range(count):
        tokens = torch.empty(batch, c.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, c.vocab, (batch,), generator=g)
        for t in range(c.seq):
            tokens[:, t + 1] = successor[tokens[:, t]]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train_reference(model: nn.Module, batches: Sequence, steps: int, accumulation: int = 1, lr: float = 1e-3,
                    weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8, clip: float = 0.0,
                    shards: int = 1) -> List[float]:
    """Plain PyTorch: fused AdamW; returns the loss of every micro-batch (of every shard).

    ``shards > 1`` mimics data parallelism: each micro-batch is split into that
    many equal parts, the loss of each part is recorded, and the gradient is
    that of their mean.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            fused=True)
    losses: List[float] = []
    it = iter(batches)
    for _ in range(steps):
        for _ in range(accumulation):
            x, y = next(it)
            parts = [model(xs, ys) for xs, ys in zip(x.chunk(shards), y.chunk(shards))]
            losses.extend(p.detach().item() for p in parts)
            loss = parts[0] if shards == 1 else sum(parts) / shards
            if accumulation > 1:
                loss = loss / accumulation
            loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def train_engine(engine, batches: Sequence, steps: int, accumulation: int = 1, rank: int = 0,
                 shards: int = 1) -> List[float]:
    """The same loop through a ZeRO engine; rank ``rank`` of ``shards`` takes its part of each batch."""
    losses: List[float] = []
    it = iter(batches)
    for _ in range(steps * accumulation):
        x, y = next(it)
        if shards > 1:
            x, y = x.chunk(shards)[rank], y.chunk(shards)[rank]
        loss = engine(x, y)
        losses.append(loss.detach().item())
        engine.backward(loss)
        engine.step()
    return losses


def base_config(offload_param: str = "none", offload_optimizer: str = "none", nvme_path=None,
                accumulation: int = 1, micro: int = 4, world_size: int = 1, clip: float = 0.0,
                precision: str = "fp32", lr: float = 1e-3, weight_decay: float = 0.01, **zero_extra) -> dict:
    """A DeepSpeed config dict for the tests: stage 3, AdamW, the given offload."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4096}
    zero.update(zero_extra)
    for key, device in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        zero[key] = {"device": device}
        if device == "nvme":
            zero[key]["nvme_path"] = str(nvme_path)
        if key == "offload_param" and device == "nvme":
            zero[key]["max_in_cpu"] = 0
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def relative_error(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))




# -- several ranks in one test: gloo processes started by torch.multiprocessing ------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, scenarios, out_dir: str) -> None:
    import json
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    results = {}
    for name, fn, kwargs in scenarios:
        try:
            results[name] = fn(rank, world_size, os.path.join(out_dir, name), **kwargs)
        except Exception:  # reported to the test, which fails with the traceback
            results[name] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(world_size: int, scenarios, out_dir) -> List[dict]:
    """Run ``scenarios`` (``(name, fn, kwargs)``; ``fn(rank, world_size, scratch_dir, **kwargs)``
    returns something JSON-able) in ``world_size`` gloo processes; one result dict per rank."""
    import json
    import os

    import torch.multiprocessing as mp

    out_dir = os.fspath(out_dir)
    for name, _, _ in scenarios:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    mp.start_processes(_worker, args=(world_size, free_port(), scenarios, out_dir), nprocs=world_size,
                       start_method="fork")
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def scenario_train(rank: int, world_size: int, scratch: str, offload_param: str = "none",
                   offload_optimizer: str = "none", accumulation: int = 1, clip: float = 0.0,
                   precision: str = "fp32", steps: int = 10, lr: float = 1e-2, use_init: bool = False,
                   config_extra: dict = None, **zero_extra) -> List[float]:
    """Train the test GPT on this rank's part of each batch; returns this rank's losses.

    ``use_init`` builds the model inside ``zero.Init``; ``config_extra`` adds top-level keys.
    """
    import zero

    config = base_config(offload_param, offload_optimizer, scratch, accumulation=accumulation, clip=clip,
                         precision=precision, lr=lr, world_size=world_size, sub_group_size=3000, **zero_extra)
    config.update(config_extra or {})
    torch.manual_seed(0)
    c = GPTConfig()
    if use_init:
        with zero.Init(config_dict_or_path=config):
            model = GPT(c)
    else:
        model = GPT(c)
    batches = make_batches(c, steps * accumulation, 4 * world_size)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        return train_engine(engine, batches, steps, accumulation, rank=rank, shards=world_size)
    finally:
        engine.destroy()
