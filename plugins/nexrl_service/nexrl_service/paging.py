"""Offset paging of listings, checked the same way on every route that pages.

A listing route takes ``limit`` and ``offset`` from the query string. A negative offset,
or a limit below 1 or above the route's maximum, is a 400 that names the field and its
bounds (not a silently clamped page, which would make a client loop or skip rows).
"""

from __future__ import annotations

import attrs

from nexrl_service.bounds import SQL_INT_MAX
from nexrl_service.errors import BadRequest

__all__ = ["MAX_PAGE", "Page"]

MAX_PAGE = 1000
"""The largest ``limit`` a listing answers."""


@attrs.frozen
class Page:
    """A checked ``limit`` and ``offset``."""

    limit: int
    offset: int

    @classmethod
    def of(cls, limit: int, offset: int, max_limit: int = MAX_PAGE) -> Page:
        """:raises BadRequest: naming ``limit`` or ``offset`` and the values it may take."""
        if not 1 <= limit <= max_limit:
            raise BadRequest(f"limit must be between 1 and {max_limit}, got {limit}; page through longer listings with offset")
        if not 0 <= offset <= SQL_INT_MAX:
            raise BadRequest(f"offset must be between 0 and {SQL_INT_MAX}, got {offset}")
        return cls(limit, offset)

    def cursor(self, total: int) -> dict[str, int]:
        """The page's position, in the shape of the Tinker SDK's ``Cursor``."""
        return {"offset": self.offset, "limit": self.limit, "total_count": total}
