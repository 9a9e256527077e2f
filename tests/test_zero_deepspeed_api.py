"""DeepSpeed's script-level calls: ``@zero.Init(...)`` as a decorator, ``zero.add_config_arguments`` with
``initialize(args=...)``, ``zero.init_distributed`` (a group of one without a launcher; two ranks started
the way Open MPI, MPICH and Slurm start them train as one job), ``initialize(dist_init_required=...)``, and
``mpu=`` refused with the reason.
How each launcher's variables are read is pinned in test_zero_launcher_env.py."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import zero
from zero.config import ConfigDeprecationWarning
from zero.examples import GPT, GPTConfig, make_batches
from zero.partitioning.active_context import current_context
from helpers import base_config, finish_process, free_port, run_process, train_engine

CFG = GPTConfig()


# -- zero.Init as a decorator --------------------------------------------------------------------------------

def test_init_decorates_a_function_that_builds_the_model(tmp_path):
    config = base_config("nvme", "nvme", tmp_path)

    @zero.Init(config_dict_or_path=config)
    def build(seed):
        torch.manual_seed(seed)
        return GPT(CFG)

    models = [build(0), build(0)]  # each call runs inside the context, which closes after it
    assert current_context() is None and torch.nn.Linear(2, 3).weight.shape == (3, 2)
    torch.manual_seed(0)
    plain = GPT(CFG)
    for model in models:
        assert all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
        with zero.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_a_decorated_function_may_call_itself():
    @zero.Init()
    def build(depth):
        inner = build(depth - 1) if depth else None
        assert current_context() is not None
        return torch.nn.Linear(4, 4), inner

    outer, (inner, _) = build(1)
    assert current_context() is None
    assert outer.weight.numel() == inner.weight.numel() == 0


# -- mpu: model parallelism is refused -------------------------------------------------------------------------

def test_model_parallelism_is_refused_by_initialize_and_init(tmp_path):
    with pytest.raises(ValueError, match=r"zero.initialize\(mpu=...\): model parallelism is not supported by this "
                                         r"engine: its data-parallel group is every rank of the process group, so "
                                         r"with model-parallel ranks the gradients would be averaged across them "
                                         r"too; run without model parallelism \(mpu=None\)"):
        zero.initialize(model=GPT(CFG), config=base_config(), mpu=object())
    with pytest.raises(ValueError, match=r"zero.Init\(mpu=...\): model parallelism is not supported by this engine: "
                                         r"its data-parallel group is every rank of the process group, so with "
                                         r"model-parallel ranks each would keep a slice of the others' parameters"):
        zero.Init(mpu=object())


# -- add_config_arguments and initialize(args=...) ------------------------------------------------------------

def _config_file(tmp_path) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(base_config(lr=1e-2)))
    return str(path)


def test_add_config_arguments_adds_deepspeeds_four_and_initialize_reads_the_file(tmp_path):
    parser = zero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", _config_file(tmp_path)])
    assert (args.deepspeed, args.deepscale, args.deepscale_config) == (True, False, None)
    assert [g.title for g in parser._action_groups if g.title == "DeepSpeed"] == ["DeepSpeed"]
    torch.manual_seed(0)
    engine, *_ = zero.initialize(args=args, model=GPT(CFG))
    try:
        assert engine.config.optimizer.params.lr == 1e-2
        train_engine(engine, make_batches(CFG, 1, 4), 1)
    finally:
        engine.destroy()


def test_a_config_in_args_and_as_config_is_refused(tmp_path):
    args = argparse.Namespace(deepspeed_config=_config_file(tmp_path))
    with pytest.raises(ValueError, match=r"zero.initialize got a config both in args.deepspeed_config \(.*\) and as "
                                         r"config=; pass one \(DeepSpeed refuses both too\)"):
        zero.initialize(args=args, model=GPT(CFG), config=base_config())


def test_the_deprecated_deepscale_config_is_read_with_a_warning(tmp_path):
    parser = zero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", _config_file(tmp_path)])
    with pytest.warns(ConfigDeprecationWarning, match="--deepscale_config is deprecated; use --deepspeed_config"):
        engine, *_ = zero.initialize(args=args, model=GPT(CFG))
    engine.destroy()
    args.deepspeed_config = args.deepscale_config
    with pytest.raises(ValueError, match="args has both deepscale_config and deepspeed_config; keep "
                                         r"--deepspeed_config \(--deepscale_config is its deprecated name\)"):
        zero.initialize(args=args, model=GPT(CFG))


# -- zero.init_distributed -------------------------------------------------------------------------------------

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _clean_env(**extra) -> dict:
    """This environment without any launcher's variables (the tests may themselves run under one)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARIABLES and not k.startswith(("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


