"""bench/RESULTS.md holds one "## " section per benchmark; each script
replaces only its own."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, heading: str, body: str) -> None:
    text = path.read_text() if path.exists() else "# nvmeio benchmark results\n"
    section = f"{heading}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + section + ("\n" + tail if tail else ""))
