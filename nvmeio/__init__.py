"""nvmeio: fast NVMe / async file I/O for deep learning.

    import nvmeio
    h = nvmeio.aio_handle(queue_depth=32)
    h.async_pwrite(tensor, "/local_nvme/t.bin"); h.wait()
"""

from __future__ import annotations

import resource as _resource

from .aio_handle import ValidationError, aio_handle, available_backends
from .errors import AioError, ShortReadError
from .gds_handle import gds_handle, gds_unavailable_reason

__version__ = "0.1.0"
__all__ = ["aio_handle", "gds_handle", "gds_unavailable_reason", "available_backends", "AioError",
           "ShortReadError", "ValidationError", "__version__"]


def _raise_open_file_limit() -> None:
    # Each op in flight holds its file open; thousands of small async ops
    # (one file per tensor) exceed the usual soft limit of 1024.
    soft, hard = _resource.getrlimit(_resource.RLIMIT_NOFILE)
    want = hard if hard != _resource.RLIM_INFINITY else 1 << 20
    if soft != _resource.RLIM_INFINITY and soft < want:
        try:
            _resource.setrlimit(_resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


_raise_open_file_limit()
