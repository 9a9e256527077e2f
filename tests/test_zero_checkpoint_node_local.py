"""Node-local checkpoint storage (``checkpoint.use_node_local_storage``): each node saves the
shared files and its own ranks' shards into its own directory, and resumes from it alone.

Two "nodes" on one machine: ``torchrun --nnodes 2`` with 1 and with 2 processes per node, on
a loopback c10d rendezvous, each node with its own NVMe and checkpoint directory
(tests/node_local_train.py); both nodes are killed after their save and resumed. The
refusals run on two gloo ranks that are each told they are alone on their node
(``LOCAL_RANK`` 0), and a load on one process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import (finish_process, load_error, make_engine, run_ranks,
                     start_process, train_engine, wait_for_line, weight_digests)
from zero.examples import GPTConfig, make_batches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "node_local_train.py")
TOPOLOGIES = {"2x1": 1, "2x2": 2}  # name -> processes per node (two nodes each)
TIMEOUT_S = 240.0
SAVE_AT = 2


def _torchrun(scratch: str, phase: str, per_node: int, port: int, node: int, name: str):
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEED_TIMEOUT="3",
               PYTHONPATH=os.environ.get("PYTHONPATH", ""))  # tests/ (conftest): zero is the installed one
    return start_process([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                          "--nproc_per_node", str(per_node), "--node_rank", str(node),
                          "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                          f"--rdzv_id=node-local-{name}-{phase}", "--max_restarts", "0", WORKER, scratch, phase],
                         stderr=subprocess.STDOUT, env=env)


def _start(scratch, phase: str) -> dict:
    """Both nodes of every topology, started at once (a launch is mostly waiting)."""
    nodes = {}
    for (name, per_node), port in zip(TOPOLOGIES.items(), _distinct_ports(len(TOPOLOGIES))):
        nodes[name] = [_torchrun(os.path.join(scratch, name), phase, per_node, port, node, name) for node in (0, 1)]
    return nodes


def _distinct_ports(count: int) -> list:
    """``count`` free ports, all different: each socket is held until the last is chosen (one
    at a time, the system may hand out the same port twice, and two topologies would then meet
    in one rendezvous and wait for ever)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_until_done(node, count: int, deadline: float) -> None:
    """Lines of ``node``'s output until its ``count`` workers have printed DONE (counted anywhere in
    a line: the workers share the pipe, and another's output may precede a DONE on its line)."""
    done, printed = 0, []
    while done < count:
        line = wait_for_line(node, max(1.0, deadline - time.monotonic()))
        if not line:  # it exited
            out, _ = finish_process(node, 30)
            raise AssertionError("a node exited before its workers were done:\n" + "".join(printed) + (out or ""))
        printed.append(line)
        done += line.count("DONE rank ")


