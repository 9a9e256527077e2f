"""The per-run log of nvme_tune (JSON lines) and the optional --plot picture.

One file per run, ``<log_dir>/nvme_tune-<UTC time>-<pid>.jsonl``: a ``start``
record (settings, space, directories), one ``measure`` record per
measurement (configuration, GB/s, seconds, phase, error), and an ``end``
record (the pick, its "aio" block, counts and time). ``read_records`` loads
one back.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any, Optional

from ._measure import Sample
from ._space import Config, format_size
from ._search import Results

__all__ = ["RunLog", "read_records", "plot_results", "PlotUnavailable"]


class RunLog:
    """Appends one JSON object per line; every line is flushed at once."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.path = os.path.join(log_dir, f"nvme_tune-{stamp}-{os.getpid()}.jsonl")
        self._f = open(self.path, "a")
        self.count = 0

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="milliseconds"),
                  **fields}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def measurement(self, config: Config, sample: Sample, phase: str, elapsed_s: float) -> None:
        self.count += 1
        self.write("measure", n=self.count, phase=phase, config=config.as_dict(),
                   read_gbps=_round(sample.read_gbps), write_gbps=_round(sample.write_gbps),
                   read_s=_round(sample.read_s, 6), write_s=_round(sample.write_s, 6),
                   error=sample.error, elapsed_s=round(elapsed_s, 3))

    def close(self) -> None:
        self._f.close()


def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None else round(x, digits)


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401 - imported only to learn whether it is installed
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'nvmeio[plot]' "
                              "(or pip install matplotlib)") from None


def plot_results(results: Results, path: str, title: str, read: bool = True,
                 write: bool = True) -> None:
    """GB/s against block size (x) and queue depth (y), one heat map per op.

    A cell shows the best mean GB/s over the other settings measured with that
    block size and queue depth; a cell never measured stays blank.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results.samples)
    sizes = sorted({c.block_size for c in configs})
    depths = sorted({c.queue_depth for c in configs})
    ops = [(what, label) for what, label, on in (("read_gbps", "read", read),
                                                  ("write_gbps", "write", write)) if on]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops) + 1, 3.6), squeeze=False)
    for ax, (what, label) in zip(axes[0], ops):
        grid = [[math.nan] * len(sizes) for _ in depths]
        for c in configs:
            v = results.mean(c, what)
            if v is None:
                continue
            i, j = depths.index(c.queue_depth), sizes.index(c.block_size)
            if math.isnan(grid[i][j]) or v > grid[i][j]:
                grid[i][j] = v
        image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(sizes)):
                if not math.isnan(grid[i][j]):
                    # dark text on the light (high) end of viridis, light on the dark end
                    shade = image.norm(grid[i][j])
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=9,
                            color="black" if shade > 0.6 else "white")
        ax.set_xticks(range(len(sizes)), [format_size(s) for s in sizes])
        ax.set_yticks(range(len(depths)), [str(d) for d in depths])
        ax.set_xlabel("block_size")
        ax.set_ylabel("queue_depth")
        ax.set_title(f"{label} GB/s (best over other settings)")
        fig.colorbar(image, ax=ax, label="GB/s")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
