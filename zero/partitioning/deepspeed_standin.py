"""The ``deepspeed`` that transformers imports while this engine's ZeRO-3 is on and DeepSpeed is not
installed: two names, both this package's own. hf_zero3.py puts it in ``sys.modules`` and takes it out.

[Note: the deepspeed that transformers imports]
Once ``is_deepspeed_zero3_enabled()`` is true, transformers' ZeRO-3 branches run ``import deepspeed``
at the call site and use names from it. Under this engine they call two:

- ``deepspeed.zero.GatheredParameters(params, modifier_rank=...)``: :class:`zero.GatheredParameters`
  (``resize_token_embeddings`` and the lm head, the constructors of models that gather a weight to
  rewrite it: wav2vec2's positional convolution, DistilBERT's sinusoidal table, ...);
- ``deepspeed.zero.register_external_parameter(module, param)``: nothing to do; the engine finds a
  parameter used outside its module when it is used (runtime/hooks.py).

The branches that call anything else (``deepspeed.zero.Init``, ``deepspeed.comm``,
``deepspeed.accelerator``, ``deepspeed.runtime``) are those of ``from_pretrained`` and
``from_config``, which run on this package's own paths instead (hf_hook.py); should transformers
ever reach one, the attribute or the import fails and names it, rather than a model being built
DeepSpeed's way behind our back.

Why a module in ``sys.modules`` rather than patching transformers: its ZeRO-3 code is some forty
call sites across ``modeling_utils`` and the model files, each importing ``deepspeed`` where it
runs; replacing the functions around them would mean copying and tracking each. One module object
that exists only while ours is active covers them all and changes none of transformers' code.

It never stands in for a real DeepSpeed: :func:`install` refuses when ``deepspeed`` is already
imported or importable (``importlib.util.find_spec``), and :func:`remove` takes out only the module
objects it put in. ``is_deepspeed_available()`` of transformers and of accelerate stays False while
it is there, because both also ask for the package's metadata, which the stand-in has none of: the
Trainer and accelerate never take their DeepSpeed paths because of it.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict

from .gathered import GatheredParameters

NAME = "deepspeed"
_INSTALLED: Dict[str, types.ModuleType] = {}  # the module objects this module put in sys.modules


def register_external_parameter(module, parameter) -> None:
    """DeepSpeed's ``zero.register_external_parameter``: nothing to record here, the engine gathers a
    parameter used outside the module that owns it when it is used (runtime/hooks.py)."""
    return None


def _module(name: str, doc: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []  # no submodule but those set here: any other import of deepspeed.x fails
    return module


def _build() -> Dict[str, types.ModuleType]:
    package = _module(NAME, "Stand-in for DeepSpeed, put here by zero (zero/partitioning/deepspeed_standin.py) "
                            "while its ZeRO-3 is on; not the deepspeed package.", package=True)
    zero = _module(f"{NAME}.zero", "zero.GatheredParameters, as transformers calls it.")
    zero.GatheredParameters = GatheredParameters
    zero.register_external_parameter = register_external_parameter
    package.zero = zero
    return {NAME: package, f"{NAME}.zero": zero}


def installed() -> bool:
    """The stand-in is what ``import deepspeed`` gives now."""
    return NAME in _INSTALLED and sys.modules.get(NAME) is _INSTALLED[NAME]


def real_deepspeed_present() -> bool:
    """A ``deepspeed`` other than the stand-in is imported or importable."""
    module = sys.modules.get(NAME)
    if module is not None:
        return module is not _INSTALLED.get(NAME)
    try:
        return importlib.util.find_spec(NAME) is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Put the stand-in in ``sys.modules`` unless a real DeepSpeed is there or importable; True when
    ``import deepspeed`` gives the stand-in afterwards."""
    if installed():
        return True
    if real_deepspeed_present():
        return False
    modules = _build()
    sys.modules.update(modules)
    _INSTALLED.clear()
    _INSTALLED.update(modules)
    return True


def remove() -> None:
    """Take the stand-in's modules out of ``sys.modules`` (a module someone else put there stays)."""
    for name, module in _INSTALLED.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
    _INSTALLED.clear()

