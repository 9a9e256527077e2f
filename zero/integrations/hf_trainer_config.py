"""A DeepSpeed config's ``"auto"`` values filled from Hugging Face ``TrainingArguments``.

The rules are those of HF's own DeepSpeed integration (transformers 5.x,
``HfTrainerDeepSpeedConfig``): batch sizes, accumulation, clipping, the
optimizer's lr / betas / eps / weight_decay, the warmup schedulers' min / max
lr, warmup and total steps, fp16 / bf16 from the flags, and the three bucket
sizes from the model's hidden size. As HF does, a value written in the config
that disagrees with the TrainingArguments is refused (set it to ``"auto"``).
Filling and validation are zero.config's (:func:`zero.config.resolve_auto`).
No transformers import: ``args`` only needs the TrainingArguments attributes.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Mapping, Optional

from ..config import ConfigError, DeepSpeedConfig, Problem, load_config, resolve_auto
from ..config.load import read_json

# config path -> (resolve_auto keyword, the TrainingArguments name HF reports in a mismatch)
MATCHED: Dict[str, tuple] = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    "train_batch_size": ("train_batch_size", "train_batch_size (world x micro x accumulation)"),
    "gradient_clipping": ("gradient_clipping", "max_grad_norm"),
    "optimizer.params.lr": ("lr", "learning_rate"),
    "optimizer.params.betas": ("betas", "adam_beta1, adam_beta2"),
    "optimizer.params.eps": ("eps", "adam_epsilon"),
    "optimizer.params.weight_decay": ("weight_decay", "weight_decay"),
    "scheduler.params.warmup_max_lr": ("warmup_max_lr", "learning_rate"),
    "fp16.enabled": ("fp16", "fp16 or fp16_full_eval"),
    "bf16.enabled": ("bf16", "bf16 or bf16_full_eval"),
    "scheduler.params.total_num_steps": ("total_num_steps", "the number of training steps"),
    "scheduler.params.warmup_num_steps": ("warmup_num_steps", "warmup_steps"),
}
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


def read_config(source) -> dict:
    """The user's DeepSpeed config as a fresh dict (a path to JSON, or a mapping)."""
    if isinstance(source, (str, os.PathLike)):
        return read_json(os.fspath(source))
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    raise TypeError(f"zero_config must be a path to a DeepSpeed JSON file or a dict, got {type(source).__name__}")


def trainer_values(args, num_training_steps: Optional[int] = None) -> Dict[str, Any]:
    """What each ``"auto"`` becomes, by :func:`resolve_auto` keyword."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": args.world_size * micro * accumulation,
        "gradient_clipping": args.max_grad_norm,
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "warmup_min_lr": 0,  # not a TrainingArguments value; HF fills 0
        "warmup_max_lr": args.learning_rate,
        "fp16": bool(args.fp16 or args.fp16_full_eval),
        "bf16": bool(args.bf16 or args.bf16_full_eval),
    }
    if num_training_steps is not None:
        values["total_num_steps"] = num_training_steps
        values["warmup_num_steps"] = max(1, args.get_warmup_steps(num_training_steps))
    return values


def hidden_size_of(model) -> Optional[int]:
    """HF's rule: ``config.hidden_size``, else the largest of ``hidden_sizes``, else the text config's."""
    for config in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if config is None:
            continue
        if isinstance(getattr(config, "hidden_size", None), int):
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    return None


def _lookup(data: dict, path: str):
    node: Any = data
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _same(written: Any, wanted: Any) -> bool:
    if isinstance(written, (list, tuple)) and isinstance(wanted, (list, tuple)):
        return list(written) == list(wanted)
    return written == wanted


def mismatches(data: dict, values: Dict[str, Any]) -> List[Problem]:
    """Values written in the config (not ``"auto"``) that disagree with the TrainingArguments."""
    problems = []
    for path, (keyword, hf_name) in MATCHED.items():
        written = _lookup(data, path)
        if written is None or written == "auto" or keyword not in values or _same(written, values[keyword]):
            continue
        problems.append(Problem(path, (
            f"is {written!r} in the DeepSpeed config but the TrainingArguments give {values[keyword]!r} "
            f"({hf_name}); set it to \"auto\" or make them equal")))
    return problems


def resolve_for_trainer(data: dict, args, model, num_training_steps: Optional[int] = None) -> DeepSpeedConfig:
    """``data`` (a DeepSpeed config dict, not modified) with every ``"auto"`` filled from ``args`` and ``model``.

    ConfigError for values that disagree with ``args``, for bucket sizes left
    ``"auto"`` on a model without a hidden size, and (UnresolvedAutoError) for
    any other ``"auto"`` that nothing fills.
    """
    values = trainer_values(args, num_training_steps)
    problems = mismatches(data, values)
    hidden = hidden_size_of(model)
    if hidden is None:
        problems += [Problem(path, (
            f"\"auto\" is filled from the model's hidden size, but {type(model).__name__} has no "
            "config.hidden_size nor config.hidden_sizes; write an integer")) for path in HIDDEN_SIZE_KEYS
            if _lookup(data, path) == "auto"]
    if problems:
        raise ConfigError(problems)
    config = load_config(data, world_size=args.world_size)
    return resolve_auto(config, hidden_size=hidden, world_size=args.world_size, **values)
