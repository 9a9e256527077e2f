"""``activation_checkpointing``: DeepSpeed's activation checkpointing section.

``cpu_checkpointing`` (DeepSpeed: checkpointed activations kept in host memory) has an
effect on ``engine.train_batch``, whose window holds the tensors the k micro-batches
saved for backward all at once (with activation checkpointing, only each checkpointed
segment's inputs): they are kept in host memory (on CUDA: moved there), and past
``max_in_cpu_bytes`` (nvmeio's own) the oldest go to NVMe, under the ``nvme_path`` of
``offload_param`` (else of ``offload_optimizer``), and are read back ahead of the
backward that needs them; results are bit-identical either way (see
zero/runtime/activation_spill.py). Without an offload to NVMe they all stay in host
memory (one log line says so), and a ``max_in_cpu_bytes`` is refused. The other keys are
checked (a typo is an error); setting one warns that it has no effect here.

Example::

    "activation_checkpointing": {"cpu_checkpointing": true, "max_in_cpu_bytes": 8e9}
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import model_validator

from .base import StrictModel, raise_problems
from .values import Flag, Int


class ActivationCheckpointingConfig(StrictModel):
    _inert: ClassVar[frozenset[str]] = frozenset({
        "partition_activations", "contiguous_memory_optimization",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})

    partition_activations: Flag = False
    contiguous_memory_optimization: Flag = False
    cpu_checkpointing: Flag = False
    """Tensors a train_batch window saves for backward are kept in host memory (on CUDA: moved
    there), past ``max_in_cpu_bytes`` on NVMe."""
    max_in_cpu_bytes: Optional[Int(minimum=0)] = None
    """nvmeio's own, with cpu_checkpointing: bytes of saved activations one rank keeps in host
    memory during a train_batch window before the oldest go to NVMe (saved tensors under
    64 KiB stay where they are and are not counted). Default: a quarter of what MemAvailable
    leaves beside the engine's planned host memory (zero/stores/memory_check.py: half of it is
    the gradient stash's, half of the rest the forward's and backward's working tensors')."""
    number_checkpoints: Optional[Int(minimum=1)] = None
    synchronize_checkpoint_boundary: Flag = False
    profile: Flag = False

    @model_validator(mode="after")
    def _check(self) -> "ActivationCheckpointingConfig":
        problems: list[tuple[tuple[str, ...], str, Any]] = []
        if self.max_in_cpu_bytes is not None and not self.cpu_checkpointing:
            problems.append((("max_in_cpu_bytes",), (
                "max_in_cpu_bytes is the host-memory budget of cpu_checkpointing, which is false; set "
                "cpu_checkpointing to true, or drop max_in_cpu_bytes"), self.max_in_cpu_bytes))
        raise_problems(type(self).__name__, problems)
        return self


def spill_offload(zero_section) -> Any:
    """The offload section whose ``nvme_path`` takes spilled activations: ``offload_param``'s when
    its device is nvme, else ``offload_optimizer``'s; None when neither is."""
    for offload in (zero_section.offload_param, zero_section.offload_optimizer):
        if offload.device == "nvme":
            return offload
    return None
