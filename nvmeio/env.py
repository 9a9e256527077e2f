"""Every environment variable that nvmeio, swapper and zero read: declared once, read through :func:`get`.

As kvikio's ``defaults``: each :class:`Variable` says its name, its type, its
default and what it does, in :data:`VARIABLES`, the one list of them (zero's
and the launcher's too, so that the list is whole); a reader asks
``env.get("NVMEIO_DIRECT_IO")`` and never repeats a name's default or its
parsing. docs/tuning.md's table is :func:`markdown_table` (tests/test_env_vars.py
compares them). Every value has one spelling convention:

- a flag accepts ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case,
  surrounding spaces ignored); anything else is an error that names the
  variable, never a silent default;
- an integer is a decimal number with a minimum;
- a variable set to the empty string counts as unset.

A default of None means "unset": the meaning says what the reader does then
(a value it derives, such as the temp directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .hints import hint

__all__ = ["Variable", "VARIABLES", "get", "default", "is_set", "markdown_table", "env_flag", "env_int", "env_str"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``kind`` is ``bool`` (a flag), ``int`` (at least ``minimum``)
    or ``str``; ``default`` is its value when unset (None: see ``meaning``)."""

    name: str
    kind: type
    default: Any
    meaning: str
    minimum: int = 0

    def read(self) -> Any:
        if self.kind is bool:
            return env_flag(self.name, self.default)
        if self.kind is int:
            return env_int(self.name, self.default, self.minimum)
        value = env_str(self.name)
        return self.default if value is None else value


VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    Variable("NVMEIO_BACKEND", str, None,
             'what `backend="auto"` means (`io_uring`, `aio`, `psync`); unset: the fastest, measured once per '
             'process'),
    Variable("NVMEIO_PROBE_DIR", str, None,
             'where "auto" measures the backends; unset: the temp directory (put it on the NVMe)'),
    Variable("NVMEIO_DIRECT_IO", bool, True, "off: buffered I/O + fdatasync everywhere"),
    Variable("NVMEIO_MLOCK", bool, True, "off: `new_cpu_locked_tensor` does not mlock"),
    Variable("NVMEIO_STAGING_CHUNK_BYTES", int, None,
             "bytes of each host chunk a CUDA tensor on `aio_handle` is staged through (rounded up to 4096); "
             "unset: 32 MiB, or a `block_size` per worker thread where that is more", minimum=1),
    Variable("NVMEIO_STAGING_CHUNKS", int, 3, "host chunks of that staging in flight", minimum=2),
    Variable("NVMEIO_STAGING_LANES", int, 2,
             "native handles that take that staging's chunk file ops in turn, so the disk's queue does not drain "
             "between chunks (at most `NVMEIO_STAGING_CHUNKS`)", minimum=1),
    Variable("KVIKIO_AUTO_DIRECT_IO_READ", str, None,
             "kvikio's own: O_DIRECT for its POSIX reads (compatibility mode). Unset, a `gds_handle` turns it on "
             "process-wide (kvikio's default is off; nvmeio's own reads use O_DIRECT), unless `NVMEIO_DIRECT_IO` "
             "is off; set, kvikio's reading of it stands"),
    Variable("NVMEIO_GDS_STAGING", bool, None,
             "on: a `gds_handle` moves CUDA tensors through `aio_handle`'s staging pipeline; off: through cuFile; "
             "unset: staging where cuFile has no GPUDirect path (kvikio's compatibility mode, or cuFile without "
             "the GDS driver), else cuFile"),
    Variable("NVMEIO_CUFILE_HANDLES", int, 64,
             "files a `gds_handle` keeps open with their cuFile registration (least recently used closed first); "
             "a swapper reading more units' files than this in turn reopens one per op: raise it for large models "
             "(each holds two descriptors)", minimum=1),
    Variable("NVMEIO_FAULTS", str, None,
             "a fault injection plan for tests (`nvmeio/faults.py`), armed at the first native handle"),
    Variable("NVMEIO_JOB_ID", str, "zero_stage_3",
             "the swap directory's job id when the config has no `zero_optimization.nvme_job_id` (zero)"),
    Variable("NVMEIO_MALLOC_TUNING", bool, True,
             "glibc malloc settings for CPU training (zero, `zero/stores/malloc_settings.py`)"),
    Variable("DEEPSPEED_TIMEOUT", int, None,
             "minutes the process group `zero.initialize` makes waits for a rank (rendezvous, collectives); "
             "unset: torch's default, 30 for gloo. A rank that dies in a collective fails the others at once; "
             "one that dies in start-up or hangs holds them this long", minimum=1),
    Variable("DS_ACCELERATOR", str, None,
             "DeepSpeed's accelerator choice, read as zero's compute device (`cpu`, `cuda`) where neither a "
             "`compute_device=` argument nor the config's `compute_device` names one; unset: CUDA when available, "
             "else the CPU"),
    Variable("WORLD_SIZE", int, None,
             "set by the launcher (torchrun); with `RANK` and `MASTER_ADDR` set, zero joins the process group "
             "(unset: the MPI / Slurm variables below, else one process, no group)", minimum=1),
    Variable("RANK", int, None, "set by the launcher: this process's rank"),
    Variable("MASTER_ADDR", str, None,
             "set by the launcher: where rank 0 listens; under MPI / Slurm unset: 127.0.0.1 when every rank is on "
             "this machine, the first host of `SLURM_NODELIST` under Slurm, else an error asking for it"),
    Variable("MASTER_PORT", int, None, "set by the launcher: the port rank 0 listens on; unset: 29500 (DeepSpeed's)",
             minimum=1),
    Variable("LOCAL_RANK", int, None,
             "set by the launcher: this process's rank on its machine, which picks its CUDA device; unset: its "
             "rank"),
    Variable("OMPI_COMM_WORLD_RANK", int, None, "set by Open MPI's mpirun: this process's rank (without torchrun's)"),
    Variable("OMPI_COMM_WORLD_SIZE", int, None, "set by Open MPI's mpirun: the number of ranks", minimum=1),
    Variable("OMPI_COMM_WORLD_LOCAL_RANK", int, None, "set by Open MPI's mpirun: the rank on this machine"),
    Variable("OMPI_COMM_WORLD_LOCAL_SIZE", int, None,
             "set by Open MPI's mpirun: ranks on this machine (all of them: rank 0 is at 127.0.0.1)", minimum=1),
    Variable("PMI_RANK", int, None, "set by MPICH / Intel MPI (PMI): this process's rank"),
    Variable("PMI_SIZE", int, None, "set by MPICH / Intel MPI (PMI): the number of ranks", minimum=1),
    Variable("MPI_LOCALRANKID", int, None, "set by MPICH / Intel MPI: the rank on this machine"),
    Variable("MPI_LOCALNRANKS", int, None, "set by MPICH / Intel MPI: ranks on this machine", minimum=1),
    Variable("SLURM_PROCID", int, None, "set by Slurm's srun: this task's rank"),
    Variable("SLURM_NTASKS", int, None, "set by Slurm: the number of tasks (ranks)", minimum=1),
    Variable("SLURM_LOCALID", int, None, "set by Slurm's srun: the task's rank on its node"),
    Variable("SLURM_NNODES", int, None, "set by Slurm: nodes of the job (1: rank 0 is at 127.0.0.1)", minimum=1),
    Variable("SLURM_NODELIST", str, None, "set by Slurm: the job's nodes; the first one hosts rank 0"),
    Variable("SLURM_JOB_NAME", str, None,
             "set by Slurm: `bash` or `interactive` means a shell, not a launch (Lightning's rule)"),
    Variable("XDG_CACHE_HOME", str, None, "where `zero_demo` keeps its swap files; unset: `~/.cache`"),
)}


