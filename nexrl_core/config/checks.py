"""Value checks for config fields that report every failing field at once.

An attrs validator runs inside ``__init__`` and stops at the first failure. A `Check`
looks at the value alone, never at the instance, so the config converter can also run
it while it structures each field and collect every failure of a recipe into one
`ConfigError`. Direct construction (``RolloutConfig(group_size=0)``) still runs it as
an ordinary attrs validator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import attrs


class CheckFailed(ValueError):
    """A field value broke its `Check`."""

    def __init__(self, field: str, requirement: str, value: Any) -> None:
        self.field = field
        self.requirement = requirement
        self.value = value
        super().__init__(f"{field} {requirement}, got {value!r}")

    @property
    def reason(self) -> str:
        """The message without the field name, for callers that print the key path."""
        return f"{self.requirement}, got {self.value!r}"


@attrs.frozen
class Check:
    """An attrs validator built from a predicate on the value and the rule in words."""

    requirement: str
    """The rule as a user reads it after the key path, e.g. ``must be > 0``."""
    test: Callable[[Any], bool]
    """True when the value is acceptable; a TypeError counts as a failure."""

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            passed = bool(self.test(value))
        except TypeError:
            passed = False
        if not passed:
            raise CheckFailed(attribute.name, self.requirement, value)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and math.isfinite(value)


_MODULE_ATTRIBUTE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

positive = Check("must be a finite number > 0", lambda value: _finite(value) and value > 0)
non_negative = Check("must be a finite number >= 0", lambda value: _finite(value) and value >= 0)
fraction = Check("must be in [0, 1]", lambda value: _finite(value) and 0 <= value <= 1)
positive_fraction = Check("must be in (0, 1]", lambda value: _finite(value) and 0 < value <= 1)
fraction_below_one = Check("must be in [0, 1)", lambda value: _finite(value) and 0 <= value < 1)
non_empty = Check("must not be empty", lambda value: isinstance(value, str) and value.strip() != "")
SERVICE_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
"""The devices a NexRL service runs on: ``cpu``, ``cuda`` (the current GPU) or ``cuda:N``."""
service_device = Check("must be cpu, cuda or cuda:N", lambda value: isinstance(value, str) and SERVICE_DEVICE.fullmatch(value) is not None)
non_negative_int = Check("must be an integer >= 0", lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0)
optional_positive_int = Check(
    "must be null or an integer > 0",
    lambda value: value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
)
optional_non_negative_int = Check(
    "must be null or an integer >= 0",
    lambda value: value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
)
optional_non_empty = Check(
    "must be null or a non-empty string",
    lambda value: value is None or (isinstance(value, str) and value.strip() != ""),
)
optional_module_attribute = Check(
    "must be null or look like 'package.module:function'",
    lambda value: value is None or _MODULE_ATTRIBUTE.fullmatch(value) is not None,
)
optional_http_url = Check(
    "must be null or start with http:// or https://",
    lambda value: value is None or value.startswith(("http://", "https://")),
)
