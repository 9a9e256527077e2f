"""The strict base model of every config section, and did-you-mean.

Each section of the DeepSpeed JSON is a frozen pydantic model deriving from
:class:`StrictModel`. What the base adds to pydantic:

- unknown keys are errors (``extra="forbid"``); :func:`problems_from` turns
  pydantic's errors into :class:`~.errors.Problem` s with dotted paths and a
  did-you-mean hint taken from the section's own keys;
- other spellings DeepSpeed accepts: ``_aliases`` (silent, e.g.
  ``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``) and
  ``_renamed`` (deprecated: mapped, and noted for a warning), plus an
  ``_upgrade`` hook for old forms that change shape (``cpu_offload: true``);
- ``_inert``: keys accepted for compatibility that nvmeio has no feature for;
  setting one to a non-default value is noted for an IgnoredSettingWarning;
- ``_unsupported``: DeepSpeed keys of features this engine does not have
  (``pipeline``, ``amp``, ...): still errors, but the message says so and
  what to use instead, not a did-you-mean to a key of another meaning;
- reading a key that still holds ``"auto"`` raises, see the note below.

Notes (deprecations, inert settings) are collected on the section while it is
validated and emitted by the top-level model once the whole config is valid,
so each warning names the full dotted path.

[Note: unresolved auto]
A config may hold ``"auto"`` for the keys Hugging Face resolves (bucket sizes,
lr, batch sizes, ...). Loading such a config must work, because the engine
learns the hidden size and the trainer's values later; but the engine must
never compute with the string ``"auto"``. So the value is stored as the string
``"auto"`` (it round-trips through ``model_dump``), and attribute access to a
key that still holds it raises :class:`~.errors.UnresolvedAutoError`, naming
the key and the argument of ``resolve_auto`` that fills it. Validators of this
package read such keys through :meth:`StrictModel.raw` instead.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, ClassVar, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ErrorType

from nvmeio.hints import did_you_mean

from .auto_rules import unresolved_message
from .errors import Problem, UnresolvedAutoError, short
from .values import AUTO, allows_auto

_PYDANTIC_ERROR_TYPES = frozenset(typing.get_args(ErrorType))


def join(path: str, key: str) -> str:
    """``join("zero_optimization", "stage")`` -> ``"zero_optimization.stage"``."""
    return f"{path}.{key}" if path else key


def dotted(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted key path (list items as ``[i]``)."""
    text = ""
    for part in loc:
        text = f"{text}[{part}]" if isinstance(part, int) else join(text, str(part))
    return text


def _details(problems: list[tuple[tuple[str, ...], str, Any]]) -> list[Any]:
    return [{"type": PydanticCustomError("inconsistent", message), "loc": loc, "input": value}
            for loc, message, value in problems]


def problem_error(title: str, problems: list[tuple[tuple[str, ...], str, Any]]) -> ValidationError:
    """One pydantic error holding every ``(loc, message, input)`` given.

    Raised inside a validator, pydantic prefixes each ``loc`` with the
    location of the section, so nested checks report full dotted paths.
    """
    return ValidationError.from_exception_data(title, _details(problems))


def with_problems(error: ValidationError, title: str,
                  problems: list[tuple[tuple[str, ...], str, Any]]) -> ValidationError:
    """``error`` with more problems added (to report them all in one error)."""
    details: list[Any] = []
    for item in error.errors(include_url=False):
        if item["type"] in _PYDANTIC_ERROR_TYPES:
            detail = {"type": item["type"], "loc": item["loc"], "input": item["input"]}
            if "ctx" in item:
                detail["ctx"] = item["ctx"]
        else:
            detail = {"type": PydanticCustomError(item["type"], item["msg"]),
                      "loc": item["loc"], "input": item["input"]}
        details.append(detail)
    return ValidationError.from_exception_data(title, details + _details(problems))


def raise_problems(title: str, problems: list[tuple[tuple[str, ...], str, Any]]) -> None:
    """Raise :func:`problem_error` if there is any problem."""
    if problems:
        raise problem_error(title, problems)