def _stop_all(nodes: dict) -> None:
    """Kill every node still running (its workers die with their agent) and wait for it."""
    for procs in nodes.values():
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            finish_process(proc, 30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per topology: the scratch directory, and each rank's results of the run that saved,
    was killed after training on, and of the run that resumed from node-local storage."""
    scratch = str(tmp_path_factory.mktemp("node_local"))
    deadline = time.monotonic() + TIMEOUT_S
    first = _start(scratch, "first")
    try:
        for name, procs in first.items():
            for proc in procs:
                _wait_until_done(proc, TOPOLOGIES[name], deadline)
    finally:
        _stop_all(first)  # both nodes crash after their checkpoint
    resume = _start(scratch, "resume")
    try:
        for procs in resume.values():
            for proc in procs:
                out, _ = finish_process(proc, max(1.0, deadline - time.monotonic()))
                assert proc.returncode == 0, f"a resumed node failed ({proc.returncode}):\n{out}"
    finally:
        _stop_all(resume)
    results = {}
    for name, per_node in TOPOLOGIES.items():
        results[name] = {"scratch": os.path.join(scratch, name), "first": [], "resume": []}
        for phase in ("first", "resume"):
            for rank in range(2 * per_node):
                with open(os.path.join(scratch, name, "results", f"{phase}-rank{rank}.json")) as f:
                    results[name][phase].append(json.load(f))
    return results


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_nodes_killed_after_a_save_resume_from_their_own_storage_as_if_never_stopped(runs, topology):
    run = runs[topology]
    for rank, (first, resumed) in enumerate(zip(run["first"], run["resume"])):
        assert resumed["losses"] == first["losses"], f"rank {rank}"
        assert resumed["weights"] == first["weights"], f"rank {rank}"


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_each_node_holds_the_shared_files_and_only_its_own_ranks_shards(runs, topology):
    per_node = TOPOLOGIES[topology]
    for node in (0, 1):
        ckpt = os.path.join(runs[topology]["scratch"], f"node{node}", "ckpt")
        tag = f"global_step{SAVE_AT}"
        with open(os.path.join(ckpt, "latest")) as f:
            assert f.read() == tag
        ranks = range(node * per_node, (node + 1) * per_node)
        assert sorted(os.listdir(os.path.join(ckpt, tag))) == (
            ["buffers.pt"] + [f"rank{r:05d}" for r in ranks] + ["zero_meta.json"])
        # The ranks of a node are the ones torchrun numbered on it, at the save as at the resume.
        assert {r["node"] for r in runs[topology]["first"][ranks[0]:ranks[-1] + 1]} == {node}


# -- refusals: two ranks, each alone on its "node", in one process each --------------------------------

def _engine(nvme, world_size: int):
    return make_engine(nvme, "nvme", world_size=world_size, lr=1e-2, sub_group_size=3000,
                       overrides={"checkpoint": {"use_node_local_storage": True}})


def _tree(path: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files)


def scenario_node_local(rank, world_size, scratch):
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = "0"  # every rank alone on its node
    node = os.path.join(scratch, f"node{rank}")
    ckpt = os.path.join(node, "ckpt")
    engine = _engine(os.path.join(node, "nvme"), world_size)
    batches = make_batches(GPTConfig(), 4, 4 * world_size)
    out = {}
    train_engine(engine, batches[:1], 1, rank=rank, shards=world_size)
    engine.save_checkpoint(ckpt)
    train_engine(engine, batches[1:2], 1, rank=rank, shards=world_size)
    engine.save_checkpoint(ckpt)
    out["files"] = _tree(ckpt)
    out["losses"] = train_engine(engine, batches[2:3], 1, rank=rank, shards=world_size)
    out["weights"] = weight_digests(engine.module)

    if rank == 1:  # this node's save of step 2 never published (its latest still names step 1)
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write("global_step1")
    out["latest_differs"] = load_error(engine, ckpt)
    dist.barrier()
    if rank == 1:
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write("global_step2")
    # One tag, but not the same checkpoint on both nodes.
    shutil.copytree(os.path.join(ckpt, f"global_step{2 - rank}"), os.path.join(ckpt, "mixed"))
    out["copies_differ"] = _load_tag_error(engine, ckpt, "mixed")
    # Each node given the other's storage.
    out["swapped"] = load_error(engine, os.path.join(scratch, f"node{1 - rank}", "ckpt"))
    # Only node 1 lacks its files: node 0 is told why.
    damaged = ckpt
    if rank == 1:
        damaged = os.path.join(node, "damaged")
        shutil.copytree(ckpt, damaged)
        shutil.rmtree(os.path.join(damaged, "global_step2", "rank00001"))
    out["one_node_lacks_files"] = load_error(engine, damaged)

    out["resumed"] = load_error(engine, ckpt)
    out["resumed_losses"] = train_engine(engine, batches[2:3], 1, rank=rank, shards=world_size)
    out["resumed_weights"] = weight_digests(engine.module)

    # The flag set, but both "nodes" given one directory: one copy, saved once.
    shared = os.path.join(scratch, "shared")
    engine.save_checkpoint(shared)
    out["shared_files"] = _tree(shared)
    out["shared_loaded"] = load_error(engine, shared)
    engine.destroy()
    return out


def _load_tag_error(engine, load_dir, tag):
    try:
        engine.load_checkpoint(load_dir, tag=tag)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("node_local_ranks")
    results = run_ranks(2, [("node_local", scenario_node_local, {})], scratch, timeout=300)
    errors = [r["node_local"]["error"] for r in results if "error" in r["node_local"]]
    assert not errors, errors[0]
    return str(scratch / "node_local"), [r["node_local"] for r in results]


def test_a_rank_alone_on_its_node_saves_the_shared_files_and_its_own_shards(ranks):
    _, results = ranks
    for rank, got in enumerate(results):
        shards = [f for f in got["files"] if f.startswith("global_step2/rank")]
        assert shards and all(f.startswith(f"global_step2/rank{rank:05d}/") for f in shards)
        for name in ("latest", "global_step2/zero_meta.json", "global_step2/buffers.pt"):
            assert name in got["files"]


def test_a_resume_from_node_local_storage_continues_exactly(ranks):
    _, results = ranks
    for got in results:
        assert got["resumed"] is None
        assert got["resumed_losses"] == got["losses"] and got["resumed_weights"] == got["weights"]


def test_nodes_whose_latest_differ_are_refused_naming_each(ranks):
    _, results = ranks
    for got in results:
        assert got["latest_differs"].startswith("ValueError: checkpoint.use_node_local_storage: the nodes' copies")
        assert "rank 0 find 'global_step2'; rank 1 find 'global_step1'" in got["latest_differs"]
        assert "tag=" in got["latest_differs"]


def test_copies_of_one_tag_holding_different_steps_are_refused(ranks):
    _, results = ranks
    for got in results:
        assert got["copies_differ"].startswith("ValueError: checkpoint.use_node_local_storage: the nodes' copies")
        assert "rank 0 read step 2" in got["copies_differ"] and "rank 1 read step 1" in got["copies_differ"]
        assert "nothing was loaded" in got["copies_differ"]


def test_a_node_given_another_nodes_storage_is_told_which_ranks_it_holds(ranks):
    _, results = ranks
    for rank, got in enumerate(results):
        # Each rank raises its own error (every rank fails here).
        assert got["swapped"].startswith("FileNotFoundError: checkpoint.use_node_local_storage: this node's copy")
        assert f"has no files of rank {rank} (it holds the files of rank {1 - rank}" in got["swapped"]


def test_a_node_lacking_its_files_fails_the_load_on_every_node_saying_why(ranks):
    _, results = ranks
    assert results[1]["one_node_lacks_files"].startswith(
        "FileNotFoundError: checkpoint.use_node_local_storage: this node's copy")
    assert results[0]["one_node_lacks_files"].startswith("RuntimeError: load_checkpoint(")
    assert ("failed on another rank (rank 1: FileNotFoundError: checkpoint.use_node_local_storage: this node's "
            "copy") in results[0]["one_node_lacks_files"]
    assert "has no files of rank 1 (it holds no rank's files)" in results[0]["one_node_lacks_files"]


def test_nodes_sharing_one_directory_save_one_copy(ranks):
    _, results = ranks
    files = results[0]["shared_files"]
    assert files == results[1]["shared_files"]
    assert [f for f in files if not f.startswith("global_step3/rank")] == [
        "global_step3/buffers.pt", "global_step3/zero_meta.json", "latest"]
    assert {f.split("/")[1] for f in files if f.startswith("global_step3/rank")} == {"rank00000", "rank00001"}
    assert all(r["shared_loaded"] is None for r in results)


def test_a_load_on_another_world_size_is_refused_naming_the_other_nodes_shards(ranks, tmp_path):
    scratch, _ = ranks
    engine = _engine(tmp_path / "nvme", 1)
    try:
        error = load_error(engine, os.path.join(scratch, "node0", "ckpt"))
        assert error.startswith("FileNotFoundError: checkpoint.use_node_local_storage: loading")
        assert "on another world size or sub_group_size reads other ranks' shards" in error
        assert "rank00001" in error and "it holds the files of rank 0" in error
    finally:
        engine.destroy()


def test_a_load_on_another_world_size_works_where_every_nodes_shards_were_copied(ranks, tmp_path):
    scratch, results = ranks
    merged = tmp_path / "merged"
    shutil.copytree(os.path.join(scratch, "node0", "ckpt"), merged)
    shutil.copytree(os.path.join(scratch, "node1", "ckpt", "global_step2", "rank00001"),
                    merged / "global_step2" / "rank00001")
    engine = _engine(tmp_path / "nvme", 1)
    try:
        assert load_error(engine, merged) is None
        assert engine.global_steps == 2
    finally:
        engine.destroy()