ONE_PROCESS = r'''
import json, warnings
import torch.distributed as dist
import zero
from zero.config import IgnoredSettingWarning
zero.init_distributed(dist_init_required=False)
untouched = not dist.is_initialized()
try:
    zero.init_distributed(rank=0)
except ValueError as e:
    half = str(e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    zero.init_distributed(config={"comms_logger": {"enabled": True}})
zero.init_distributed()  # a group exists: nothing happens
print(json.dumps({"untouched": untouched, "half": half, "rank": dist.get_rank(), "world": dist.get_world_size(),
                  "backend": dist.get_backend(), "warned": [str(w.message) for w in caught
                                                            if w.category is IgnoredSettingWarning]}))
'''


def test_init_distributed_without_a_launcher_makes_a_group_of_one():
    out = run_process([sys.executable, "-c", ONE_PROCESS], timeout=120, check=True, env=_clean_env())
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "init_distributed: rank 0 of 1 (no launcher: one rank), backend gloo" in out.stderr
    assert got["untouched"]  # dist_init_required=False
    assert got["half"] == ("zero.init_distributed(rank=0, world_size=-1): pass both, or neither to take them "
                           "from the launcher")
    assert (got["rank"], got["world"], got["backend"]) == (0, 1, "gloo")
    assert got["warned"] == ["zero.init_distributed(config=...) is accepted for DeepSpeed compatibility but has "
                             "no effect in nvmeio (DeepSpeed reads its communication logger settings there)"]


TWO_RANKS = r'''
import hashlib, json, sys
import torch, torch.distributed as dist
import zero
from zero.examples import GPT, GPTConfig, make_batches
from zero.partitioning.full_state_dict import full_state_dict
if sys.argv[1] == "explicit":
    zero.init_distributed()
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
engine, *_ = zero.initialize(model=GPT(GPTConfig()), config=config)
x, y = make_batches(GPTConfig(), 1, 4, seed=dist.get_rank() + 1)[0]  # each rank its own data
loss = engine(x, y); engine.backward(loss); engine.step()
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in full_state_dict(engine.module).values())).hexdigest()
print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": engine.local_rank,
                  "weights": digest}))
engine.destroy()
'''

LAUNCHERS = {  # how each launcher tells a process its rank (rank r of 2, both on this machine)
    "Open MPI": lambda r: dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                               OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2"),
    "MPICH (PMI)": lambda r: dict(PMI_RANK=str(r), PMI_SIZE="2", MPI_LOCALRANKID=str(r), MPI_LOCALNRANKS="2"),
    "Slurm": lambda r: dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NNODES="1",
                            SLURM_NODELIST="localhost", SLURM_JOB_NAME="train"),
}


@pytest.mark.parametrize("launcher, how", [("Open MPI", "explicit"), ("MPICH (PMI)", "explicit"),
                                           ("Slurm", "by initialize")])
def test_two_ranks_from_mpi_or_slurm_variables_train_as_one_job(launcher, how):
    """No RANK / WORLD_SIZE / MASTER_ADDR: the ranks find each other at 127.0.0.1 (all on this machine)
    through MASTER_PORT, by zero.init_distributed or by zero.initialize itself."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, how], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=_clean_env(MASTER_PORT=port, **LAUNCHERS[launcher](r))) for r in range(2)]
    outputs = [finish_process(p, timeout=300) for p in procs]
    got = []
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out + err
        got.append(json.loads(out.strip().splitlines()[-1]))
    assert [(g["rank"], g["world"], g["local_rank"]) for g in got] == [(0, 2, 0), (1, 2, 1)]
    assert (f"joining the 2 ranks {launcher} started at tcp://127.0.0.1:{port} (each of them must start: under "
            f"Slurm, launch with srun)") in outputs[0][1]
    assert got[0]["weights"] == got[1]["weights"]  # one step on both ranks' gradients, not each its own



DIST_INIT_REQUIRED = r'''
import json, sys
import torch.distributed as dist
import zero
from zero.examples import GPT, GPTConfig
required = {"True": True, "False": False}[sys.argv[1]]
engine, *_ = zero.initialize(model=GPT(GPTConfig()), config={"train_micro_batch_size_per_gpu": 4},
                             dist_init_required=required)
print(json.dumps({"group": dist.is_initialized(), "world": engine.world_size}))
'''


@pytest.mark.parametrize("required, launcher, group", [(True, {}, True), (False, LAUNCHERS["Open MPI"](0), False)])
def test_dist_init_required_makes_or_never_makes_the_process_group(required, launcher, group):
    """True: a group even for one process; False: none, though the variables say two ranks (joining would
    wait for the second forever)."""
    out = run_process([sys.executable, "-c", DIST_INIT_REQUIRED, str(required)], timeout=120, check=True,
                      env=_clean_env(**launcher))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"group": group, "world": 1}


def test_init_distributed_with_rank_and_world_size_given():
    code = ("import sys, torch.distributed as dist, zero; zero.init_distributed(rank=0, world_size=1, "
            "init_method=sys.argv[1]); print(dist.get_world_size())")
    out = run_process([sys.executable, "-c", code, f"tcp://127.0.0.1:{free_port()}"], timeout=120, check=True,
                      env=_clean_env())
    assert out.stdout.split() == ["1"] and "init_distributed: rank 0 of 1 (as given), backend gloo" in out.stderr
