"""Reading the SDK's JSON bodies: typed fields or a `BadRequest` naming the field.

The Weaver wire is plain JSON whose shapes vary with the SDK's options, so the
routes read fields one by one instead of declaring schemas; every check says which
field was wrong and what it must be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl_service.runtime import SQL_INT_MAX, BadRequest

__all__ = ["flag", "number", "obj", "optional_int", "optional_str", "required_int", "required_str"]


def obj(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRequest(f"{where} must be a JSON object, got {type(value).__name__}")
    return dict(value)


def optional_int(body: Mapping[str, Any], key: str, where: str = "body", minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where}.{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{where}.{key} must be at least {minimum}, got {value}")
    if not -SQL_INT_MAX - 1 <= value <= SQL_INT_MAX:
        raise BadRequest(f"{where}.{key} must fit a signed 64-bit integer (at most {SQL_INT_MAX}), got {value}")
    return value


def required_int(body: Mapping[str, Any], key: str, where: str = "body", minimum: int | None = None) -> int:
    value = optional_int(body, key, where, minimum)
    if value is None:
        raise BadRequest(f"{where}.{key} is required (an integer)")
    return value


def optional_str(body: Mapping[str, Any], key: str, where: str = "body") -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def required_str(body: Mapping[str, Any], key: str, where: str = "body") -> str:
    value = optional_str(body, key, where)
    if value is None:
        raise BadRequest(f"{where}.{key} is required (a string)")
    return value


def flag(body: Mapping[str, Any], key: str, where: str = "body", default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.{key} must be true or false, got {value!r}")
    return value


def number(body: Mapping[str, Any], key: str, where: str, default: float) -> float:
    """``body[key]`` as a float; absent or null is ``default`` (as `flag` reads a null)."""
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{where}.{key} must be a number, got {value!r}")
    return float(value)
