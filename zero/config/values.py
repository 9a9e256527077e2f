"""Value types of the config: whole numbers, reals, flags, choices, ``"auto"``.

Users write ``1e9`` where a count is meant, and tuners print ``"false"`` where
a boolean is meant, so the types here accept exactly what DeepSpeed users have
in their files and nothing looser:

- a whole number accepts an int or an integral float (``1e9`` → 1000000000),
  never a bool or a string;
- a real accepts an int or a float, finite, never a bool or a string;
- a flag accepts true/false, 0/1, and the strings "true"/"false";
- a choice matches case-insensitively and stores the canonical spelling.

A type built with ``auto=True`` also accepts the string ``"auto"`` (the Hugging
Face convention) and carries the :data:`AUTO_ALLOWED` marker, which the base
model uses to find the keys that may still be unresolved (see
``[Note: unresolved auto]`` in base.py).
"""

from __future__ import annotations

import math
import os
import typing
from typing import Annotated, Any, Callable, Literal, Tuple, Union

from pydantic import PlainSerializer, PlainValidator
from pydantic_core import PydanticCustomError

from nvmeio.hints import did_you_mean

from .errors import short

AUTO = "auto"


class _AutoAllowed:
    """Marker in a type's metadata: the key may hold ``"auto"``."""

    def __repr__(self) -> str:
        return "AUTO_ALLOWED"


AUTO_ALLOWED = _AutoAllowed()


def fail(kind: str, message: str) -> typing.NoReturn:
    """Raise a validation error whose text is exactly ``message``."""
    raise PydanticCustomError(kind, message)


def _reject_auto(value: Any) -> None:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        fail("auto_not_allowed", "'auto' is not accepted for this key; give a value")


