"""One "node" of tests/test_zero_checkpoint_node_local.py: a torchrun worker training on its
node's own NVMe and checkpoint directories.

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT \\
        tests/node_local_train.py SCRATCH first|resume

The node's directories are ``SCRATCH/node<GROUP_RANK>/{nvme,ckpt}`` (GROUP_RANK: the node's
rank, set by torchrun), so no node ever sees another's. ``first`` trains SAVE_AT steps, saves
a checkpoint with ``checkpoint.use_node_local_storage``, trains on to STEPS, writes its
results and prints ``DONE``, then waits to be killed (a crash: no clean exit). ``resume``
loads the node's checkpoint, trains the same last steps, writes its results and exits.
Results: ``SCRATCH/results/<phase>-rank<r>.json`` (losses after the save, weight digests).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

import torch

import zero
from helpers import base_config, train_engine, weight_digests
from zero.examples import GPT, GPTConfig, make_batches

SAVE_AT, STEPS = 2, 4


def die_with_agent() -> None:
    """SIGKILL this worker when its torchrun agent dies: torchrun starts each worker in a session
    of its own, so the test, which stops a node by killing its agent's session, would leave it."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl
        os._exit(1)


def main(scratch: str, phase: str) -> None:
    die_with_agent()
    node = int(os.environ["GROUP_RANK"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    node_dir = os.path.join(scratch, f"node{node}")
    config = base_config("nvme", "nvme", os.path.join(node_dir, "nvme"), world_size=world, lr=1e-2,
                         sub_group_size=3000)
    config["checkpoint"] = {"use_node_local_storage": True}
    os.makedirs(os.path.join(node_dir, "nvme"), exist_ok=True)
    c = GPTConfig()
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(c), config=config)
    batches = make_batches(c, STEPS, 4 * world)
    ckpt = os.path.join(node_dir, "ckpt")
    if phase == "first":
        train_engine(engine, batches[:SAVE_AT], SAVE_AT, rank=rank, shards=world)
        engine.save_checkpoint(ckpt)
    else:
        path, _ = engine.load_checkpoint(ckpt)
        assert path == os.path.join(ckpt, f"global_step{SAVE_AT}"), path
    losses = train_engine(engine, batches[SAVE_AT:], STEPS - SAVE_AT, rank=rank, shards=world)
    result = {"node": node, "losses": losses, "weights": weight_digests(engine.module)}
    os.makedirs(os.path.join(scratch, "results"), exist_ok=True)
    with open(os.path.join(scratch, "results", f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # One write: the node's workers share its agent's stdout, and print's text and newline are two
    # writes, between which another worker's line can land.
    os.write(sys.stdout.fileno(), f"DONE rank {rank} pid {os.getpid()}\n".encode())
    if phase == "first":
        time.sleep(600)  # killed by the test: the node crashes after its checkpoint
    engine.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
