"""Whether transformers sees ZeRO-3: ``transformers.integrations.is_deepspeed_zero3_enabled()`` is
true while one of this package's *sources* is active: a stage-3 ``zero.hf.HfDeepSpeedConfig`` that
lives, a ``zero.Init`` context that is open, a stage-3 engine that is not destroyed (or collected).

[Note: how transformers learns that ZeRO-3 is on]
transformers reads one global: the weak reference ``set_hf_deepspeed_config`` keeps to an object
with ``is_zero3()`` and ``.config`` (its own ``HfDeepSpeedConfig`` puts itself there). While a
source of ours is active that reference points to this module's :data:`FLAG`, and ``import
deepspeed`` gives the stand-in of deepspeed_standin.py, on which transformers' ZeRO-3 branches
land (``GatheredParameters``). Then ``generate`` syncs the ranks by default (``synced_gpus``: a rank
that finishes early keeps joining the others' gathers instead of leaving them waiting), models
whose constructors gather a weight do so, ``resize_token_embeddings`` gathers the embeddings, and
the Trainer counts parameters by ``ds_numel``. When the last source goes, the reference is put back
as it was (unless someone replaced it meanwhile) and the stand-in leaves ``sys.modules``.
transformers is told only once hf_hook.py's wrappers are installed (each source installs them when
transformers is imported): told before, it would build and load models its own DeepSpeed way, on
names the stand-in does not have.

Where a real DeepSpeed is importable nothing is registered and a warning says so once: its
``zero.GatheredParameters`` would be the one transformers calls, and it knows nothing of this
engine's parameters. Stage 0-2 configs are no source: ``is_zero3()`` is False for them, as for
DeepSpeed, and transformers takes none of its branches.

A source that opens contexts (``HfDeepSpeedConfig``) is what ``from_pretrained`` and
``from_config`` build under, as with DeepSpeed; the others only tell transformers (hf_hook.py).
``from_pretrained`` runs transformers' plain loading path with the flag off on its own thread
(:func:`suspended`), because the ZeRO-3 one reads the whole checkpoint into memory on rank 0.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from typing import Callable, List, Optional

from . import deepspeed_standin

_LOCK = threading.RLock()
_SOURCES: List[weakref.ref] = []  # active sources, oldest first
_SUSPENDED = threading.local()
_REGISTERED = [False]  # FLAG is transformers' config reference
_HOOKED = [False]  # hf_hook.py's wrappers are installed: transformers may be told only then
_PREVIOUS: List[Optional[weakref.ref]] = [None]  # transformers' reference before FLAG took its place
_WARNED = [False]


class Zero3Source:
    """One reason for transformers to see ZeRO-3, active from :func:`activate` to :func:`deactivate`
    (or until nothing else holds it).

    ``config``: the DeepSpeed config dict that ``transformers.integrations.deepspeed_config()``
    returns meanwhile. ``open_init``: makes a ``zero.Init`` context for that config, for a source
    under which models are built and loaded partitioned (None: they are built whole).
    """

    def __init__(self, what: str, config: dict, open_init: Optional[Callable[[], object]] = None):
        self.what = what
        self.config = config
        self.open_init = open_init

    def __repr__(self) -> str:
        return f"Zero3Source({self.what})"


class _Zero3Flag:
    """What transformers' ``set_hf_deepspeed_config`` holds while a source is active."""

    def is_zero3(self) -> bool:
        return bool(_live()) and not getattr(_SUSPENDED, "depth", 0)

    @property
    def config(self) -> Optional[dict]:
        live = _live()
        return live[-1].config if live else None


FLAG = _Zero3Flag()


def _live() -> List[Zero3Source]:
    return [s for s in (ref() for ref in _SOURCES) if s is not None]


def _gone(ref: weakref.ref) -> None:
    if sys.meta_path is None:  # the interpreter is shutting down: nothing is left to tell
        return
    with _LOCK:
        if ref in _SOURCES:
            _SOURCES.remove(ref)
        _sync()


def activate(source: Zero3Source) -> None:
    with _LOCK:
        _SOURCES.append(weakref.ref(source, _gone))
        _sync()


def deactivate(source: Optional[Zero3Source]) -> None:
    """Undo one :func:`activate` of ``source`` (activated twice, as a re-entered context is, it stays
    active until deactivated twice)."""
    with _LOCK:
        _SOURCES[:] = [ref for ref in _SOURCES if ref() is not None]
        for i in range(len(_SOURCES) - 1, -1, -1):
            if _SOURCES[i]() is source:
                del _SOURCES[i]
                break
        _sync()


def is_on() -> bool:
    """A source is active (whatever transformers was told)."""
    return bool(_live())


def latest_builder() -> Optional[Zero3Source]:
    """The most recent active source that opens ``zero.Init`` contexts, if any."""
    return next((s for s in reversed(_live()) if s.open_init is not None), None)


@contextlib.contextmanager
def suspended():
    """``is_zero3()`` is False on this thread meanwhile."""
    _SUSPENDED.depth = getattr(_SUSPENDED, "depth", 0) + 1
    try:
        yield
    finally:
        _SUSPENDED.depth -= 1


def hooks_installed() -> None:
    """hf_hook.py wrapped transformers' model building: tell it what is active now, and from now on.
    (Told before, transformers would build and load models its own DeepSpeed way, on names the
    stand-in does not have.)"""
    with _LOCK:
        _HOOKED[0] = True
        _sync()


def _sync() -> None:
    live = bool(_live())
    if live and not _REGISTERED[0] and _HOOKED[0] and "transformers" in sys.modules:
        if not deepspeed_standin.install():
            _warn_real_deepspeed()
            return
        from transformers.integrations import deepspeed as hf_deepspeed

        _PREVIOUS[0] = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
        hf_deepspeed.set_hf_deepspeed_config(FLAG)
        _REGISTERED[0] = True
    elif not live and _REGISTERED[0]:
        from transformers.integrations import deepspeed as hf_deepspeed

        current = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
        if current is not None and current() is FLAG:
            previous = _PREVIOUS[0]() if _PREVIOUS[0] is not None else None
            if previous is not None:
                hf_deepspeed.set_hf_deepspeed_config(previous)
            else:
                hf_deepspeed.unset_hf_deepspeed_config()
        _PREVIOUS[0] = None
        _REGISTERED[0] = False
        deepspeed_standin.remove()


def _warn_real_deepspeed() -> None:
    if _WARNED[0]:
        return
    _WARNED[0] = True
    warnings.warn(
        "a deepspeed package is importable, so transformers is not told that zero's ZeRO-3 is on "
        "(is_deepspeed_zero3_enabled() stays False): its ZeRO-3 branches would call DeepSpeed's "
        "GatheredParameters on this engine's parameters. from_pretrained and from_config still build "
        "partitioned models; pass generate(synced_gpus=True) on several ranks, and gather parameters "
        "with zero.GatheredParameters before resizing embeddings", RuntimeWarning, stacklevel=3)
