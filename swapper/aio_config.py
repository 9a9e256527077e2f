"""The ``aio`` settings a swapper builds its ``nvmeio.aio_handle`` objects from."""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Union


@dataclass(frozen=True)
class AioConfig:
    """Arguments of ``nvmeio.aio_handle``; defaults are the handle's (and DeepSpeed's)."""

    block_size: int = 1048576
    queue_depth: int = 128
    single_submit: bool = False
    overlap_events: bool = False
    intra_op_parallelism: int = 1
    backend: str = "auto"  # as nvme_tune prints it; "auto" = the fastest, measured

    @classmethod
    def coerce(cls, value: Union["AioConfig", Mapping[str, Any], None]) -> "AioConfig":
        """An :class:`AioConfig` from itself, ``None`` (defaults) or a DeepSpeed ``aio`` dict.

        ``use_gds`` is accepted when false (the swapper stages through host
        buffers); any other unknown key is an error that names the closest
        known one, instead of being ignored.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"aio_config must be an AioConfig, a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, v in value.items():
            if key == "use_gds":
                if v:
                    raise ValueError("aio_config use_gds=True is not supported by the swapper: it stages through host buffers")
                continue
            if key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                raise ValueError(
                    f"unknown aio_config key {key!r}"
                    + (f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(known))}")
                )
            kwargs[key] = v
        return cls(**kwargs)

    def make_handle(self):
        import nvmeio

        return nvmeio.aio_handle(**asdict(self))


def make_handle(aio_config: Optional[Union[AioConfig, Mapping[str, Any]]] = None):
    """A fresh ``nvmeio.aio_handle`` built from ``aio_config``."""
    return AioConfig.coerce(aio_config).make_handle()
