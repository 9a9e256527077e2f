"""transformers' ``from_pretrained`` and ``from_config`` under :class:`zero.Init`, and its weight
initialisation on partitioned parameters. ``Init`` installs the hooks on entry when transformers is
imported; ``zero.hf.HfDeepSpeedConfig`` installs them and makes a stage-3 config apply to every
``from_pretrained`` and ``from_config`` while it lives (hf_zero3.py keeps the list of what is active).
Tested with transformers 5.x (5.17, 5.23, 5.24); other major versions are refused.

[Note: which of transformers' paths we hook]
transformers, told that ZeRO-3 is on (hf_zero3.py), builds a model under DeepSpeed's ``zero.Init``
and loads it through ``GatheredParameters``; that path reads the whole checkpoint into memory on
rank 0, and its ``from_config`` skips the torch initialisers while building (so a model gets other
values than the same script without ZeRO, for the same seed). Three hooks take their place:

- ``PreTrainedModel.from_pretrained`` runs transformers' plain path, inside ``Init.loading`` and with
  the flag off on this thread: since 5.0 that path builds the model on the meta device and assigns
  each checkpoint tensor to its module (``setattr``), one at a time, marking it
  ``_is_hf_initialized``; meta parameters wait for their tensor instead of being materialised,
  each assigned tensor marked as loaded is partitioned at once by zero.Init's
  parameter-registration hook, and parameters missing from the checkpoint stay whole until
  transformers has initialised them (``_init_weights``); the wrapper partitions those after
  ``from_pretrained`` returns.
- ``PreTrainedModel._from_config`` (behind ``AutoModel.from_config``) runs inside ``Init`` with
  transformers' own marker that a ``zero.Init`` is already active (``set_zero3_state``), so it takes
  its plain construction path while model code still sees ZeRO-3: the torch initialisers run as
  modules are built, then ``post_init`` runs ``_init_weights``, exactly as without ZeRO.
- ``PreTrainedModel._initialize_weights`` (each module's step of ``post_init``'s
  ``initialize_weights``) gathers the partitioned parameters of the module and of its direct
  children first (those ``_init_weights`` writes, as transformers' ``initialize_weights_zero3``
  does) with ``modifier_rank=0``: every rank runs the initialiser, so the random number streams stay
  as without ZeRO on every rank, and rank 0's values are kept. A model built in ``Init`` from its
  config (``from_config`` or ``Model(config)``) so gets the values the same seed gives without it.

A source that only tells transformers (an engine, see hf_zero3.py) leaves both to build whole, with
the flag off on this thread meanwhile, as models are built without an ``HfDeepSpeedConfig``.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch.nn as nn

from . import hf_zero3
from .active_context import current_context, meta_parameter_names
from .gathered import GatheredParameters
from .init_store import is_init_partitioned

SUPPORTED = ((5, 0), (6, 0))  # [min, max) transformers versions
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
            f"(tested with 5.17, 5.23 and 5.24); found {version}. Install a supported version "
            f'(pip install "nvmeio[hf]") or load weights with zero.load_pretrained(model, path)')


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


def _context_to_build_in():
    """(the ``Init`` context to build in, whether it must be opened), or (None, False): build whole."""
    context = current_context()
    if context is not None:
        return context, False
    builder = hf_zero3.latest_builder()
    return (builder.open_init(), True) if builder is not None else (None, False)


def _whole(original, cls, args, kwargs):
    if not hf_zero3.is_on():
        return original(cls, *args, **kwargs)
    with hf_zero3.suspended():  # only an engine is active: transformers builds whole, as without ZeRO
        return original(cls, *args, **kwargs)


def _zero_init_already_active():
    """transformers' marker that a ``zero.Init`` is active, under which ``_from_config`` builds plainly
    (``set_zero3_state``); where this transformers has none, the flag is off on this thread instead."""
    marker = getattr(sys.modules["transformers.modeling_utils"], "set_zero3_state", None)
    return marker() if marker is not None else hf_zero3.suspended()


def _written_params(module, pretrained_model):
    """The parameters ``_init_weights(module)`` writes, partitioned ones only: the module's own and its
    direct children's (those of a child model are its own ``_init_weights``'), as transformers'
    ``initialize_weights_zero3`` gathers them, and for each of these modules the originals its
    parametrized weights are computed from (``parametrizations``, e.g. a weight-normed convolution)."""
    modules = [module] + [child for child in module.children() if not isinstance(child, pretrained_model)]
    params = {}  # by identity: a parameter tied between them is gathered once
    for m in modules:
        parametrizations = getattr(m, "parametrizations", None)
        originals = parametrizations.parameters() if isinstance(parametrizations, nn.Module) else ()
        for p in [*m.parameters(recurse=False), *originals]:
            if is_init_partitioned(p) or getattr(p, "_zero_unit", None) is not None:
                params[id(p)] = p
    return list(params.values())


def install() -> None:
    """Wrap ``PreTrainedModel.from_pretrained``, ``_from_config`` and ``_initialize_weights`` once
    (see the module docstring), and tell transformers what is active now (hf_zero3.py)."""
    if _INSTALLED[0]:
        hf_zero3.hooks_installed()
        return
    import transformers
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__
    original_from_config = PreTrainedModel._from_config.__func__
    original_initialize = PreTrainedModel._initialize_weights

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        context, opened = _context_to_build_in()
        if context is None:
            return _whole(original, cls, args, kwargs)
        check_transformers_version(transformers.__version__)
        with hf_zero3.suspended(), (context if opened else contextlib.nullcontext()):
            return _load_under(context, original, cls, args, kwargs)

    @functools.wraps(original_from_config)
    def _from_config(cls, config, **kwargs):
        context, opened = _context_to_build_in()
        if context is None:
            return _whole(original_from_config, cls, (config,), kwargs)
        with (context if opened else contextlib.nullcontext()), _zero_init_already_active():
            return original_from_config(cls, config, **kwargs)

    @functools.wraps(original_initialize)
    def _initialize_weights(self, module, is_custom_code: bool = False):
        params = [] if getattr(module, "_is_hf_initialized", False) else _written_params(module, PreTrainedModel)
        if not params:
            return original_initialize(self, module, is_custom_code)
        with GatheredParameters(params, modifier_rank=0):
            return original_initialize(self, module, is_custom_code)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    PreTrainedModel._from_config = classmethod(_from_config)
    PreTrainedModel._initialize_weights = _initialize_weights
    _INSTALLED[0] = True
    hf_zero3.hooks_installed()
