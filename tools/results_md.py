"""bench/RESULTS.md holds one ``## `` section per benchmark; each script replaces only its own.

    from tools.results_md import Figure, bar_chart, replace_section, section_body
    png = bar_chart(Path("bench/io_throughput.png"), "1 GiB, GiB/s", ["write", "read"],
                    {"fio best": [7.4, 3.4], "aio_handle best": [7.3, 3.5]})
    body = section_body([Figure("write, aio_handle / fio", "**1.07x**")],
                        "python -m bench.io_throughput --results-md bench/RESULTS.md", details)
    replace_section(Path("bench/RESULTS.md"), "## I/O throughput", body + f"\n\n![chart]({png.name})")

A section opens with its headline (today's figures against their goals) and the
command that reproduces them; the details of the run follow. How the figures got
there is history: it goes to the ``## Changelog`` section, which stays last.
The chart is optional: without matplotlib ``bar_chart`` returns None and the
section keeps its table only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = ["Figure", "section_body", "replace_section", "bar_chart", "chart_link", "CHANGELOG"]

CHANGELOG = "## Changelog"


@dataclass(frozen=True)
class Figure:
    """One row of a section's headline: what is measured, today's value, the goal (``—``:
    none set), whether today's value meets it (None: no goal) and when it was measured."""

    what: str
    today: str
    goal: str = "—"
    met: Optional[bool] = None
    when: str = ""


def section_body(figures: Sequence[Figure], command: str, details: str = "") -> str:
    """A section's body: the headline table, the command that reproduces it, the details."""
    rows = ["| figure | today | goal | met | measured |", "|---|---:|---|---|---|"]
    for f in figures:
        met = "—" if f.met is None else ("yes" if f.met else "**no**")
        rows.append(f"| {f.what} | {f.today} | {f.goal} | {met} | {f.when} |")
    return "\n".join(rows) + f"\n\nReproduce: `{command}`\n\n" + details.strip()


def replace_section(path: Path, heading: str, body: str) -> None:
    """Writes ``heading`` + ``body`` in place of the section under ``heading`` (up to the
    next ``## `` heading), or adds it before the changelog (at the end without one); the
    other sections are left as they are."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# nvmeio benchmark results\n"
    section = f"{heading}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        log = next((i for i, line in enumerate(lines) if line.rstrip() == CHANGELOG), None)
        if log is None:
            path.write_text(text.rstrip("\n") + "\n\n" + section)
        else:
            head = "".join(lines[:log]).rstrip("\n")
            path.write_text(head + "\n\n" + section + "\n" + "".join(lines[log:]))
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + section + ("\n" + tail if tail else ""))


def bar_chart(path: Path, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float]],
              ylabel: str = "GiB/s", note: Optional[str] = None, log_scale: bool = False,
              value_format: str = "{:.2f}") -> Optional[Path]:
    """Grouped bars: one group per entry of ``groups`` (e.g. write, read), one bar per
    series in each; values are labelled (``value_format``; counts spanning decades want
    ``log_scale``). Returns ``path``, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    names = list(series)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(groups) * max(1, len(names)) / 2), 3.6))
    for k, name in enumerate(names):
        xs = [g + (k - (len(names) - 1) / 2) * width for g in range(len(groups))]
        values = list(series[name])
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[value_format.format(v) for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)), list(groups))
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.margins(y=0.15)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="0.35")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chart_link(png: Optional[Path], results_md: Path, alt: str = "chart") -> str:
    """The markdown image line for ``png`` relative to ``results_md`` ("" without a chart)."""
    if png is None:
        return ""
    return f"![{alt}]({Path(png).resolve().relative_to(Path(results_md).resolve().parent)})"
