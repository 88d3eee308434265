"""OpenAPI descriptions of request bodies a route reads by hand.

Some routes read ``await request.body()`` themselves (a wire whose shapes vary with the
client's options, a binary alternative to JSON) instead of declaring a pydantic body, so
FastAPI cannot describe what they take. `json_body` writes that description into the
route's ``openapi_extra``, so the app's schema documents every body and a fuzzer built
on the schema reaches every route.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["OBJECT", "json_body"]

OBJECT: dict[str, Any] = {"type": "object"}
"""A JSON object, whatever its keys."""


def json_body(properties: Mapping[str, Any] | None = None, *, required: Iterable[str] = (), optional: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is a JSON object with ``properties`` (JSON
    schemas by key; others are allowed), the ``required`` ones among them."""
    schema: dict[str, Any] = {"type": "object", "properties": dict(properties or {})}
    needed = list(required)
    if needed:
        schema["required"] = needed
    return {"requestBody": {"required": not optional, "content": {"application/json": {"schema": schema}}}}
