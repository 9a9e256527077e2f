"""transformers' ``from_pretrained`` under :class:`zero.Init`: each checkpoint tensor goes
straight into its partition, so the model is never whole in memory. ``Init`` installs the
hook on entry when transformers is imported; ``zero.hf.HfDeepSpeedConfig`` installs it and
makes a stage-3 config apply to every ``from_pretrained`` while it lives.
Tested with transformers 5.x (5.23); other major versions are refused.

[Note: which of transformers' paths we hook]
transformers decides it runs under ZeRO-3 from a global ``HfDeepSpeedConfig``
of its own and then imports ``deepspeed`` and calls DeepSpeed's ``zero.Init``
and ``GatheredParameters``; that path also reads the whole checkpoint into
memory on rank 0. We do not pretend to be ``deepspeed``. We use its plain path
instead, which since 5.0 builds the model on the meta device and then assigns
each checkpoint tensor to its module (``setattr``), one at a time, marking it
``_is_hf_initialized``. The one hook is a wrapper around
``PreTrainedModel.from_pretrained`` that runs it inside ``Init.loading``: meta
parameters wait for their tensor instead of being materialised, each
assigned tensor marked as loaded is partitioned at once by zero.Init's
parameter-registration hook, and parameters missing from the checkpoint stay
whole until transformers has initialised them (``_init_weights``); the wrapper
partitions those after ``from_pretrained`` returns.
"""
from __future__ import annotations

import functools
import weakref

from .active_context import current_context, meta_parameter_names

SUPPORTED = ((5, 0), (6, 0))  # [min, max) transformers versions
_CONFIG = [None]  # weakref to the live HfDeepSpeedConfig
_INSTALLED = [False]


def _version_tuple(text: str):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_transformers_version(version: str) -> None:
    low, high = SUPPORTED
    if not low <= _version_tuple(version) < high:
        raise ImportError(
            f"zero's from_pretrained support needs transformers >= {low[0]}.{low[1]}, < {high[0]}.{high[1]} "
            f"(tested with 5.23); found {version}. Install a supported version "
            f'(pip install "nvmeio[hf]") or load weights with zero.load_pretrained(model, path)')


def set_live_config(config) -> None:
    """``config`` (an object with ``is_zero3()`` and ``new_context()``) applies to every
    ``from_pretrained`` outside an Init context while it is alive."""
    _CONFIG[0] = weakref.ref(config)


def live_config():
    ref = _CONFIG[0]
    return ref() if ref is not None else None


def _loaded_by_transformers(param) -> bool:
    return bool(getattr(param, "_is_hf_initialized", False))


def _load_under(context, original, cls, args, kwargs):
    with context.loading(accept_assigned=_loaded_by_transformers):
        result = original(cls, *args, **kwargs)
    model = result[0] if isinstance(result, tuple) else result
    for p in model.parameters():  # missing from the checkpoint: initialised by transformers, whole until now
        context.partition(p)
    left = meta_parameter_names(model)
    if left:
        raise ValueError(f"from_pretrained left {len(left)} parameter(s) without values on the meta device: "
                         f"{', '.join(left[:5])}")
    return result


def install() -> None:
    """Wrap ``transformers.PreTrainedModel.from_pretrained`` once (see the module docstring)."""
    if _INSTALLED[0]:
        return
    import transformers
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        context = current_context()
        config = live_config()
        if context is None and (config is None or not config.is_zero3()):
            return original(cls, *args, **kwargs)
        check_transformers_version(transformers.__version__)
        if context is not None:
            return _load_under(context, original, cls, args, kwargs)
        with config.new_context() as context:
            return _load_under(context, original, cls, args, kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    _INSTALLED[0] = True
