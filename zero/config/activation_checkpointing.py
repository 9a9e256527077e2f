"""``activation_checkpointing``: DeepSpeed's activation checkpointing section. The keys are
checked (a typo is an error); enabling one warns that it has no effect here.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from .base import StrictModel
from .values import Flag, Int


class ActivationCheckpointingConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({
        "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})

    partition_activations: Flag = False
    contiguous_memory_optimization: Flag = False
    cpu_checkpointing: Flag = False
    number_checkpoints: Optional[Int(minimum=1)] = None
    synchronize_checkpoint_boundary: Flag = False
    profile: Flag = False
