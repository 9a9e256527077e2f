"""What a checkpoint saves of each sub-group, and who holds it.

An engine with an optimizer keeps the trainable sub-groups' master and states in
its optimizer store; its frozen sub-groups have none and are saved as their
parameters' values, in fp32 (layouts.py [Note: the optimizer covers the
trainable units only]). :class:`CheckpointedState` routes each call of the
checkpoint protocol (optimizer_store.py [Note: each store saves and loads its
own state]) to the one that holds the sub-group; checkpoint/ sees one state.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from .layouts import SubGroup
from .optimizer_store import OptimizerStore
from .param_store import MasterFromParameters


class CheckpointedState:
    """The optimizer store for trainable sub-groups, the parameters for frozen ones."""

    def __init__(self, optimizer: OptimizerStore, frozen: MasterFromParameters):
        self.optimizer = optimizer
        self.frozen = frozen

    @property
    def state_names(self) -> Tuple[str, ...]:
        """The states of a trainable sub-group (a frozen one has its master alone)."""
        return self.optimizer.state_names

    def _of(self, sub_group: SubGroup):
        return self.frozen if sub_group.frozen else self.optimizer

    def viewed(self, sub_group: SubGroup):
        return self._of(sub_group).viewed(sub_group)

    def save_shard(self, sub_group: SubGroup, shards, path: str) -> None:
        self._of(sub_group).save_shard(sub_group, shards, path)

    def load_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                   carried: Optional[Tuple[str, Dict[str, int]]] = None) -> torch.Tensor:
        return self._of(sub_group).load_shard(sub_group, shard, path, keys, load_states, carried)

    def stage_shard(self, sub_group: SubGroup, shard, path: str, keys: Sequence[str], load_states: bool,
                    algorithm) -> Optional[object]:
        return self._of(sub_group).stage_shard(sub_group, shard, path, keys, load_states, algorithm)

    def publish_shard(self, sub_group: SubGroup, staged,
                      carried: Tuple[str, Dict[str, int]]) -> Optional[torch.Tensor]:
        return self._of(sub_group).publish_shard(sub_group, staged, carried)

    def discard_staged(self, staged) -> None:
        self.optimizer.discard_staged(staged)  # the parameters stage nothing

    def load(self, sub_group: SubGroup, master: torch.Tensor, states: Optional[Dict[str, torch.Tensor]]) -> None:
        self._of(sub_group).load(sub_group, master, states)
