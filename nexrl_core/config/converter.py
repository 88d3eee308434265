"""The one cattrs converter for configs, and how its errors become a `ConfigError`.

Two things differ from a stock cattrs converter, both so that a user's mistake is
reported instead of silently repaired:

- Scalars are strict. cattrs would turn ``"8"`` into 8 and any value into a bool; here
  an int field takes only an int, a float field an int or a float, a bool field only a
  bool, a str field only a str, and a list or mapping field only a list or mapping.
- Every problem is collected. Unknown keys, wrong types and bad enum values come back
  from cattrs as nested exception groups, and fields guarded by a `Check` are checked
  while they are structured, so `describe_problems` can flatten them all into
  ``key.path: what is wrong`` lines.
"""

from __future__ import annotations

import difflib
import enum
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import AttributeValidationNote, ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, make_mapping_structure_fn, override

from nexrl_core.config.checks import Check, CheckFailed
from nexrl_core.config.errors import ConfigError

T = TypeVar("T")


def _show(value: Any) -> str:
    """A short repr of a user-given value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


class WrongTypeError(TypeError):
    """A value of the wrong type for its field."""

    def __init__(self, expected: str, value: Any) -> None:
        self.reason = f"expected {expected}, got {_show(value)} ({type(value).__name__})"
        super().__init__(self.reason)


class NotOneOfError(ValueError):
    """A value that is not one of an enum's values."""

    def __init__(self, value: Any, valid: list[str]) -> None:
        self.reason = f"{_show(value)} is not one of: {', '.join(valid)}"
        super().__init__(self.reason)


_SCALAR_TYPES: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
"""Field type → the Python types its values may have (bool is never taken as an int)."""


def _structure_enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        raise NotOneOfError(value, sorted(str(member.value) for member in cls)) from None


def _structure_scalar(value: Any, cls: type[Any]) -> Any:
    # cattrs dispatches on the MRO, so str- and int-valued enums arrive here too.
    if issubclass(cls, enum.Enum):
        return _structure_enum(value, cls)
    accepted = next(_SCALAR_TYPES[base] for base in cls.__mro__ if base in _SCALAR_TYPES)
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        raise WrongTypeError(cls.__name__, value)
    return cls(value)


def _requiring(kind: type | tuple[type, ...], description: str, structure: Callable[[Any, Any], T]) -> Callable[[Any, Any], T]:
    """Wrap ``structure`` so a value that is not a ``kind`` is a type error, not a crash."""

    def structure_checked(value: Any, target: Any) -> T:
        if not isinstance(value, kind):
            raise WrongTypeError(description, value)
        return structure(value, target)

    return structure_checked


def _is_list_type(target: Any) -> bool:
    return target is list or typing.get_origin(target) is list


def _is_dict_type(target: Any) -> bool:
    return target is dict or typing.get_origin(target) is dict


