"""Verified math rewards: find the final answer in a model's reply and check it against
the reference with ``math-verify``.

Exact string match scores ``\\boxed{\\frac{3}{4}}`` against ``0.75`` as wrong;
``math-verify`` parses both to SymPy and compares values, so fractions, decimals, LaTeX,
percentages, thousands separators and trailing units (``12\\text{ apples}``,
``5 km``) all count. The reply's answer is taken from ``\\boxed{...}`` first, then from
"the answer is ..."-style phrases, then from the last number or expression.

Agents run on worker threads, where ``math-verify``'s own timeout (``signal.alarm``)
cannot work and raises instead; off the main thread the timeout is therefore off and
the work is bounded by checking only the last `MAX_REPLY_CHARS` characters of a reply.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import attrs
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

MAX_REPLY_CHARS = 2000
"""Only the end of a reply is searched for its answer (where final answers are), which
bounds parsing time where no timeout can run."""
TIMEOUT_S = 5
"""math-verify's own timeout, per parse and per comparison, on the main thread."""
REPLY_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
"""``\\boxed{}`` before any other answer pattern, then LaTeX and plain expressions."""


class _TimeoutOffNotice(logging.Filter):
    """math-verify warns once that its timeout is off; here that is by design (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutOffNotice())


@attrs.frozen
class Answer:
    """A parsed answer: what was written, and what math-verify read from it."""

    text: str
    """The answer as written (the inside of ``\\boxed{}``, or the matched number)."""
    parsed: list[Any] = attrs.field(eq=False, repr=False)
    """math-verify's parse: the SymPy value(s) and the matched string."""


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _reference_text(reference: str | int | float) -> str:
    """A reference as LaTeX math, so ``3/4``, ``\\frac{3}{4}`` and ``0.75`` all parse."""
    text = str(reference).strip()
    if "\\boxed" in text or text.startswith("$"):
        return text
    return f"${text}$"


def extract_answer(reply: str) -> Answer | None:
    """The final answer in a model's reply, or None when it states none."""
    parsed = parse(reply[-MAX_REPLY_CHARS:], extraction_config=REPLY_EXTRACTION, parsing_timeout=_timeout())
    if not parsed:
        return None
    return Answer(text=str(parsed[-1]), parsed=parsed)


def parse_reference(reference: str | int | float) -> Answer:
    """A dataset's reference answer (``12``, ``2.5``, ``3/4``, ``\\frac{3}{4}``), parsed.

    :raises ValueError: when math-verify cannot read it (a data problem, not the model's).
    """
    parsed = parse(_reference_text(reference), parsing_timeout=_timeout())
    if all(isinstance(value, str) for value in parsed):  # nothing, or only the raw text back
        raise ValueError(f"math-verify cannot read the reference answer {reference!r}")
    return Answer(text=str(reference), parsed=parsed)


def answers_match(reply: str, reference: str | int | float) -> bool:
    """Whether the reply's final answer equals the reference in value."""
    answer = extract_answer(reply)
    if answer is None:
        return False
    return bool(verify(parse_reference(reference).parsed, answer.parsed, timeout_seconds=_timeout()))


def math_reward(reply: str, reference: str | int | float) -> float:
    """1.0 when the reply's final answer equals the reference, else 0.0."""
    return 1.0 if answers_match(reply, reference) else 0.0
