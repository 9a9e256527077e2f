"""Resolving ``"auto"`` values, with the rules Hugging Face uses (auto_rules.py).

A key may hold ``"auto"`` only where a rule in auto_rules.py says how to fill it:

- from the model's hidden size ``h``: ``reduce_bucket_size = h²``,
  ``stage3_prefetch_bucket_size = int(0.9·h²)``,
  ``stage3_param_persistence_threshold = 10·h``;
- from a value the trainer knows, passed to :func:`resolve_auto` by keyword
  (``lr=``, ``betas=``, ``train_micro_batch_size_per_gpu=``, ``fp16=``...);
- a batch size may also be derived from the other two (batch.py).

Anything else left ``"auto"`` is an error that names the key and the keyword
that fills it. Known values fill ``"auto"`` keys only: a value written in the
config wins.
"""

from __future__ import annotations

from typing import Any, Optional

from nvmeio.hints import did_you_mean

from .auto_rules import BATCH_KEYS, KNOWN_NAMES, RULES, AutoRule, unresolved_message
from .batch import ACCUM, MICRO, TRAIN
from .ds_config import DeepSpeedConfig, validate_config
from .errors import ConfigError, Problem, UnresolvedAutoError
from .values import AUTO


def _value(rule: AutoRule, hidden_size: Optional[int], known: dict[str, Any]) -> Any:
    if rule.known in known:
        return known[rule.known]
    if rule.fallback is not None and rule.fallback in known:
        return known[rule.fallback]
    if rule.from_hidden is not None and hidden_size is not None:
        return rule.from_hidden(hidden_size)
    return None


def fill_autos(data: dict, hidden_size: Optional[int], known: dict[str, Any],
               require_all: bool) -> list[Problem]:
    """Replace the ``"auto"`` values of a dumped config, in place.

    With ``require_all``, a batch size no rule fills is removed so that it is
    derived from the other two (batch.py), and every other ``"auto"`` left is
    returned as a problem.
    """
    problems, removed = [], []
    for rule in RULES:
        parent: Any = data
        for key in rule.path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        leaf = rule.path[-1]
        if not isinstance(parent, dict) or parent.get(leaf) != AUTO:
            continue
        value = _value(rule, hidden_size, known)
        if value is not None:
            parent[leaf] = value
        elif require_all and rule.known in BATCH_KEYS:
            del parent[leaf]
            removed.append(leaf)
        elif require_all:
            problems.append(Problem(".".join(rule.path), unresolved_message(".".join(rule.path))))
    if data.get(TRAIN) is None and data.get(MICRO) is None:
        # Neither size that fixes the others is left: nothing to derive them from.
        problems += [Problem(key, unresolved_message(key)) for key in removed if key != ACCUM]
    return problems


def check_hidden_size(hidden_size: Any) -> Optional[int]:
    if hidden_size is None:
        return None
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ConfigError([Problem("hidden_size", f"must be a positive integer, got {hidden_size!r}")])
    return hidden_size


def resolve_auto(config: DeepSpeedConfig, hidden_size: Optional[int] = None, world_size: int = 1,
                 **known: Any) -> DeepSpeedConfig:
    """A copy of ``config`` with every ``"auto"`` replaced; ConfigError if one remains.

    ``hidden_size`` fills the bucket sizes (rules above); ``known`` gives the
    trainer's values by key name: ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``warmup_min_lr``, ``warmup_max_lr`` (else ``lr``), ``warmup_num_steps``,
    ``total_num_steps``, ``fp16``, ``bf16``, ``gradient_clipping``,
    ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` (a missing batch size is derived from the
    other two and ``world_size``), and the three bucket-size keys.
    """
    if not isinstance(config, DeepSpeedConfig):
        raise TypeError(f"resolve_auto() takes a DeepSpeedConfig (from zero.config.load_config), "
                        f"got {type(config).__name__}")
    unknown = [name for name in known if name not in KNOWN_NAMES]
    if unknown:
        problems = []
        for name in unknown:
            hint = did_you_mean(name, KNOWN_NAMES)
            hint = f"did you mean '{hint}'?" if hint else f"known values: {', '.join(sorted(KNOWN_NAMES))}"
            problems.append(Problem("", f"resolve_auto() got an unknown keyword '{name}'; {hint}"))
        raise ConfigError(problems)
    hidden_size = check_hidden_size(hidden_size)
    data = config.model_dump(exclude_unset=True)
    problems = fill_autos(data, hidden_size, known, require_all=True)
    if problems:
        raise UnresolvedAutoError(problems)
    return validate_config(data, world_size=world_size, quiet=True)

