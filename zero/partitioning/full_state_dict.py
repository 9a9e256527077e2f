"""``full_state_dict(module)``: a partitioned model's state_dict with full values, for saving.

Each module's own parameters are gathered (:class:`zero.GatheredParameters`)
and copied to host memory one module at a time, so beyond the result only one
module is ever full. Every rank must call it (gathers are collective); each
gets the whole dict. Works for engine parameters and for ``zero.Init`` ones.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

import torch
import torch.nn as nn

from .gathered import GatheredParameters


def full_state_dict(module: nn.Module, exclude_frozen: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """``module.state_dict()`` in its usual key order, each parameter gathered and copied to the CPU;
    ``exclude_frozen``: without the parameters that have ``requires_grad=False`` (never gathered)."""
    names: Dict[int, List[str]] = {}
    frozen = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if exclude_frozen and not p.requires_grad:
            frozen.add(name)
            continue
        names.setdefault(id(p), []).append(name)
    values: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for m in module.modules():
            params = [p for p in m._parameters.values() if p is not None and names.get(id(p))]
            if not params or all(n in values for p in params for n in names[id(p)]):
                continue
            with GatheredParameters(params):
                for p in params:
                    copy = p.detach().to("cpu", copy=True)
                    for name in names[id(p)]:
                        values[name] = copy
    state = OrderedDict()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name not in frozen:
            state[name] = values[name] if name in values else tensor.detach().cpu()
    return state