def _declared(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared environment variable ({hint(name, list(VARIABLES), 'declared')}); "
                       "declare it in nvmeio/env.py") from None


def get(name: str) -> Any:
    """The value of the declared variable ``name``: parsed as its kind, its default when unset."""
    return _declared(name).read()


def default(name: str) -> Any:
    """The declared default of ``name`` (what :func:`get` returns while it is unset)."""
    return _declared(name).default


def is_set(name: str) -> bool:
    """Whether the declared variable ``name`` is set (to something other than the empty string)."""
    return env_str(_declared(name).name) is not None


def markdown_table() -> str:
    """The variables as docs/tuning.md lists them."""
    def default(v: Variable) -> str:
        if v.default is None:
            return "unset"
        if v.kind is bool:
            return "on" if v.default else "off"
        return f"`{v.default}`"

    kinds = {bool: "flag", int: "integer", str: "string"}
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        kind = kinds[v.kind] + (f" >= {v.minimum}" if v.kind is int and v.minimum else "")
        rows.append(f"| `{v.name}` | {kind} | {default(v)} | {v.meaning} |")
    return "\n".join(rows) + "\n"


# -- the spelling rules, for any name (the declared variables are read through them) ----------------

def env_str(name: str) -> Optional[str]:
    """The variable's value, or None when it is unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable; ValueError for a value that is not one of the spellings above."""
    raw = env_str(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of "
                     f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def env_int(name: str, default: Optional[int], minimum: int) -> Optional[int]:
    """An integer variable of at least ``minimum``; ValueError otherwise."""
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value
