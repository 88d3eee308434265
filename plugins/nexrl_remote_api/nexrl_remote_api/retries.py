"""Retry a call to a remote service on transient errors, with exponential backoff.

Every holder of a remote training API needs the same loop: try, and on an error the
service's SDK calls transient (a dropped connection, a 5xx, a rate limit) wait
``backoff * 2**attempt`` and try again, at most ``max_retries`` more times; then fail
with a message that says what was being done, where, and how often it was tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["RetriesExhausted", "call_with_retries"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class RetriesExhausted(RuntimeError):
    """Every attempt failed with a transient error; the last one is the cause."""


def call_with_retries(
    call: Callable[[], T],
    *,
    what: str,
    where: str,
    is_transient: Callable[[BaseException], bool],
    max_retries: int,
    backoff_s: float,
) -> T:
    """``call()``, retried while it fails with errors ``is_transient`` accepts.

    :param what: the action, for messages (``"sample"`` reads "failed to sample").
    :param where: the service, for messages (``"the Tinker service at http://..."``).
    :raises RetriesExhausted: after ``max_retries + 1`` transient failures.
    :raises Exception: the first error that is not transient, as the call raised it.
    """
    for attempt in range(max_retries + 1):
        try:
            return call()
        except Exception as error:
            if not is_transient(error):
                raise
            if attempt == max_retries:
                raise RetriesExhausted(f"{where} failed to {what} after {attempt + 1} attempts: {type(error).__name__}: {error}") from error
            delay = backoff_s * 2**attempt
            logger.warning("could not %s (%s); retrying in %.1f s", what, error, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
