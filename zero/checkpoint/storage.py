"""Which rank writes a checkpoint's shared files, and where; what a rank may read back.

[Note: node-local storage]
With ``checkpoint.use_node_local_storage: false`` (the default) every rank saves
into one directory all of them see (a shared file system): rank 0 makes the
partial directory, writes ``zero_meta.json`` and ``buffers.pt``, publishes the
tag and writes ``latest``; each rank writes its own shards and engine state.

With ``true`` the save directory is a path on each node's own storage
(ZeRO-Infinity machines' NVMe is node-local, and no node sees another's). Each
node's first rank (``LOCAL_RANK`` 0) is its *storage leader*: it does rank 0's
part in its node's copy of the directory, so every node ends up holding the
shared files (``latest``, ``zero_meta.json``, ``buffers.pt``) and its own ranks'
shards, and resumes from them alone. The publish protocol (publish.py) runs on
every copy: a barrier after every rank's files are written, then each leader
publishes its copy and rewrites its ``latest``.

Which ranks share storage is checked, not assumed. Each node's first rank
creates a probe file in the save directory and every rank looks for every
probe. A rank must see its own node's (the ranks of one node share its
storage; ``LOCAL_RANK`` numbers them consecutively, as torchrun does). Leaders
that see each other's probe share one directory after all (the flag set on a
shared file system, or two "nodes" of one machine given one path): the lowest
of them leads that directory alone, so that no directory is cleaned up or
published by two ranks at once.

A load reads only the copy its rank sees: its own shards and engine state, and
its node's ``latest``, ``zero_meta.json`` and ``buffers.pt``. Before anything
changes, the ranks check that every copy names the same tag and holds the same
checkpoint (the same metadata and step). A load on another world size or
``sub_group_size`` needs other ranks' shards: it is refused, naming what is on
other nodes, unless those files are there too (copied into every node's copy).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from nvmeio.atomic_file import create_exclusive

from .format import META, rank_dir, resolve_tag
from .publish import PROBE

_KEY = "checkpoint.use_node_local_storage"


@dataclass(frozen=True)
class SaveRoles:
    """This rank's part in a save: ``leader`` makes the partial directory of the copy this
    rank writes into, writes its shared files, publishes it and rewrites its ``latest``."""

    rank: int
    leader: int

    @property
    def leads(self) -> bool:
        return self.rank == self.leader


def gather_checked(comm, fn: Callable[[], object], what: str) -> list:
    """``fn()`` on every rank, every rank's result in rank order. An exception on any rank
    is raised on every rank (its own on the rank that failed, a RuntimeError naming that
    rank on the others), so that no rank waits in a collective for one that failed."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        result, error = None, exc
    gathered = comm.all_gather_object((result, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    for rank, (_, message) in enumerate(gathered):
        if message is not None:
            raise RuntimeError(f"{what} failed on rank {rank}: {message}")
    return [r for r, _ in gathered]


def node_leader(comm) -> int:
    """The first rank of this rank's node: ``rank - LOCAL_RANK`` (a launcher numbers a node's
    ranks consecutively)."""
    return comm.rank - comm.local_rank


def save_roles(comm, save_dir: str, node_local: bool, dir_mode: int) -> SaveRoles:
    """Who leads the copy of ``save_dir`` this rank writes into (see [Note: node-local storage])."""
    if not node_local or not comm.distributed:
        return SaveRoles(comm.rank, 0)
    probe: List[Optional[str]] = [None]

    def make_probe() -> Optional[str]:
        if comm.local_rank != 0:
            return None
        os.makedirs(save_dir, mode=dir_mode, exist_ok=True)
        name = f"{PROBE}{secrets.token_hex(8)}"
        os.close(create_exclusive(os.path.join(save_dir, name), 0o600))
        probe[0] = name
        return name

    try:
        probes = gather_checked(comm, make_probe, "preparing the checkpoint directory")
        # Each rank looks before the next collective ends: only then is a probe removed.
        leaders = gather_checked(comm, lambda: _storage_leader(comm, save_dir, probes),
                                 "finding which ranks share checkpoint storage")
    finally:
        if probe[0] is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(save_dir, probe[0]))
    return SaveRoles(comm.rank, leaders[comm.rank])


def _storage_leader(comm, save_dir: str, probes: List[Optional[str]]) -> int:
    node = node_leader(comm)
    if not 0 <= node < len(probes) or probes[node] is None:
        raise ValueError(f"{_KEY}: rank {comm.rank} has LOCAL_RANK {comm.local_rank}, but rank {node} is not "
                         f"the first rank of a node (LOCAL_RANK 0); the ranks of a node must be numbered "
                         f"consecutively, as torchrun and the deepspeed launcher number them")
    seen = [r for r, name in enumerate(probes)
            if name is not None and os.path.exists(os.path.join(save_dir, name))]
    if node not in seen:
        raise ValueError(f"{_KEY}: rank {comm.rank} does not see the checkpoint directory {save_dir} that "
                         f"rank {node}, the first rank of its node, saves into; every rank of a node must "
                         f"save into the same directory of the node's storage")
    return min(seen)


# -- loading: each rank reads its own node's copy ---------------------------------------------------

def ranks_text(ranks: List[int]) -> str:
    """``[0, 1, 2, 5]`` as "ranks 0-2, 5"."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _by_value(values: list) -> Dict[object, List[int]]:
    groups: Dict[object, List[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def agreed_local_tag(comm, load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag every rank's copy of ``load_dir`` names (``tag`` if given, else its
    ``latest``); None when no copy has a ``latest``. Copies that disagree are refused on
    every rank: the nodes would resume different checkpoints."""
    tags = gather_checked(comm, lambda: resolve_tag(load_dir, tag), f"reading {os.path.join(load_dir, 'latest')}")
    groups = _by_value(tags)
    if len(groups) == 1:
        return tags[0]
    found = "; ".join(f"{ranks_text(ranks)} find " + (repr(t) if t is not None else "no checkpoint (no latest)")
                      for t, ranks in groups.items())
    raise ValueError(f"{_KEY}: the nodes' copies of {load_dir} name different checkpoints ({found}); a save "
                     f"was probably cut short on some nodes. Pass the tag every node holds "
                     f"(load_checkpoint(dir, tag=...))")


def check_local_files(checkpoint: str, rank: int, paths: List[str], resharding: bool) -> None:
    """Every file this rank will read is in its node's copy of ``checkpoint``; else a
    FileNotFoundError saying which ranks' files that copy holds."""
    missing = [p for p in dict.fromkeys(paths) if not os.path.isfile(p)]
    if not missing:
        return
    held = sorted(int(e[4:]) for e in _entries(checkpoint) if e.startswith("rank") and e[4:].isdigit())
    holds = f"it holds the files of {ranks_text(held)}" if held else "it holds no rank's files"
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    if resharding:
        raise FileNotFoundError(
            f"{_KEY}: loading {checkpoint} on another world size or sub_group_size reads other ranks' "
            f"shards, and this node's copy lacks {shown} ({holds}: each node saved only its own ranks'). "
            f"Load on the world size and sub_group_size it was saved with, or copy every node's "
            f"{os.path.basename(checkpoint)}/rank* directories into each node's copy")
    if not os.path.isdir(rank_dir(checkpoint, rank)):
        raise FileNotFoundError(
            f"{_KEY}: this node's copy of {checkpoint} has no files of rank {rank} ({holds}): a node "
            f"resumes the ranks it saved, so each node must get the same ranks as at the save (the "
            f"same node order and processes per node)")
    raise FileNotFoundError(f"checkpoint {checkpoint} is incomplete on this node: {shown} is missing")


def _entries(directory: str) -> List[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def check_same_copies(comm, checkpoint: str, state: dict) -> None:
    """Every rank read the same checkpoint: its copy's ``zero_meta.json`` and the step
    counters of the engine state it loaded agree across ranks; else a ValueError on every
    rank (nothing was loaded yet)."""
    with open(os.path.join(checkpoint, META), "rb") as f:
        meta = hashlib.sha256(f.read()).hexdigest()
    mine = (meta, state["global_steps"], state["global_samples"])
    groups = _by_value(comm.all_gather_object(mine))
    if len(groups) == 1:
        return
    found = "; ".join(f"{ranks_text(ranks)} read step {steps} ({META} {digest[:12]})"
                      for (digest, steps, _), ranks in groups.items())
    raise ValueError(f"{_KEY}: the nodes' copies of {checkpoint} are not the same checkpoint ({found}); "
                     f"nothing was loaded")
