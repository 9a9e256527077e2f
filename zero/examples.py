"""The example model: a small GPT and the plain-PyTorch loop that trains it.

The demo, the benchmarks and the tests all train this model; the engine must
reproduce ``train_reference`` exactly.

``GPT`` is nanoGPT-shaped: token embedding tied to the output head (a shared
parameter), a position embedding held by the root module itself, pre-norm
blocks of causal attention and an MLP. ``train_reference`` trains a copy with
``torch.optim.AdamW(fused=True)``, ``loss / accumulation`` per micro-batch and
``clip_grad_norm_``, the loop a ZeRO engine must reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trainable low-rank update, ``lora_b(lora_a(x)) * alpha / rank``
    (LoRA, Hu et al. 2021), each adapter a module (a unit) of its own; ``lora_b`` starts at zero,
    so the wrapped model starts as the base. The LoRA stand-in of the tests and bench/lora.py."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        with torch.no_grad():
            self.lora_b.weight.zero_()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0,
             targets: Sequence[str] = ("qkv", "proj", "fc", "out")) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each Linear whose attribute name is in
    ``targets`` in a :class:`LoRALinear` (its adapters trainable); returns ``model``."""
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
    return model


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
                    shards: int = 1, optimizer: Optional[torch.optim.Optimizer] = None) -> List[float]:
    """Plain PyTorch: fused AdamW; returns the loss of every micro-batch (of every shard).

    ``shards > 1`` mimics data parallelism: each micro-batch is split into that
    many equal parts, the loss of each part is recorded, and the gradient is
    that of their mean. ``optimizer``: the model's AdamW of an earlier call, to
    train on with its state (then ``lr`` and the other settings are its own).
    """
    opt = optimizer
    if opt is None:
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


class OffloadedAdamW:
    """Plain PyTorch with the optimizer on another device, as ZeRO-Offload runs it: an fp32 master
    of each parameter on ``device``, fused AdamW there on the gradients brought over (clipped
    there when ``clip``), the parameters refreshed from it. A reference for an engine whose
    optimizer is offloaded: the host's AdamW may round differently from the GPU's, and a
    gradient that is a cancellation's residue (a key projection's bias under softmax) turns any
    last-bit difference into a different Adam step. Passed to :func:`train_reference` as its
    ``optimizer`` (with ``clip`` 0 there)."""

    def __init__(self, params, device, lr: float = 1e-3, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, clip: float = 0.0):
        self.params = list(params)
        self.master = [p.detach().to(device, torch.float32, copy=True).requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       fused=True)
        self.clip = clip

    def step(self) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.to(m.device, torch.float32)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        self.inner.step()
        self.reload(into_params=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def reload(self, into_params: bool = False) -> None:
        """Copies the master into the parameters (``into_params``), or the parameters into the
        master (after they were changed outside the optimizer)."""
        for m, p in zip(self.master, self.params):
            if into_params:
                p.copy_(m)
            else:
                m.copy_(p)


def relative_error(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def train_reference_mixed(model: nn.Module, batches: Sequence, steps: int, dtype: torch.dtype,
                          lr: float = 1e-3, weight_decay: float = 0.01, clip: float = 0.0,
                          loss_scale: float = 1.0, accumulation: int = 1,
                          optimizer_device: Optional[torch.device] = None) -> List[float]:
    """The mixed-precision recipe in plain PyTorch: forward and backward on a ``dtype`` copy of
    the model, an fp32 master updated by fused AdamW from the fp32-widened gradients, the
    compute copy refreshed from it. With ``accumulation`` each micro-batch's gradient (of
    ``loss / accumulation``) is widened and summed in fp32, as the engine's partition does.
    Clipping and a static loss scale take one coefficient,
    ``min(clip / (norm / scale + 1e-6), 1) / scale``, as the engine's fp16/bf16 step does.
    ``optimizer_device``: where the master lives and steps (the model's device by default; the
    host for an offloaded optimizer, see :class:`OffloadedAdamW`). Frozen parameters
    (``requires_grad=False``) have no master: they stay as rounded to ``dtype``."""
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().clone().float().to(optimizer_device or p.device) for p in params]
    for p in master:
        p.requires_grad_(True)
    model.to(dtype)
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=weight_decay, fused=True)
    losses: List[float] = []
    it = iter(batches)
    for _ in range(steps):
        grads = None
        for _ in range(accumulation):
            x, y = next(it)
            loss = model(x, y)
            losses.append(loss.detach().float().item())
            if accumulation > 1:
                loss = loss / accumulation
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            widened = [p.grad.float() for p in params]
            grads = widened if grads is None else [a.add_(g) for a, g in zip(grads, widened)]
            for p in params:
                p.grad = None
        grads = [g.to(m.device) for g, m in zip(grads, master)]
        coef = None
        if clip > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = torch.clamp(clip / (norm / loss_scale + 1e-6), max=1.0)
            if loss_scale != 1.0:
                coef = coef / loss_scale
        elif loss_scale != 1.0:
            coef = torch.tensor(1.0 / loss_scale, device=grads[0].device)
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        for m, g in zip(master, grads):
            m.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return losses