class StrictModel(BaseModel):
    """A section of the DeepSpeed config: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    _aliases: ClassVar[Mapping[str, str]] = {}
    _renamed: ClassVar[Mapping[str, str]] = {}
    _inert: ClassVar[frozenset[str]] = frozenset()
    _unsupported: ClassVar[Mapping[str, str]] = {}
    _auto_fields: ClassVar[frozenset[str]] = frozenset()

    _path: str = PrivateAttr("")
    _notes: list = PrivateAttr(default_factory=list)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._auto_fields = frozenset(
            name for name, field in cls.model_fields.items()
            if allows_auto(field.annotation, field.metadata))

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if type(value) is str and value == AUTO and name in type(self)._auto_fields:
            path = join(self._path, name)
            raise UnresolvedAutoError([Problem(path, unresolved_message(path))])
        return value

    def __eq__(self, other: Any) -> bool:
        # By value: the private path and notes say where a section was read,
        # not what it holds (config.aio equals the zero_optimization.aio it came from).
        if not isinstance(other, StrictModel):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def raw(self, name: str) -> Any:
        """A key's stored value, ``"auto"`` included (no UnresolvedAutoError)."""
        return self.__dict__[name]

    def is_auto(self, name: str) -> bool:
        """Whether a key still holds ``"auto"``."""
        return self.__dict__.get(name) == AUTO and name in type(self)._auto_fields

    def inert_now(self) -> Mapping[str, str]:
        """Keys set here that have no effect given the section's other values, each with why
        (warned as the ``_inert`` keys are); none by default."""
        return {}

    # -- reading old spellings -------------------------------------------

    @model_validator(mode="wrap")
    @classmethod
    def _accept_old_spellings(cls, data: Any, handler: Any) -> Any:
        notes: list = []
        if isinstance(data, Mapping):
            data = dict(data)
            early: list = []
            for old, new in cls._renamed.items():
                _move_key(data, old, new, early, notes)
            for alias, key in cls._aliases.items():
                _move_key(data, alias, key, early, None)
            data = cls._upgrade(data, notes)
            early += cls._check_given(data)
            try:
                model = handler(data)
            except ValidationError as error:
                if early:
                    raise with_problems(error, cls.__name__, early) from None
                raise
            raise_problems(cls.__name__, early)
        else:
            model = handler(data)
        model._notes.extend(notes)
        return model

    @classmethod
    def _upgrade(cls, data: dict, notes: list) -> dict:
        """Rewrite old forms of this section; append ``(old, new)`` to notes.

        ``old`` is the key (or form) read; ``new`` is the key, or a tuple of
        keys, to write instead, relative to this section, optionally with
        ``= value``.
        """
        return data

    @classmethod
    def _check_given(cls, data: dict) -> list[tuple[tuple[str, ...], str, Any]]:
        """Problems found in the keys as given, before they are validated.

        For checks that must be reported even when another key of the
        section is invalid (an after-validator runs only on a valid section).
        Values here are unvalidated: skip what cannot be read.
        """
        return []

    # -- the shape of the config, for messages ------------------------------

    @classmethod
    def known_keys(cls) -> dict[str, str]:
        """Every accepted key of this section -> its canonical name."""
        keys = {name: name for name in cls.model_fields}
        keys.update(cls._aliases)
        keys.update(cls._renamed)
        return keys

    @classmethod
    def child_models(cls, name: str, raw: Any = None) -> list[type["StrictModel"]]:
        """The section types a key of this section holds (none for a value)."""
        field = cls.model_fields.get(cls.known_keys().get(name, name))
        return _models_in(field.annotation) if field is not None else []


def _move_key(data: dict, old: str, new: str, problems: list, notes: list | None) -> None:
    """Rename ``old`` to ``new``; a different value under both is a problem."""
    if old not in data:
        return
    value = data.pop(old)
    if new in data and data[new] != value:
        problems.append(((old,), (f"'{old}' and '{new}' are both given, with different values "
                                  f"({short(value)} and {short(data[new])}); keep only '{new}'"), value))
        return
    data[new] = value
    if notes is not None:
        notes.append((old, new))


def _models_in(annotation: Any) -> list[type[StrictModel]]:
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return [annotation]
    found: list[type[StrictModel]] = []
    for arg in typing.get_args(annotation):
        found += [m for m in _models_in(arg) if m not in found]
    return found


def sections(model: StrictModel, path: str = "") -> Iterator[tuple[str, StrictModel]]:
    """``(dotted path, section)`` for ``model`` and every section inside it."""
    yield path, model
    for name in type(model).model_fields:
        value = model.__dict__[name]
        if isinstance(value, StrictModel):
            yield from sections(value, join(path, name))


# -- turning pydantic's errors into problems ----------------------------------

def problems_from(error: ValidationError, root: type[StrictModel], raw: Any) -> list[Problem]:
    """One :class:`Problem` per pydantic error, with dotted paths and hints."""
    problems = []
    for item in error.errors(include_url=False):
        loc, kind = item["loc"], item["type"]
        if kind == "extra_forbidden":
            message = _unknown_key_message(root, loc, raw)
        elif kind == "missing":
            message = "required key is missing"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            message = f"expected a JSON object (a section of keys), got {short(item['input'])}"
        elif kind in _PYDANTIC_ERROR_TYPES:
            message = f"{item['msg']} (got {short(item['input'])})"
        else:
            message = item["msg"]
        problems.append(Problem(dotted(loc), message))
    return problems


def _section_at(root: type[StrictModel], loc: tuple[Any, ...], raw: Any) -> type[StrictModel] | None:
    cls: type[StrictModel] | None = root
    for part in loc:
        if cls is None or not isinstance(part, str):
            return None
        here = raw if isinstance(raw, Mapping) else {}
        children = cls.child_models(part, here)
        raw = here.get(part)
        cls = children[0] if len(children) == 1 else None
    return cls


@functools.lru_cache(maxsize=None)
def key_homes(root: type[StrictModel]) -> dict[str, list[str]]:
    """Every canonical key of the config tree -> the sections that have it."""
    homes: dict[str, list[str]] = {}

    def visit(cls: type[StrictModel], path: str) -> None:
        home = path or "the top level"
        for name in cls.model_fields:
            if home not in homes.setdefault(name, []):
                homes[name].append(home)
            for child in cls.child_models(name):
                visit(child, join(path, name))

    visit(root, "")
    return homes


def _unknown_key_message(root: type[StrictModel], loc: tuple[Any, ...], raw: Any) -> str:
    key = str(loc[-1])
    section = _section_at(root, loc[:-1], raw)
    if section is None:
        return "unknown key"
    unsupported = section._unsupported.get(key)
    if unsupported is not None:
        return unsupported
    known = section.known_keys()
    elsewhere = [h for h in key_homes(root).get(key, []) if h != (dotted(loc[:-1]) or "the top level")]
    where = f" ('{key}' is a key of {', '.join(elsewhere[:4])})" if elsewhere else ""
    hint = did_you_mean(key, known)
    if hint is not None:
        canonical = known[hint]
        formerly = f" (formerly '{hint}')" if canonical != hint and hint in section._renamed else ""
        name = canonical if formerly else hint
        return f"unknown key{where}; did you mean '{name}'{formerly}?"
    if where:
        return f"unknown key here{where}"
    return f"unknown key (known keys: {', '.join(sorted(section.model_fields))})"
