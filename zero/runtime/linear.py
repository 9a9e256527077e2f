"""``memory_efficient_linear``: nn.Linear layers whose gathered weight autograd does not keep.

``F.linear`` saves ``weight.t()`` for backward, a view that keeps the gathered
flat buffer of the layer alive from the forward until the backward, so
releasing the layer after its forward frees nothing. :class:`ZeroLinear`
computes the same forward with ``F.linear`` but saves the weight parameter
itself: its data is then whatever the parameter holds when backward runs,
which the coordinator re-gathers just before the layer's backward. The
backward replays the matrix products autograd would run for ``F.linear``
(``grad @ W``, ``grad^T @ x``, the bias gradient as a sum over rows), in the
same layouts, so gradients are bit-identical. Installed only on layers whose
weights are really released (not on one rank with resident shards).
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F


class ZeroLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_2d.mm(weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_input, grad_weight, grad_bias


KEEPS_LEAVES = "_zero_keeps_leaves"  # set on a saved-tensor pack hook that hands a leaf back as itself


def _hooks_may_keep_data() -> bool:
    """A saved-tensor pack hook is active that may keep a saved parameter's *data* rather than the
    parameter (torch.utils.checkpoint's recomputation stores ``t.detach()``): a view of a lent pool
    buffer that would outlive the unit's release. Unknown (no such torch API): assume it may."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    hooks = top(False)
    return hooks is not None and not getattr(hooks[0], KEEPS_LEAVES, False)


def _forward(self: nn.Linear,
             input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear.forward's name: callers may pass input=
    if not torch.is_grad_enabled():
        return F.linear(input, self.weight, self.bias)
    keeps_data = input.dim() < 2 or not input.is_contiguous()  # F.linear keeps a view of weight's data
    if keeps_data or _hooks_may_keep_data():
        before_saving = self.__dict__.get("_zero_before_saving_weight")
        if before_saving is not None:
            before_saving()
    if keeps_data:
        return F.linear(input, self.weight, self.bias)
    return ZeroLinear.apply(input, self.weight, self.bias)


def install(module: nn.Linear, before_saving_weight=None) -> None:
    """``before_saving_weight()`` runs before a forward whose autograd would keep the weight's data."""
    module.__dict__["forward"] = types.MethodType(_forward, module)
    if before_saving_weight is not None:
        module.__dict__["_zero_before_saving_weight"] = before_saving_weight


def uninstall(module: nn.Linear) -> None:
    module.__dict__.pop("forward", None)
    module.__dict__.pop("_zero_before_saving_weight", None)
