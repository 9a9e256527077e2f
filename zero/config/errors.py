"""What the config layer raises and warns.

Every problem found in a DeepSpeed config is a :class:`Problem`: the dotted path
of the key (``zero_optimization.offload_param.buffer_count``) and a sentence
that says what is wrong and what to write instead. One :class:`ConfigError`
carries all the problems of one load, so a user fixes a file in one pass.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Problem(NamedTuple):
    """One thing wrong with a config: where (dotted key path) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be used as written.

    ``problems`` lists every problem found; ``str(error)`` shows them all, one
    per line, each starting with the dotted path of the key concerned.
    """

    summary = "invalid DeepSpeed config"

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" {source}" if source else ""
        if len(self.problems) == 1:
            text = f"{self.summary}{where}: {self.problems[0]}"
        else:
            head = f"{self.summary}{where}, {len(self.problems)} problems:"
            text = "\n  - ".join([head, *map(str, self.problems)])
        super().__init__(text)


class UnresolvedAutoError(ConfigError):
    """A key still holds ``"auto"`` and the engine tried to read its value."""

    summary = 'unresolved "auto" in the DeepSpeed config'


class ConfigDeprecationWarning(UserWarning):
    """An old key was read and mapped to its new name.

    A UserWarning rather than a DeprecationWarning because it is meant for the
    person who wrote the config file, and Python hides DeprecationWarning
    outside ``__main__`` by default.
    """


class IgnoredSettingWarning(UserWarning):
    """A key DeepSpeed knows was set, but nvmeio has no such feature."""


def short(value: object) -> str:
    """``repr(value)``, cut to 60 characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
