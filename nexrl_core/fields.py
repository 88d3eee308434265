"""Converters for attrs fields, typed so that a type checker sees what a field takes.

``attrs.field(converter=tuple)`` works at run time, but mypy's attrs plugin reads the
converter's own signature for ``__init__``: ``tuple``'s is generic, so every caller's
argument fails to match. Each converter here says its element type.
"""

from __future__ import annotations

from collections.abc import Iterable


def string_tuple(values: Iterable[str]) -> tuple[str, ...]:
    """Any iterable of strings, kept as an immutable tuple (a list given is copied)."""
    return tuple(values)


def string_frozenset(values: Iterable[str]) -> frozenset[str]:
    """Any iterable of strings, as a frozenset."""
    return frozenset(values)


def int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """Any iterable of integers, kept as an immutable tuple."""
    return tuple(values)
