"""nvmeio: fast NVMe / async file I/O for deep learning.

    import nvmeio
    h = nvmeio.aio_handle(queue_depth=32)
    h.async_pwrite(tensor, "/local_nvme/t.bin"); h.wait()
"""

from __future__ import annotations

import os as _os
import resource as _resource

try:
    from . import _native  # noqa: F401 - imported first: an unbuilt source tree fails here, explained below
except ImportError as _e:
    if _os.path.exists(_os.path.join(_os.path.dirname(__file__), _os.pardir, "CMakeLists.txt")):
        raise ImportError(
            f"nvmeio is being imported from its source tree ({_os.path.dirname(__file__)}), which "
            "has no built native module: run from a directory other than the repository root "
            "(python puts the current directory first on sys.path for -m and -c), use the "
            "console scripts (zero_demo, nvme_tune, ...), or install in place with "
            "`pip install -e . --no-build-isolation`") from _e
    raise

from . import faults
from .handle import aio_handle
from .backend_choice import available_backends
from .errors import AioError, ShortReadError, ValidationError
from .fast_io import FastIO
from .fast_reader import FastFileReader
from .fast_writer import FastFileWriter
from .safetensors_file import SafetensorsError, SafetensorsReader, SafetensorsWriter
from .gds import gds_handle, gds_unavailable_reason
from .handle_choice import new_handle
from .settings import AioSettings

__version__ = "0.1.0"
__all__ = ["aio_handle", "gds_handle", "gds_unavailable_reason", "available_backends", "AioError",
           "AioSettings", "new_handle", "ShortReadError", "ValidationError", "FastIO",
           "FastFileWriter", "FastFileReader", "SafetensorsWriter", "SafetensorsReader",
           "SafetensorsError", "__version__"]


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
faults.arm_from_env()