def _structure_list_factory(target: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    return _requiring((list, tuple), "a list", list_structure_factory(target, converter))


def _structure_dict_factory(target: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    return _requiring(Mapping, "a mapping", make_mapping_structure_fn(target, converter))


def _string_or_record(target: Any) -> type | None:
    """The attrs class of a ``str | Record | None`` union (a path or its long form), else None."""
    if typing.get_origin(target) not in (typing.Union, types.UnionType):
        return None
    members = [member for member in typing.get_args(target) if member is not type(None)]
    records = [member for member in members if attrs.has(member)]
    return records[0] if len(records) == 1 and sorted(members, key=str) == sorted([str, records[0]], key=str) else None


def _structure_string_or_record_factory(target: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    record = _string_or_record(target)
    assert record is not None
    allows_none = type(None) in typing.get_args(target)

    def structure(value: Any, _: Any) -> Any:
        if value is None and allows_none:
            return None
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping):
            return converter.structure(value, record)
        raise WrongTypeError(f"a string or a mapping of {', '.join(field.name for field in attrs.fields(record))}", value)

    return structure


def _checked(structure: Callable[[Any, Any], Any], field: attrs.Attribute[Any]) -> Callable[[Any, Any], Any]:
    """Structure a field and run its `Check` at once, so each failing field is reported."""

    check = field.validator
    assert check is not None, f"{field.name} has no Check to run"

    def structure_and_check(value: Any, target: Any) -> Any:
        result = structure(value, target)
        check(None, field, result)
        return result

    return structure_and_check


def _structure_attrs_factory(cls: type, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    fields = attrs.fields(attrs.resolve_types(cls))
    overrides = {
        field.name: override(struct_hook=_checked(converter.get_structure_hook(field.type), field))
        for field in fields
        if isinstance(field.validator, Check)
    }
    # cattrs types **overrides as AttributeOverride, but mypy also matches the dict against its _cattrs_* flags
    structure: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, converter, **overrides)  # type: ignore[arg-type]
    return _requiring(Mapping, "a mapping", structure)


def _unstructure_scalar(value: Any) -> Any:
    # str- and int-valued enums dispatch to the str and int hooks; dump them as values.
    return value.value if isinstance(value, enum.Enum) else value


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    for base in (str, int):
        converter.register_unstructure_hook(base, _unstructure_scalar)
    for scalar in _SCALAR_TYPES:
        converter.register_structure_hook(scalar, _structure_scalar)
    converter.register_structure_hook(enum.Enum, _structure_enum)
    converter.register_structure_hook_factory(_is_list_type, _structure_list_factory)
    converter.register_structure_hook_factory(_is_dict_type, _structure_dict_factory)
    converter.register_structure_hook_factory(attrs.has, _structure_attrs_factory)
    converter.register_structure_hook_factory(lambda target: _string_or_record(target) is not None, _structure_string_or_record_factory)
    return converter


converter = _make_converter()
"""Structures YAML-shaped data into config classes and back; shared by every config."""


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _unknown_keys(path: str, error: ForbiddenExtraKeysError) -> list[str]:
    valid = sorted(field.name for field in attrs.fields(error.cl))
    listed = f"valid keys: {', '.join(valid)}" if valid else "it takes no keys"
    problems = []
    for key in sorted(error.extra_fields, key=str):
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(f"{_join(path, key)}: unknown key; {hint}{listed}")
    return problems


def describe_problems(error: BaseException, path: str = "") -> list[str]:
    """Flatten a structuring error into ``key.path: what is wrong`` lines, one per problem.

    :param path: the dotted path of the value that was being structured (empty for a
        whole recipe).
    """
    if isinstance(error, (ClassValidationError, IterableValidationError)):
        located, unlocated = error.group_exceptions()
        problems = []
        for inner, note in located:
            key = note.name if isinstance(note, AttributeValidationNote) else note.index
            problems += describe_problems(inner, _join(path, key))
        for inner in unlocated:
            problems += describe_problems(inner, path)
        return problems
    if isinstance(error, ForbiddenExtraKeysError):
        return _unknown_keys(path, error)
    where = path or "(top level)"
    if isinstance(error, (WrongTypeError, NotOneOfError, CheckFailed)):
        return [f"{where}: {error.reason}"]
    if isinstance(error, KeyError):
        return [f"{where}: required key is missing"]
    if isinstance(error, (ValueError, TypeError)):
        return [f"{where}: {error}"]
    return [f"{where}: {type(error).__name__}: {error}"]


def dump_config(config: Any) -> dict[str, Any]:
    """The config as plain YAML-ready data (enums as their values), for printing or saving."""
    data: dict[str, Any] = converter.unstructure(config)
    return data


def structure_config(raw: Any, cls: type[T], path: str = "", source: str | None = None) -> T:
    """Structure ``raw`` into ``cls`` with the config converter.

    :param path: dotted key path of ``raw`` within the recipe, prefixed to every problem.
    :param source: where ``raw`` came from, named in the error's header.
    :raises ConfigError: listing every problem found.
    """
    try:
        return converter.structure(raw, cls)
    except Exception as error:  # every structuring failure is the user's config's fault
        raise ConfigError(describe_problems(error, path), source=source) from None
