"""The one "did you mean" of the project: the closest known name to a misspelled one.

Used wherever a name is looked up in a fixed set (config keys, choices,
sweep keys, keyword arguments), so every layer suggests alike.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional

__all__ = ["did_you_mean", "hint"]

CUTOFF = 0.6  # difflib's similarity ratio below which no suggestion is made


def did_you_mean(word: str, candidates: Iterable[str], ignore_case: bool = False) -> Optional[str]:
    """The candidate closest to ``word``, or None when none is close."""
    candidates = list(candidates)
    if ignore_case:
        lowered = {c.lower(): c for c in candidates}
        match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=CUTOFF)
        return lowered[match[0]] if match else None
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=CUTOFF)
    return match[0] if match else None


def hint(word: str, candidates: Iterable[str], what: str = "known keys") -> str:
    """``"did you mean 'x'?"``, or the list of candidates when none is close."""
    candidates = list(candidates)
    match = did_you_mean(word, candidates)
    if match is not None:
        return f"did you mean {match!r}?"
    return f"{what}: {', '.join(candidates)}"
