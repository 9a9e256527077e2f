"""The three batch sizes and the rule that ties them.

``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size``

As in DeepSpeed, any two determine the third; ``train_batch_size`` alone means
one accumulation step; the micro batch alone means one accumulation step.
Unlike DeepSpeed, a config with none of the first two loads: the micro batch is
then whatever the data loader hands the engine, ``gradient_accumulation_steps``
defaults to 1, and ``train_batch_size`` stays None.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    train_batch_size: Optional[int]
    train_micro_batch_size_per_gpu: Optional[int]
    gradient_accumulation_steps: int


def derive_batch_sizes(train: Optional[int], micro: Optional[int], accum: Optional[int],
                       world_size: int) -> tuple[BatchSizes | None, list[tuple[str, str]]]:
    """Complete the three sizes from those given; or ``(None, [(key, why)])``."""
    ws = world_size
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * ws:
            return None, [(TRAIN, (
                f"{TRAIN} ({train}) must equal {MICRO} ({micro}) × {ACCUM} ({accum}) × "
                f"world_size ({ws}) = {micro * accum * ws}"))]
        return BatchSizes(train, micro, accum), []
    if train is not None and micro is not None:
        if train % (micro * ws):
            return None, [(TRAIN, (
                f"{TRAIN} ({train}) is not a multiple of {MICRO} ({micro}) × world_size ({ws}) "
                f"= {micro * ws}, so {ACCUM} cannot be derived"))]
        return BatchSizes(train, micro, train // (micro * ws)), []
    if train is not None and accum is not None:
        if train % (accum * ws):
            return None, [(TRAIN, (
                f"{TRAIN} ({train}) is not a multiple of {ACCUM} ({accum}) × world_size ({ws}) "
                f"= {accum * ws}, so {MICRO} cannot be derived"))]
        return BatchSizes(train, train // (accum * ws), accum), []
    if train is not None:
        if train % ws:
            return None, [(TRAIN, (
                f"{TRAIN} ({train}) is not a multiple of world_size ({ws}), so {MICRO} "
                f"cannot be derived; set {MICRO} and {ACCUM}"))]
        return BatchSizes(train, train // ws, 1), []
    if micro is not None:
        accum = 1 if accum is None else accum
        return BatchSizes(micro * accum * ws, micro, accum), []
    return BatchSizes(None, None, 1 if accum is None else accum), []
