"""Which rank a process is, read from its launcher's variables (zero/runtime/launcher.py): torchrun's first,
then Open MPI's, MPICH's (PMI), Slurm's; rank 0's address and port where the launcher gives none, as
DeepSpeed's MPI discovery arrives at them; contradictions and unknowable addresses refused by name."""
import os

import pytest

from zero.runtime.launcher import DEFAULT_PORT, Launch, discover, first_slurm_host


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """Start from no launcher at all (the tests may themselves run under one)."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or \
                name.startswith(("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_")):
            monkeypatch.delenv(name)


def setenv(monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))


def test_no_launcher_is_one_rank():
    assert discover() == Launch() and Launch().world_size == 1 and Launch().launcher is None


def test_open_mpi_on_one_machine_meets_at_localhost_on_deepspeeds_port(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=3,
           OMPI_COMM_WORLD_LOCAL_SIZE=4)
    launch = discover()
    assert launch == Launch(rank=3, world_size=4, local_rank=3, local_size=4, port=29500, launcher="Open MPI")
    assert DEFAULT_PORT == 29500 and launch.init_method == "tcp://127.0.0.1:29500"
    setenv(monkeypatch, MASTER_PORT=12345)
    assert discover(distributed_port=999).init_method == "tcp://127.0.0.1:12345"
    monkeypatch.delenv("MASTER_PORT")
    assert discover(distributed_port=999).port == 999  # DeepSpeed's distributed_port


def test_across_machines_the_address_is_master_addr_or_an_error_naming_it(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_LOCAL_RANK=1,
           OMPI_COMM_WORLD_LOCAL_SIZE=4)
    with pytest.raises(RuntimeError, match=r"Open MPI started 8 ranks on several machines \(or did not say how many "
                                           r"are on this one\) and MASTER_ADDR is not set: set it to the host name "
                                           r"of rank 0's machine for every rank \(with mpirun: -x "
                                           r"MASTER_ADDR=<host>\)"):
        discover().master_addr()
    setenv(monkeypatch, MASTER_ADDR="node0")
    assert discover().init_method == "tcp://node0:29500" and discover().local_rank == 1


def test_mpich_pmi_variables(monkeypatch):
    setenv(monkeypatch, PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=1, MPI_LOCALNRANKS=2)
    assert discover() == Launch(1, 2, 1, 2, 29500, "MPICH (PMI)")
    assert discover().master_addr() == "127.0.0.1"


@pytest.mark.parametrize("nodelist, first", [("node[5-9,12],gpu1", "node5"), ("host0,host1", "host0"),
                                             ("host[3]", "host3"), ("a b", "a")])
def test_slurm_rank_0_is_on_the_first_node_of_the_list(monkeypatch, nodelist, first):
    setenv(monkeypatch, SLURM_PROCID=6, SLURM_NTASKS=8, SLURM_LOCALID=2, SLURM_NNODES=2, SLURM_NODELIST=nodelist,
           SLURM_JOB_NAME="train")
    launch = discover()
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (6, 8, 2, "Slurm")
    assert first_slurm_host(nodelist) == first and launch.master_addr() == first
    setenv(monkeypatch, SLURM_NNODES=1)
    assert discover().master_addr() == "127.0.0.1"


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_an_interactive_slurm_shell_is_not_a_launch(monkeypatch, name):
    setenv(monkeypatch, SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_LOCALID=0, SLURM_JOB_NAME=name)
    assert discover() == Launch()


def test_torchruns_variables_come_first_and_mpi_can_be_left_out(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2, SLURM_PROCID=0, SLURM_NTASKS=1)
    assert discover(mpi=False) == Launch()  # DeepSpeed's auto_mpi_discovery=False
    assert discover().launcher == "Open MPI"
    setenv(monkeypatch, RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=4000)
    assert discover() == Launch(0, 2, 0, None, 4000, "torchrun")


def test_contradicting_variables_are_refused_by_name(monkeypatch):
    setenv(monkeypatch, PMI_RANK=2, PMI_SIZE=2)
    with pytest.raises(ValueError, match=r"PMI_RANK=2 is not below PMI_SIZE=2: the MPICH \(PMI\) launch variables "
                                         r"contradict each other"):
        discover()
    setenv(monkeypatch, PMI_RANK="x")
    with pytest.raises(ValueError, match="PMI_RANK='x' is not an integer"):
        discover()
