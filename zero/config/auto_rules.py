"""The rules that fill ``"auto"`` values: which keys may hold it and where the value comes from.

Kept apart from auto.py (which validates whole configs) so that the base
model can name the rule of a key still holding ``"auto"`` without importing
the models built on it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from .batch import ACCUM, MICRO, TRAIN

__all__ = ["AutoRule", "RULES", "RULE_BY_PATH", "KNOWN_NAMES", "BATCH_KEYS", "unresolved_message"]


class AutoRule(NamedTuple):
    """How one key's ``"auto"`` is filled."""

    path: tuple[str, ...]
    known: str
    """Keyword of :func:`resolve_auto` giving the value."""
    from_hidden: Optional[Callable[[int], int]] = None
    """Formula of the model's hidden size, used when ``known`` is not passed."""
    fallback: Optional[str] = None
    """Another keyword used when ``known`` is not passed (warmup_max_lr <- lr)."""


RULES: tuple[AutoRule, ...] = (
    AutoRule(("zero_optimization", "reduce_bucket_size"), "reduce_bucket_size",
             from_hidden=lambda h: h * h),
    AutoRule(("zero_optimization", "stage3_prefetch_bucket_size"), "stage3_prefetch_bucket_size",
             from_hidden=lambda h: int(0.9 * h * h)),
    AutoRule(("zero_optimization", "stage3_param_persistence_threshold"),
             "stage3_param_persistence_threshold", from_hidden=lambda h: 10 * h),
    AutoRule(("optimizer", "params", "lr"), "lr"),
    AutoRule(("optimizer", "params", "betas"), "betas"),
    AutoRule(("optimizer", "params", "eps"), "eps"),
    AutoRule(("optimizer", "params", "weight_decay"), "weight_decay"),
    AutoRule(("scheduler", "params", "warmup_min_lr"), "warmup_min_lr"),
    AutoRule(("scheduler", "params", "warmup_max_lr"), "warmup_max_lr", fallback="lr"),
    AutoRule(("scheduler", "params", "warmup_num_steps"), "warmup_num_steps"),
    AutoRule(("scheduler", "params", "total_num_steps"), "total_num_steps"),
    AutoRule(("fp16", "enabled"), "fp16"),
    AutoRule(("bf16", "enabled"), "bf16"),
    AutoRule(("gradient_clipping",), "gradient_clipping"),
    AutoRule((TRAIN,), TRAIN),
    AutoRule((MICRO,), MICRO),
    AutoRule((ACCUM,), ACCUM),
)

RULE_BY_PATH = {".".join(rule.path): rule for rule in RULES}
KNOWN_NAMES = frozenset(rule.known for rule in RULES)
BATCH_KEYS = (TRAIN, MICRO, ACCUM)


def unresolved_message(path: str) -> str:
    """What to do about ``path`` still holding ``"auto"``."""
    rule = RULE_BY_PATH.get(path)
    if rule is None:
        return 'still "auto"; write a value in the config'
    ways = [f"pass {rule.known}=<value> to zero.config.resolve_auto()"]
    if rule.from_hidden is not None:
        ways.insert(0, "pass hidden_size=<the model's hidden size> to load_config() or resolve_auto()")
    if rule.fallback is not None:
        ways.append(f"pass {rule.fallback}=<value>")
    if rule.known in BATCH_KEYS:
        ways.append("give two of " + ", ".join(BATCH_KEYS))
    return f'still "auto"; {", or ".join(ways)}, or write a value in the config'
