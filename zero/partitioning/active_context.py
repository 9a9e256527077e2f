"""Which :class:`~zero.Init` context is active on this thread, and which parameters have
no values yet: what both ``Init`` and its transformers hook (hf_hook.py) ask, kept
below both so that neither imports the other."""
from __future__ import annotations

import threading
from typing import List

import torch.nn as nn

_STATE = threading.local()


def current_context():
    """The innermost active :class:`~zero.Init` context of this thread, if any."""
    return getattr(_STATE, "context", None)


def set_current_context(context) -> None:
    _STATE.context = context


def meta_parameter_names(module: nn.Module) -> List[str]:
    """Names of ``module``'s parameters still on the meta device (no values anywhere)."""
    return [name for name, p in module.named_parameters() if p.is_meta]

