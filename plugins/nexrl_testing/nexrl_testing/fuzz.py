"""Fuzz a running HTTP app through its own OpenAPI schema (schemathesis on Hypothesis).

Every operation of the schema gets ``max_examples`` generated requests, valid ones and
ones that break the schema (wrong types, missing fields, out-of-range numbers), sent to
the app on 127.0.0.1. A request must never answer 5xx (but a 5xx the operation declares
in its schema's responses, such as a documented 501 refusal) and never take longer than
``deadline_s``; both are collected rather than raised, so one run lists every finding
(Hypothesis does not spend time shrinking) and the caller asserts on the report. Runs
are derandomized: the same schema gives the same requests.

Used by each HTTP app's fuzz test (``tests/test_fuzz*.py`` of the distributions that
serve one); needs ``schemathesis``, which those tests' extras install.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

__all__ = ["FuzzReport", "fuzz_app", "undescribed_objects"]


@attrs.define
class FuzzReport:
    """What one fuzz run sent and what came back."""

    operations: int = 0
    cases: int = 0
    statuses: Counter[int] = attrs.field(factory=Counter)
    server_errors: list[str] = attrs.field(factory=list)
    """``METHOD /path -> status: body`` for each 5xx."""
    hangs: list[str] = attrs.field(factory=list)
    """``METHOD /path`` for each request that took longer than the deadline."""

    def summary(self) -> str:
        codes = ", ".join(f"{code}: {count}" for code, count in sorted(self.statuses.items()))
        return (
            f"{self.cases} requests over {self.operations} operations ({codes}); "
            f"{len(self.server_errors)} server errors, {len(self.hangs)} past the deadline"
        )


def fuzz_app(
    schema: Mapping[str, Any],
    base_url: str,
    *,
    headers: Mapping[str, str] | None = None,
    max_examples: int = 20,
    deadline_s: float = 10.0,
    skip: Iterable[str] = (),
    on_case: Callable[[Any], None] | None = None,
) -> FuzzReport:
    """Send every operation of ``schema`` (but the ``"METHOD /path"`` in ``skip``)
    ``max_examples`` positive and as many negative generated requests at ``base_url``.

    ``on_case`` may adjust each generated case before it is sent (for instance fill a
    path parameter with an id that exists, so the request reaches the handler)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.result import Err

    loaded = schemathesis.openapi.from_dict(dict(schema))
    skipped = set(skip)
    report = FuzzReport()
    sent_headers = dict(headers or {})
    with requests.Session() as session:
        for result in loaded.get_all_operations():
            if isinstance(result, Err):
                raise result.err()
            operation = result.ok()
            name = f"{operation.method.upper()} {operation.path}"
            if name in skipped:
                continue
            report.operations += 1
            declared = {int(code) for code in (operation.definition.raw.get("responses") or {}) if str(code).isdigit()}
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(
                    max_examples=max_examples,
                    derandomize=True,
                    deadline=None,
                    database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @given(operation.as_strategy(generation_mode=mode))  # type: ignore[arg-type]  # GenerationMode is an enum.StrEnum, which mypy's python_version 3.10 lacks, so its members read as str
                def send(case: Any) -> None:
                    if on_case is not None:
                        on_case(case)
                    report.cases += 1
                    try:
                        response = case.call(base_url=base_url, session=session, headers=sent_headers, timeout=deadline_s)
                    except requests.Timeout:
                        report.hangs.append(name)  # noqa: B023 - send() runs in this iteration
                        return
                    report.statuses[response.status_code] += 1
                    if response.status_code >= 500 and response.status_code not in declared:  # noqa: B023 - as above
                        report.server_errors.append(f"{name} -> {response.status_code}: {response.text[:300]}")  # noqa: B023 - as above

                try:
                    send()
                except Unsatisfiable:  # nothing in the operation can be made invalid (or valid)
                    continue
    return report


def undescribed_objects(schema: Any, where: str = "body") -> list[str]:
    """Where a request body's JSON schema says "an object" without saying what is in it
    (no ``properties``, no ``additionalProperties``): the fuzzer sends such an object
    empty or with random keys, so it never reaches the checks of the fields inside."""
    found = []
    if isinstance(schema, Mapping):
        if schema.get("type") == "object" and "properties" not in schema and "additionalProperties" not in schema:
            found.append(where)
        for key, value in (schema.get("properties") or {}).items():
            found += undescribed_objects(value, f"{where}.{key}")
        found += undescribed_objects(schema.get("items"), f"{where}[]")
        found += undescribed_objects(schema.get("additionalProperties"), f"{where}.*")
        for option in schema.get("anyOf") or ():
            found += undescribed_objects(option, where)
    return found