def whole_number(value: Any, minimum: int | None = None) -> int:
    """An int, or a float with no fractional part (users write 1e9)."""
    _reject_auto(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail("whole_number", f"expected a whole number, got {short(value)}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            fail("whole_number", f"expected a whole number, got {short(value)}")
        value = int(value)
    if minimum is not None and value < minimum:
        fail("too_small", f"must be at least {minimum}, got {value}")
    return value


def real(value: Any, minimum: float | None = None, maximum: float | None = None,
         exclusive_minimum: bool = False) -> float:
    """A finite int or float, returned as float."""
    _reject_auto(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail("real_number", f"expected a number, got {short(value)}")
    value = float(value)
    if not math.isfinite(value):
        fail("real_number", f"expected a finite number, got {value}")
    if minimum is not None:
        if exclusive_minimum and value <= minimum:
            fail("too_small", f"must be greater than {minimum:g}, got {value:g}")
        if not exclusive_minimum and value < minimum:
            fail("too_small", f"must be at least {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        fail("too_large", f"must be at most {maximum:g}, got {value:g}")
    return value


def flag(value: Any) -> bool:
    """true/false, 0/1, or the strings "true"/"false" (as ds_nvme_tune prints)."""
    _reject_auto(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    fail("flag", f"expected true or false, got {short(value)}")


def betas(value: Any) -> Tuple[float, float]:
    """Two Adam coefficients, each in [0, 1)."""
    _reject_auto(value)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        fail("betas", f"expected two numbers [beta1, beta2], got {short(value)}")
    pair = tuple(real(b, minimum=0.0) for b in value)
    if any(b >= 1.0 for b in pair):
        fail("betas", f"each beta must be in [0, 1), got {list(pair)}")
    return pair  # type: ignore[return-value]


def path_text(value: Any) -> str:
    """A filesystem path given as a string or an os.PathLike."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        fail("path", f"expected a path (a non-empty string), got {short(value)}")
    return value


def path_texts(value: Any) -> str | list[str]:
    """A path, or a non-empty list of paths (``nvme_path``: one directory per drive)."""
    if not isinstance(value, (list, tuple)):
        return path_text(value)
    if not value:
        fail("path", "expected a path or a non-empty list of paths, got an empty list")
    paths = [path_text(v) for v in value]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        fail("path", f"the list names {', '.join(twice)} more than once; give each directory once")
    return paths


def file_mode(value: Any) -> int:
    """Permission bits of a file: an octal string ("0640", "0o640") or, from Python, an int
    (``0o640``). The owner must keep read and write; no bit beyond 0o777."""
    _reject_auto(value)
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            fail("file_mode", f"expected an octal mode such as \"0600\" or \"0640\", got {short(value)}")
        value = int(text, 8)
    elif isinstance(value, bool) or not isinstance(value, int):
        fail("file_mode", f"expected an octal mode string such as \"0600\", got {short(value)}")
    if not 0 <= value <= 0o777:
        fail("file_mode", f"mode {value:#o} has bits beyond 0o777 (write it as an octal string, e.g. \"0640\")")
    if value & 0o600 != 0o600:
        fail("file_mode", f"mode {value:#o} does not let the owner read and write the files it saves")
    return value


def dir_name(value: Any) -> str:
    """A plain directory name: no separator, not '.' or '..', no NUL."""
    _reject_auto(value)
    if (not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\0" in value
            or value != value.strip()):
        fail("dir_name", f"expected a plain directory name (no '/', not '.' or '..'), got {short(value)}")
    return value


def _or_auto(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def validate(value: Any) -> Any:
        if isinstance(value, str) and value == AUTO:
            return AUTO
        return check(value)
    return validate


def _as_is(value: Any) -> Any:
    return value


# Serialized by the value's own type: the declared union (tuple or "auto") makes
# pydantic warn on betas in JSON mode, where the tuple is already a list.
_SERIALIZE_AS_IS = PlainSerializer(_as_is, return_type=Any)


def _typed(python_type: Any, check: Callable[[Any], Any], auto: bool) -> Any:
    if auto:
        return Annotated[Union[python_type, Literal["auto"]],
                         PlainValidator(_or_auto(check)), _SERIALIZE_AS_IS, AUTO_ALLOWED]
    return Annotated[python_type, PlainValidator(check), _SERIALIZE_AS_IS]


def Int(minimum: int | None = 0, auto: bool = False) -> Any:
    """Type of a whole-number key (``minimum=None``: any sign)."""
    return _typed(int, lambda v: whole_number(v, minimum), auto)


def ElementCount(minimum: int = 0, auto: bool = False) -> Any:
    """Type of a bucket size or threshold in elements: a whole number, or a fractional number
    rounded down (the Hugging Face docs compute them as ``0.9 * hidden_size * hidden_size``)."""
    def check(value: Any) -> int:
        _reject_auto(value)
        if isinstance(value, float) and math.isfinite(value) and value >= 0:
            value = math.floor(value)
        return whole_number(value, minimum)

    return _typed(int, check, auto)


def Real(minimum: float | None = 0.0, maximum: float | None = None,
         exclusive_minimum: bool = False, auto: bool = False) -> Any:
    """Type of a real-number key."""
    return _typed(float, lambda v: real(v, minimum, maximum, exclusive_minimum), auto)


Flag = _typed(bool, flag, auto=False)
AutoFlag = _typed(bool, flag, auto=True)
Betas = _typed(Tuple[float, float], betas, auto=False)
AutoBetas = _typed(Tuple[float, float], betas, auto=True)
PathText = _typed(str, path_text, auto=False)
PathTexts = _typed(Union[str, list[str]], path_texts, auto=False)
FileMode = _typed(int, file_mode, auto=False)
DirName = _typed(str, dir_name, auto=False)


def Choice(*options: str, what: str = "value", aliases: dict[str, str] | None = None) -> Any:
    """Type of a key with a fixed set of values, matched case-insensitively.

    ``aliases`` maps other accepted spellings to an option. The stored value
    is always the spelling in ``options``.
    """
    table = {o.lower(): o for o in options}
    table.update({a.lower(): o for a, o in (aliases or {}).items()})

    def validate(value: Any) -> str:
        if value is None and "none" in table:
            return table["none"]
        if isinstance(value, str) and value.strip().lower() in table:
            return table[value.strip().lower()]
        supported = ", ".join(options)
        hint = did_you_mean(str(value), options, ignore_case=True)
        hint = f"; did you mean '{hint}'?" if hint else ""
        fail("choice", f"{what} {short(value)} is not supported (supported: {supported}){hint}")

    return Annotated[Literal[options], PlainValidator(validate)]  # type: ignore[valid-type]


COMPUTE_DEVICES = ("auto", "cpu", "cuda", "cuda:N")


def compute_device_name(value: Any) -> str:
    """Where the engine computes: ``"auto"`` (CUDA when available, else the CPU), ``"cpu"``,
    ``"cuda"`` (the rank's local device) or ``"cuda:N"``; case-insensitive, stored lower-case.
    Only the spelling is checked here (no torch): whether CUDA is there is the runtime's question."""
    if isinstance(value, str):
        text = value.strip().lower()
        kind, colon, index = text.partition(":")
        if (text in ("auto", "cpu", "cuda")
                or (kind == "cuda" and colon and index.isascii() and index.isdigit())):
            return f"cuda:{int(index)}" if colon else text
    hint = did_you_mean(str(value), COMPUTE_DEVICES, ignore_case=True)
    hint = f"; did you mean '{hint}'?" if hint else ""
    fail("compute_device", f"compute device {short(value)} is not supported (supported: "
                           f"{', '.join(COMPUTE_DEVICES)}){hint}")


ComputeDevice = _typed(str, compute_device_name, auto=False)


def allows_auto(annotation: Any, metadata: list[Any] = ()) -> bool:
    """Whether a field's type (or its metadata) carries :data:`AUTO_ALLOWED`."""
    if any(m is AUTO_ALLOWED for m in metadata):
        return True
    if typing.get_origin(annotation) is Annotated:
        if any(m is AUTO_ALLOWED for m in annotation.__metadata__):
            return True
    return any(allows_auto(arg) for arg in typing.get_args(annotation))
