"""Which handle an :class:`AioSettings` selects: aio_handle, or gds_handle with use_gds."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from ._handle import aio_handle
from ._gds import gds_handle, gds_unavailable_reason
from .settings import AioSettings

__all__ = ["new_handle", "require_gds"]


def require_gds() -> None:
    """RuntimeError naming what is missing when ``use_gds=True`` cannot be honoured here."""
    reason = gds_unavailable_reason()
    if reason is not None:
        raise RuntimeError("aio use_gds=true selects nvmeio.gds_handle (GPUDirect Storage), which "
                           f"cannot run here: {reason}. Set use_gds to false to stage through "
                           "host memory instead.")


def new_handle(settings: Union[AioSettings, Mapping[str, Any], None] = None,
               defaults: Optional[AioSettings] = None) -> aio_handle:
    """A fresh handle built from ``settings`` (see :meth:`AioSettings.coerce`)."""
    settings = AioSettings.coerce(settings, defaults)
    if settings.use_gds:
        require_gds()
        return gds_handle(**settings.handle_kwargs())
    return aio_handle(**settings.handle_kwargs())
