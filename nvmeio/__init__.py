"""nvmeio: fast NVMe / async file I/O for deep learning.

    import nvmeio
    h = nvmeio.aio_handle(queue_depth=32)
    h.async_pwrite(tensor, "/local_nvme/t.bin"); h.wait()

The public API is this package's ``__all__`` and the public modules, each with an ``__all__``
of its own: ``env`` (the environment variables), ``settings``, ``hints``, ``host_sum``,
``file_ops``, ``striping`` (files striped over several drives), ``atomic_file``, ``safetensors_file``, ``faults``, ``resources``, ``report``,
``demo``, ``io`` (DeepSpeed's FastPersist writer API, ``deepspeed.io``) and the ``tune`` package. A module whose name starts with an underscore is internal.
Importing nvmeio has no side effect on the process (_process.py).
"""

from __future__ import annotations

import os as _os

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

from . import faults  # noqa: F401 - nvmeio.faults.inject(...), as the README shows
from ._backend_choice import available_backends
from ._cuda import CudaBackend, RegisteredHost
from .errors import AioError, ShortReadError, ValidationError
from ._fast_buffers import FastIOStats
from ._fast_io import FastIO
from ._fast_reader import FastFileReader
from ._fast_writer import FastFileWriter
from ._gds import gds_device_path, gds_handle, gds_unavailable_reason
from ._handle import aio_handle
from ._handle_choice import new_handle, require_gds
from ._locked import huge_page_tensor
from ._plain_writer import PlainFileWriter
from .safetensors_file import SafetensorsError, SafetensorsReader, SafetensorsWriter
from .settings import AioSettings
from .striping import StripedFile

__version__ = "0.1.0"
__all__ = ["aio_handle", "gds_handle", "gds_unavailable_reason", "gds_device_path", "available_backends", "AioError",
           "AioSettings", "new_handle", "require_gds", "ShortReadError", "ValidationError", "FastIO",
           "FastIOStats", "FastFileWriter", "FastFileReader", "PlainFileWriter", "SafetensorsWriter",
           "SafetensorsReader", "SafetensorsError", "StripedFile", "huge_page_tensor", "CudaBackend",
           "RegisteredHost", "__version__"]
