"""The v1 key table (``keys.yaml`` beside this module) as attrs records.

The table is data so that the converter (`nexrl_core.v1.convert`) and the page
``docs/coming-from-v1.md`` (`nexrl_core.v1.docs`) read one source; this module only
checks that every entry is well formed, so a mistake in the file fails on import with the
entry named rather than as a wrong conversion.
"""

from __future__ import annotations

import enum
from functools import cache
from importlib.resources import files
from typing import Any

import attrs
import yaml

__all__ = ["ABSENT", "Fate", "KeyRule", "KeyTable", "Profile", "Section", "key_table"]


class _Absent(enum.Enum):
    ABSENT = "absent"


ABSENT = _Absent.ABSENT
"""No value: a key the recipe leaves out and for which v1 had no default."""


class Fate(str, enum.Enum):
    """What becomes of a v1 key."""

    CARRIED = "carried"
    """Its value goes to ``new`` (through ``values`` when given)."""
    RULE = "rule"
    """A conversion in `nexrl_core.v1.rules` reads it with other keys."""
    DROPPED = "dropped"
    """It means nothing here (``why``)."""
    UNSUPPORTED = "unsupported"
    """It changes training in a way NexRL cannot (``why``, ``instead``), except for its
    ``inert`` values, which change nothing and are dropped (``inert_why``)."""


@attrs.frozen(kw_only=True)
class KeyRule:
    """One row of the table."""

    v1: str
    """The key in the one shape every v1 recipe is brought to; ``x.*`` is everything under ``x``."""
    fate: Fate
    new: tuple[str, ...] = ()
    """The NexRL keys its value may reach (one for a carried key)."""
    rule: str | None = None
    why: str = ""
    """Why it is dropped or unsupported; a carried key's note."""
    instead: str = ""
    inert: tuple[Any, ...] = ()
    inert_why: str = ""
    kinds: tuple[str, ...] = ()
    """The kinds of run it means something in (empty: every kind)."""
    v1_default: Any = ABSENT
    values: dict[Any, Any] | None = None
    """v1 value -> NexRL value, for a carried key whose values are spelled differently."""

    @property
    def is_subtree(self) -> bool:
        return self.v1.endswith(".*")

    def matches(self, key: str) -> bool:
        """Whether the canonical ``key`` is this row's (a subtree row matches everything under it)."""
        if self.is_subtree:
            prefix = self.v1[:-2]
            return key == prefix or key.startswith(prefix + ".")
        return key == self.v1

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> KeyRule:
        entry = dict(data)
        v1 = entry.pop("v1")
        kinds = tuple(entry.pop("kinds", ()))
        common: dict[str, Any] = {"v1": v1, "kinds": kinds}
        if "v1_default" in entry:
            common["v1_default"] = entry.pop("v1_default")
        if "drop" in entry:
            rule = cls(fate=Fate.DROPPED, why=entry.pop("drop"), **common)
        elif "unsupported" in entry:
            rule = cls(
                fate=Fate.UNSUPPORTED,
                why=entry.pop("unsupported"),
                instead=entry.pop("instead"),
                inert=tuple(entry.pop("inert", ())),
                inert_why=entry.pop("inert_why", ""),
                **common,
            )
        elif "rule" in entry:
            rule = cls(fate=Fate.RULE, rule=entry.pop("rule"), new=tuple(entry.pop("new")), why=entry.pop("note", ""), **common)
        else:
            rule = cls(fate=Fate.CARRIED, new=(entry.pop("new"),), values=entry.pop("values", None), why=entry.pop("note", ""), **common)
        if entry:
            raise ValueError(f"keys.yaml: entry {v1}: unknown fields {sorted(entry)}")
        return rule


@attrs.frozen(kw_only=True)
class Section:
    title: str
    keys: tuple[KeyRule, ...]


@attrs.frozen(kw_only=True)
class Profile:
    """What a v1 train-service backend becomes."""

    v1_backends: tuple[str, ...]
    kind: str
    """``workers`` (self-hosted FSDP workers) or ``service`` (a training API)."""
    about: str
    backend: dict[str, Any]
    """The converted recipe's ``backend`` section, before the recipe's own values."""
    holder_section: str | None = None
    """The v1 section with the service's URL, key and LoRA rank (``service.<name>_service``)."""
    hosted_url: str | None = None
    """The URL v1's SDK used when the recipe gave none (NexRL would start a local service)."""
    api_key_env: str | None = None
    """The variable v1's SDK read the key from when the recipe gave none."""
    agg_mode: str | None = None
    """How the service reduces the loss over tokens."""
    unsent: dict[str, Any] = attrs.field(factory=dict)
    """v1 keys v1 accepted and never sent to this service -> the value the service used."""
    no_teacher: str | None = None
    """Why the converted backend holds no distillation teacher (``teacher.model``), and,
    after ``; instead: ``, what to do; None where it holds one."""


@attrs.frozen(kw_only=True)
class KeyTable:
    profiles: tuple[Profile, ...]
    sections: tuple[Section, ...]

    @property
    def rules(self) -> tuple[KeyRule, ...]:
        return tuple(rule for section in self.sections for rule in section.keys)

    def find(self, key: str) -> KeyRule | None:
        """The row for the canonical ``key``: an exact row first, else the subtree row holding it."""
        exact = [rule for rule in self.rules if not rule.is_subtree and rule.matches(key)]
        if exact:
            return exact[0]
        return next((rule for rule in self.rules if rule.matches(key)), None)

    def row(self, v1: str) -> KeyRule:
        """The row written ``v1``; a `KeyError` for none (a rule naming a key the table lacks is a bug)."""
        for rule in self.rules:
            if rule.v1 == v1:
                return rule
        raise KeyError(f"keys.yaml has no row {v1}")

    def profile_for(self, v1_backend: str) -> Profile | None:
        return next((profile for profile in self.profiles if v1_backend in profile.v1_backends), None)


@cache
def key_table() -> KeyTable:
    """The table shipped with NexRL, read once."""
    data = yaml.safe_load(files("nexrl_core.v1").joinpath("keys.yaml").read_text(encoding="utf-8"))
    profiles = tuple(
        Profile(**{**entry, "v1_backends": tuple(entry["v1_backends"]), "unsent": dict(entry.get("unsent") or {})})
        for entry in data["profiles"]
    )
    sections = tuple(
        Section(title=section["title"], keys=tuple(KeyRule.from_data(entry) for entry in section["keys"])) for section in data["sections"]
    )
    table = KeyTable(profiles=profiles, sections=sections)
    seen: set[str] = set()
    for rule in table.rules:
        if rule.v1 in seen:
            raise ValueError(f"keys.yaml: {rule.v1} has two rows")
        seen.add(rule.v1)
    return table
