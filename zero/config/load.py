"""``load_config``: a DeepSpeed JSON file or dict in, a DeepSpeedConfig out."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping, Optional, Union

from .auto import check_hidden_size, fill_autos
from .ds_config import DeepSpeedConfig, validate_config
from .errors import ConfigError, Problem

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], DeepSpeedConfig]


def load_config(config: ConfigSource, world_size: int = 1,
                hidden_size: Optional[int] = None) -> DeepSpeedConfig:
    """Read and validate a DeepSpeed config.

    ``config`` is a path to a JSON file, a dict (not modified), or a
    DeepSpeedConfig (validated again for this ``world_size``). ``world_size``
    ties the three batch sizes together. ``hidden_size``, when given, resolves
    the ``"auto"`` bucket sizes; other ``"auto"`` values stay until
    :func:`resolve_auto` (reading one before raises UnresolvedAutoError).

    Raises ConfigError listing every problem found, each with the dotted path
    of its key. Deprecated keys are mapped and warned about
    (ConfigDeprecationWarning).
    """
    source, quiet = None, False
    if isinstance(config, DeepSpeedConfig):
        data, quiet = config.model_dump(exclude_unset=True), True
    elif isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        data = read_json(source)
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
    else:
        raise TypeError(f"config must be a path, a dict or a DeepSpeedConfig, got {type(config).__name__}")
    hidden_size = check_hidden_size(hidden_size)
    loaded = validate_config(data, world_size=world_size, source=source, quiet=quiet, stacklevel=3)
    if hidden_size is None or not loaded.unresolved_autos():
        return loaded
    data = loaded.model_dump(exclude_unset=True)
    fill_autos(data, hidden_size, {}, require_all=False)
    return validate_config(data, world_size=world_size, source=source, quiet=True)


def read_json(path: str) -> Any:
    """Parse a JSON file; a syntax error or a duplicated key is a ConfigError."""
    duplicated: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                duplicated.append(key)
            obj[key] = value
        return obj

    with open(path, encoding="utf-8") as file:
        try:
            data = json.load(file, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as error:
            raise ConfigError([Problem("", (
                f"not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"))],
                source=path) from None
    if duplicated:
        raise ConfigError([Problem(key, "appears twice in the same JSON object; keep one")
                           for key in duplicated], source=path)
    return data
