"""`ConfigError`: the one exception a bad recipe, override or component option raises."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A recipe cannot be used; the message lists every problem found, one per line.

    Each problem starts with the full dotted key path (``rollout.group_size: ...``) and
    says what was given and what is valid, so a user fixes everything in one pass
    instead of one error per run.
    """

    def __init__(self, problems: Sequence[str], source: str | None = None) -> None:
        self.problems = list(problems)
        """One line per problem, without the header."""
        self.source = source
        """Where the config came from (a file, overrides), named in the header."""
        count = f"{len(self.problems)} problem{'' if len(self.problems) == 1 else 's'}"
        header = f"invalid config ({source}), {count}:" if source else f"invalid config, {count}:"
        super().__init__("\n  ".join([header, *self.problems]))
