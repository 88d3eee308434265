"""The largest numbers a client may send, for fields the service stores or loops over.

Sequence numbers, seeds and ids go into SQL ``INTEGER``/``BIGINT`` columns, which hold
signed 64-bit values: a larger one must be a 4xx naming the field, not an overflow deep
in the store. Request models use the annotated types; hand-parsed bodies check against
`SQL_INT_MAX`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = ["SQL_INT_MAX", "SeqId", "StoredInt"]

SQL_INT_MAX = 2**63 - 1
"""The largest value a signed 64-bit SQL integer column holds."""

StoredInt = Annotated[int, Field(strict=True, ge=0, le=SQL_INT_MAX)]
"""A non-negative integer the store keeps (a seed, a count); ``true`` is not 1."""

SeqId = StoredInt
"""A sequence number (``seq_id``, ``model_seq_id``, ``sampling_session_seq_id``)."""
