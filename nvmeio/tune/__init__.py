"""nvme_tune: sweep aio_handle settings on NVMe and print the ZeRO "aio" block.

The public API is this ``__all__``; the modules are internal: ``_space`` (what is swept,
--sweep_config validation), ``_dirs`` (directory checks), ``_measure`` (one configuration's
GB/s, striping), ``_search`` (full grid and smart search), ``_log`` (JSON-lines log, plot),
``_cli`` (argparse and ``main``).
"""

from ._cli import main
from ._search import grid_search, smart_search
from ._space import Config, SweepSpace, build_space

__all__ = ["main", "grid_search", "smart_search", "Config", "SweepSpace", "build_space"]
