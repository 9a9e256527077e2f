"""nvme_tune: sweep aio_handle settings on NVMe and print the ZeRO "aio" block.

Modules: ``space`` (what is swept, --sweep_config validation), ``dirs``
(directory checks), ``measure`` (one configuration's GB/s, striping),
``search`` (full grid and smart search), ``log`` (JSON-lines log, plot),
``cli`` (argparse and ``main``).
"""

from .cli import main
from .search import grid_search, smart_search
from .space import Config, SweepSpace, build_space

__all__ = ["main", "grid_search", "smart_search", "Config", "SweepSpace", "build_space"]
