"""The sweep space of nvme_tune: which handle settings are tried, and its validation.

A configuration is one set of ``aio_handle`` arguments plus the backend. The
space is the cross product of a list of values per key; a ``--sweep_config``
JSON file replaces the lists it names, and a key it leaves out keeps the
handle's default (one value), as a ds_nvme_tune sweep file does.

[Note: overlap_events replaces sequential]
ds_nvme_tune sweeps ``sequential_requests`` {True, False}; its parameter
generator turns "sequential" into ``overlap_events: false`` and "overlap"
into ``overlap_events: true``. Our handle has no sequential mode, so we sweep
``overlap_events`` {False, True} directly: the same two points under the name
the ZeRO config reads. A sweep file written for ds_nvme_tune still loads:
``sequential_requests`` becomes ``overlap_events`` (negated), ``io_parallel``
(and the old ``thread_count`` / ``num_threads``) become
``intra_op_parallelism``, and block sizes may be strings such as ``"1M"``.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Mapping, Sequence

from ..hints import did_you_mean, hint
from ..settings import AioSettings

__all__ = ["KEYS", "DEFAULT_SWEEP", "Config", "SweepSpace", "SweepConfigError", "build_space",
           "load_sweep_config", "parse_size", "format_size", "GDS_BACKEND"]

# Order of the keys in a configuration, in the printed "aio" block and in logs.
KEYS = ("backend", "block_size", "queue_depth", "intra_op_parallelism", "single_submit",
        "overlap_events")
NUMERIC_KEYS = ("block_size", "queue_depth", "intra_op_parallelism")
BOOL_KEYS = ("single_submit", "overlap_events")

# ds_nvme_tune's default sweep (64 points per backend); "sequential" {T, F} is
# overlap_events {F, T} here (see [Note: overlap_events replaces sequential]).
DEFAULT_SWEEP: dict[str, list] = {
    "block_size": [1 << 20, 8 << 20],
    "queue_depth": [32, 128],
    "single_submit": [False, True],
    "overlap_events": [False, True],
    "intra_op_parallelism": [1, 2, 4, 8],
}

# A key missing from a --sweep_config keeps the handle's default.
HANDLE_DEFAULTS: dict[str, Any] = {k: v for k, v in AioSettings().as_dict().items()
                                   if k in KEYS and k != "backend"}

# ds_nvme_tune's names -> ours; "sequential_requests" is also negated.
ALIASES = {
    "io_parallel": "intra_op_parallelism",
    "thread_count": "intra_op_parallelism",
    "num_threads": "intra_op_parallelism",
    "sequential_requests": "overlap_events",
}
NEGATED = {"sequential_requests"}

# The "backend" of a configuration swept with --gds: the gds_handle, which
# has no backend argument.
GDS_BACKEND = "gds"


class SweepConfigError(ValueError):
    """A --sweep_config file or a --backend list that cannot be swept."""


_SIZE_RE = re.compile(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from ``400M``, ``1G``, ``128K``, ``4096`` (K = 1024, as ds_nvme_tune)."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size, got {text!r}")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise ValueError(f"size {text!r}: expected bytes or a number with K, M, G or T "
                             "(e.g. 400M, 1G)")
        n = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


def format_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


@dataclass(frozen=True)
class Config:
    """One point of the sweep: the arguments of one ``aio_handle``."""

    backend: str
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool

    @property
    def use_gds(self) -> bool:
        return self.backend == GDS_BACKEND

    def settings(self) -> AioSettings:
        """This point as handle settings (the --gds pseudo-backend is ``use_gds``)."""
        return AioSettings(block_size=self.block_size, queue_depth=self.queue_depth,
                           single_submit=self.single_submit, overlap_events=self.overlap_events,
                           intra_op_parallelism=self.intra_op_parallelism,
                           backend="auto" if self.use_gds else self.backend,
                           use_gds=self.use_gds)

    def handle_kwargs(self) -> dict:
        """Keyword arguments for ``aio_handle`` (``gds_handle`` without backend)."""
        return self.settings().handle_kwargs()

    def aio_block(self) -> dict:
        """The ZeRO config's ``"aio"`` section for this configuration
        (:meth:`nvmeio.AioSettings.aio_block`: real booleans, ``intra_op_parallelism``,
        ``use_gds: true`` and no backend for a --gds sweep)."""
        return self.settings().aio_block()

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        return (f"{self.backend} bs={format_size(self.block_size)} qd={self.queue_depth} "
                f"p={self.intra_op_parallelism} ss={'T' if self.single_submit else 'F'} "
                f"oe={'T' if self.overlap_events else 'F'}")

    def with_value(self, key: str, value: Any) -> "Config":
        return replace(self, **{key: value})


class SweepSpace:
    """The cross product of one tuple of values per key (in KEYS order)."""

    def __init__(self, values: Mapping[str, Sequence]):
        missing = [k for k in KEYS if k not in values]
        if missing:
            raise ValueError(f"sweep space lacks {missing}")
        self.values: dict[str, tuple] = {k: tuple(values[k]) for k in KEYS}
        for k, vs in self.values.items():
            if not vs:
                raise ValueError(f"sweep space: no value for {k}")

    def __len__(self) -> int:
        n = 1
        for vs in self.values.values():
            n *= len(vs)
        return n

    def __iter__(self) -> Iterator[Config]:
        for combo in itertools.product(*(self.values[k] for k in KEYS)):
            yield Config(*combo)

    def __contains__(self, config: Config) -> bool:
        return all(getattr(config, k) in self.values[k] for k in KEYS)

    def describe(self) -> str:
        parts = []
        for k in KEYS:
            vs = self.values[k]
            shown = [format_size(v) if k == "block_size" else
                     ("T" if v is True else "F" if v is False else str(v)) for v in vs]
            parts.append(f"{k} {{{','.join(shown)}}}")
        return " x ".join(parts)

    def as_dict(self) -> dict:
        return {k: list(vs) for k, vs in self.values.items()}


# -- validation ----------------------------------------------------------------------

def _check_numeric(key: str, values: list) -> list[int]:
    out = []
    for v in values:
        if key == "block_size":
            try:
                n = parse_size(v)
            except ValueError as e:
                raise SweepConfigError(f"sweep config: block_size {v!r}: {e}") from None
        else:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SweepConfigError(f"sweep config: {key} values must be positive integers, "
                                       f"got {v!r}")
            n = v
        out.append(n)
    return sorted(set(out))


def _check_bool(key: str, values: list, negate: bool) -> list[bool]:
    out: list[bool] = []
    for v in values:
        if not isinstance(v, bool):
            raise SweepConfigError(f"sweep config: {key} values must be JSON booleans "
                                   f"(true/false), got {v!r}")
        v = (not v) if negate else v
        if v not in out:
            out.append(v)
    return out


def _check_backends(values: list, available: Sequence[str], where: str) -> list[str]:
    out: list[str] = []
    for v in values:
        if not isinstance(v, str):
            raise SweepConfigError(f"{where}: backend values must be strings, got {v!r}")
        if v == "auto":
            raise SweepConfigError(f"{where}: name the backends to compare instead of 'auto'; "
                                   f"available here: {', '.join(available)}")
        if v not in available:
            match = did_you_mean(v, available)
            more = f" (did you mean {match!r}?)" if match else ""
            raise SweepConfigError(f"{where}: backend {v!r} is not available here{more}; "
                                   f"available backends: {', '.join(available)}")
        if v not in out:
            out.append(v)
    return out


def normalize_sweep(raw: Any, available: Sequence[str], where: str = "sweep config") -> dict:
    """Checks a sweep dict (our names or ds_nvme_tune's) and returns our keys -> lists."""
    if not isinstance(raw, Mapping):
        raise SweepConfigError(f"{where}: expected a JSON object of lists, got "
                               f"{type(raw).__name__}")
    known = list(KEYS) + list(ALIASES)
    out: dict[str, list] = {}
    source: dict[str, str] = {}
    for key, values in raw.items():
        if key not in known:
            raise SweepConfigError(f"{where}: unknown key {key!r}; {hint(key, known)}")
        ours = ALIASES.get(key, key)
        if ours in out:
            raise SweepConfigError(f"{where}: {key!r} and {source[ours]!r} both set {ours}")
        if not isinstance(values, list):
            raise SweepConfigError(f"{where}: {key} must be a list of values, got {values!r}")
        if not values:
            raise SweepConfigError(f"{where}: {key} is an empty list")
        if ours == "backend":
            out[ours] = _check_backends(values, available, where)
        elif ours in NUMERIC_KEYS:
            out[ours] = _check_numeric(ours, values)
        else:
            out[ours] = _check_bool(key, values, key in NEGATED)
        source[ours] = key
    return out


def load_sweep_config(path: str, available: Sequence[str]) -> dict:
    """Reads and checks a --sweep_config JSON file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise SweepConfigError(f"--sweep_config {path!r}: no such file") from None
    except json.JSONDecodeError as e:
        raise SweepConfigError(f"--sweep_config {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise SweepConfigError(f"--sweep_config {path!r}: {e.strerror}") from None
    return normalize_sweep(raw, available, where=f"--sweep_config {path}")


def build_space(sweep: Mapping[str, list] | None, backends: Sequence[str] | None,
                available: Sequence[str], gds: bool = False) -> SweepSpace:
    """The space to sweep.

    ``sweep``: checked lists from :func:`load_sweep_config` (None: the default
    sweep). ``backends`` (--backend) replaces the sweep's backend list;
    without either, every available backend is swept. ``gds``: one backend,
    the gds_handle.
    """
    values: dict[str, list] = {}
    if sweep is None:
        values.update({k: list(v) for k, v in DEFAULT_SWEEP.items()})
    else:
        for k in KEYS:
            if k == "backend":
                continue
            values[k] = list(sweep.get(k, [HANDLE_DEFAULTS[k]]))
    if gds:
        if backends:
            raise SweepConfigError("--backend does not apply to --gds (the gds_handle has no "
                                   "backend)")
        values["backend"] = [GDS_BACKEND]
    elif backends:
        values["backend"] = _check_backends(list(backends), available, "--backend")
    elif sweep is not None and "backend" in sweep:
        values["backend"] = list(sweep["backend"])
    else:
        values["backend"] = list(available)
    return SweepSpace(values)
