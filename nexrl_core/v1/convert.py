"""Turn a NexRL v1 recipe into a NexRL recipe, saying what could not be carried and why.

A v1 recipe comes in one of three shapes, brought here to one (`Shape`):

- ``design``: the design documents' ``trainer.train_service`` (backend, url, world_size,
  ...), with the workers' settings in a separate training-config file named by
  ``training_config_path`` (its ``actor`` section);
- ``v1``: ``service.train_service`` with those keys directly, resources under ``resource``;
- ``v1.4``: ``service.train_service.<name>`` per model, each with ``role``, ``backend``,
  ``resource`` and ``actor`` (workers) or ``config`` (a training API); the one of
  ``role: teacher`` (on-policy distillation's teacher) is written ``teacher_service.*``.

Every key then goes through the table (`nexrl_core.v1.table`): a key the table lacks
stops the conversion with the key named, before anything is written. Each key the
recipe sets ends in exactly one of three lists, **carried** (to which NexRL key, with
which value), **dropped** (it means nothing here) or **not supported** (it changes
training in a way NexRL cannot), and where v1 did something other than its recipe said
(a KL controller where v1 never read it, a setting v1 never sent to the service), a
**choose** line says so: the converted recipe holds what the recipe said, the line what
v1 actually did. Where the recipe leaves out a key that changes training, v1's default
is written, so nothing falls back on a NexRL default that differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from nexrl_core.v1.compose import V1RecipeError, read_v1_recipe
from nexrl_core.v1.table import ABSENT, Fate, KeyRule, KeyTable, Profile, key_table

__all__ = ["Carried", "Conversion", "Converter", "Note", "V1RecipeError", "convert_v1_recipe", "show"]

TRAIN_SERVICE = "train_service"
TEACHER_SERVICE = "teacher_service"
"""Where v1.4's train service of ``role: teacher`` sits in the table's one shape."""


@attrs.frozen
class Carried:
    """A v1 key (or v1's default for it) and the NexRL keys it set."""

    v1: str
    """The key as the recipe wrote it (or would have)."""
    key: str
    """The key in the table's one shape (``train_service.*``)."""
    assignments: dict[str, Any]
    from_default: bool = False
    """The recipe left the key out: these are v1's values for it."""
    note: str = ""

    def line(self) -> str:
        values = ", ".join(f"{key} = {show(value)}" for key, value in self.assignments.items())
        source = f"{self.v1} (v1 default)" if self.from_default else self.v1
        return f"{source} -> {values}" + (f"  [{self.note}]" if self.note else "")


@attrs.frozen
class Note:
    """A v1 key and what is said about it."""

    v1: str
    text: str

    def line(self) -> str:
        return f"{self.v1}: {self.text}"


@attrs.frozen
class Conversion:
    """What `convert_v1_recipe` made of one v1 recipe."""

    shape: str
    recipe: dict[str, Any]
    """The NexRL recipe, as YAML data."""
    carried: tuple[Carried, ...]
    dropped: tuple[Note, ...]
    unsupported: tuple[Note, ...]
    choose: tuple[Note, ...]
    """Where v1 trained otherwise than its recipe said: the recipe's meaning is written."""

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.recipe, sort_keys=False)


def show(value: Any) -> str:
    """``value`` as it would be written in a recipe (``0.001``, ``[prompt]``, ``null``), on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip().removesuffix("...").strip()


# --- shapes --------------------------------------------------------------------------------


@attrs.frozen
class Shape:
    """How a recipe spells the train service's keys."""

    name: str
    prefix: str
    """The written prefix of canonical ``train_service.`` keys."""
    actor_prefix: str | None = None
    """The written prefix of ``train_service.actor.`` keys when they live in another file."""
    teacher_prefix: str | None = None
    """The written prefix of ``teacher_service.`` keys (v1.4's service of role teacher)."""

    def written(self, key: str) -> str:
        """The key as this shape writes the canonical ``key``."""
        if self.actor_prefix is not None and key.startswith(f"{TRAIN_SERVICE}.actor."):
            return self.actor_prefix + key.removeprefix(f"{TRAIN_SERVICE}.actor.")
        if self.teacher_prefix is not None and key.startswith(f"{TEACHER_SERVICE}."):
            return self.teacher_prefix + key.removeprefix(f"{TEACHER_SERVICE}.")
        if key.startswith(f"{TRAIN_SERVICE}."):
            return self.prefix + key.removeprefix(f"{TRAIN_SERVICE}.")
        return key


@attrs.frozen
class Leaf:
    written: str
    value: Any


def _flatten(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _flatten(value, f"{path}.{key}" if path else str(key))
    else:
        yield path, node


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@attrs.frozen
class Shaped:
    """A recipe in the table's one shape."""

    shape: Shape
    keys: dict[str, Any]
    """The recipe with the actor's train service under ``train_service`` (and a teacher's under ``teacher_service``)."""
    worker_file: dict[str, Any] = attrs.field(factory=dict)
    """The design documents' worker training-config file, by its path as the recipe names it."""
    others: list[Note] = attrs.field(factory=list)
    """A not-supported line per train service beside the actor's."""


def _shape(raw: dict[str, Any], recipe: Path) -> Shaped:
    """The recipe brought to the table's one shape."""
    design, service = _get(raw, "trainer.train_service"), _get(raw, "service.train_service")
    if isinstance(design, dict) and isinstance(service, dict):
        raise V1RecipeError("the recipe has both trainer.train_service and service.train_service; keep the one v1 read")
    if isinstance(design, dict):
        body = {**raw, "trainer": {key: value for key, value in raw["trainer"].items() if key != TRAIN_SERVICE}, TRAIN_SERVICE: design}
        config_path = design.get("training_config_path")
        if not config_path:
            return Shaped(Shape("design", "trainer.train_service."), body)
        file = Path(str(config_path))
        worker = read_v1_recipe(file if file.is_absolute() else recipe.parent / file)
        return Shaped(Shape("design", "trainer.train_service.", actor_prefix=f"{config_path}:actor."), body, {str(config_path): worker})
    if not isinstance(service, dict):
        raise V1RecipeError("not a v1 recipe: it has neither trainer.train_service nor service.train_service")
    body = {**raw, "service": {key: value for key, value in raw["service"].items() if key != TRAIN_SERVICE}}
    nested = {name: entry for name, entry in service.items() if isinstance(entry, dict) and ("role" in entry or "backend" in entry)}
    if "backend" in service or not nested:
        return Shaped(Shape("v1", "service.train_service."), {**body, TRAIN_SERVICE: service})
    named = _get(raw, "service.actor_train_service")
    actors = [named] if named else [name for name, entry in nested.items() if entry.get("role", "actor") == "actor"]
    if len(actors) != 1 or actors[0] not in nested:
        raise V1RecipeError(f"service.train_service: cannot tell which service is the actor (role actor: {actors or 'none'})")
    (actor,) = actors
    teachers = [name for name, entry in nested.items() if name != actor and entry.get("role") == "teacher"]
    teacher = teachers[0] if teachers else None
    others = [_beside_the_actor(name, entry, teacher) for name, entry in service.items() if name not in (actor, teacher)]
    keys = {**body, TRAIN_SERVICE: service[actor]} | ({TEACHER_SERVICE: service[teacher]} if teacher else {})
    shape = Shape("v1.4", f"service.train_service.{actor}.", teacher_prefix=f"service.train_service.{teacher}." if teacher else None)
    return Shaped(shape, keys, others=others)


def _beside_the_actor(name: str, entry: Any, teacher: str | None) -> Note:
    """The not-supported line for a v1.4 train service that is neither the actor nor the teacher."""
    role = entry.get("role", "?") if isinstance(entry, dict) else "?"
    if role == "teacher":
        why = f"a second teacher beside {teacher}; NexRL distils from one teacher; instead: keep the one to distil from"
    else:
        why = f"a second model (role {role}) beside the actor, which NexRL does not train in the same run; instead: train it in a run of its own"
    return Note(f"service.train_service.{name}", why)


def _leaves(shaped: Shaped, table: KeyTable) -> dict[str, Leaf]:
    """Every value the recipe sets, by its key in the table's shape."""
    leaves: dict[str, Leaf] = {}
    section_prefixes = {rule.v1.rsplit(".", 1)[0] for rule in table.rules}
    for key, value in _flatten(shaped.keys, ""):
        if value in (None, {}) and any(prefix == key or prefix.startswith(key + ".") for prefix in section_prefixes):
            continue  # a section left null or empty (`service: null` in a common file): nothing set
        leaves[key] = Leaf(shaped.shape.written(key), value)
    for file, worker in shaped.worker_file.items():
        for key, value in _flatten(worker, ""):
            leaves[f"{TRAIN_SERVICE}.{key}"] = Leaf(f"{file}:{key}", value)
    return leaves


# --- the conversion ----------------------------------------------------------------------


def _set_path(recipe: dict[str, Any], dotted: str, value: Any) -> None:
    node = recipe
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


class Converter:
    """The state of one conversion; `nexrl_core.v1.rules` reads and records through it."""

    def __init__(
        self, table: KeyTable, shape: Shape, leaves: dict[str, Leaf], profile: Profile, recipe_path: Path, agent: str | None
    ) -> None:
        self.table = table
        self.shape = shape
        self.leaves = leaves
        self.profile = profile
        self.kind = profile.kind
        self.recipe_path = recipe_path
        self.agent = agent
        """``--agent``: the NexRL agent that replaces v1's rollout worker, if given."""
        self.recipe: dict[str, Any] = {}
        self.written: dict[str, tuple[str, Any]] = {}
        """NexRL key -> (the v1 key that wrote it, the value)."""
        self.carried: list[Carried] = []
        self.dropped: list[Note] = []
        self.unsupported: list[Note] = []
        self.choose: list[Note] = []
        self.reported: set[str] = set()

    # --- reading --------------------------------------------------------------------------

    def row(self, v1: str) -> KeyRule:
        return self.table.row(v1)

    def applies(self, row: KeyRule) -> bool:
        """Whether ``row`` means something in this run (its kind, and its service's section)."""
        if row.kinds and self.kind not in row.kinds:
            return False
        sections = {profile.holder_section for profile in self.table.profiles if profile.holder_section}
        own = self.profile.holder_section
        return not any(row.v1.startswith(section + ".") for section in sections if section != own)

    def present(self, v1: str) -> bool:
        """Whether the recipe sets ``v1`` where it means something (see `applies`)."""
        return v1 in self.leaves and self.applies(self.row(v1))

    def value(self, v1: str) -> Any:
        """The recipe's value, else v1's default where the key applies, else `ABSENT`."""
        row = self.row(v1)
        if not self.applies(row):
            return ABSENT
        if v1 in self.leaves:
            return self.leaves[v1].value
        return row.v1_default

    def output(self, new: str) -> Any:
        """What the converted recipe holds at ``new`` so far, or `ABSENT`."""
        return self.written[new][1] if new in self.written else ABSENT

    def name(self, v1: str) -> str:
        """The key as the recipe wrote it (or would have)."""
        return self.leaves[v1].written if v1 in self.leaves else self.shape.written(v1)

    # --- recording ------------------------------------------------------------------------

    def carry(self, v1: str, assignments: dict[str, Any], note: str = "") -> None:
        """Write ``assignments`` for ``v1``; each key must be one the table lists for ``v1``."""
        row = self.row(v1)
        if not self.applies(row):
            return
        stray = sorted(set(assignments) - set(row.new))
        if stray:
            raise AssertionError(f"keys.yaml lists {list(row.new)} for {v1}, and the conversion wrote {stray}")
        for new, value in assignments.items():
            if new in self.written and self.written[new][1] != value:
                earlier, earlier_value = self.written[new]
                self.unsupported.append(
                    Note(self.name(v1), f"sets {new} = {show(value)} where {earlier} set {show(earlier_value)}; instead: keep one of them")
                )
                continue
            self.written[new] = (self.name(v1), value)
            _set_path(self.recipe, new, value)
        self.carried.append(Carried(self.name(v1), v1, dict(assignments), from_default=v1 not in self.leaves, note=note))
        self.reported.add(v1)

    def drop(self, v1: str, why: str) -> None:
        """A dropped line for ``v1``, if the recipe sets it and nothing was said of it yet."""
        if v1 in self.leaves and v1 not in self.reported:
            self.dropped.append(Note(self.name(v1), why))
            self.reported.add(v1)

    def also_drop(self, v1: str, text: str) -> None:
        """A dropped line about part of a key carried otherwise (the default in a secret's reference)."""
        self.dropped.append(Note(self.name(v1), text))

    def refuse(self, v1: str, why: str, instead: str) -> None:
        """``v1`` changes training in a way NexRL cannot: a not-supported line (if the recipe sets it)."""
        if v1 in self.leaves and v1 not in self.reported:
            self.unsupported.append(Note(f"{self.name(v1)} = {show(self.leaves[v1].value)}", f"{why}; instead: {instead}"))
            self.reported.add(v1)

    def ask(self, v1: str, text: str) -> None:
        """A choose line: v1 trained otherwise than ``v1``'s value says."""
        self.choose.append(Note(self.name(v1), text))

    def elsewhere(self, row: KeyRule) -> str:
        if row.kinds and self.kind not in row.kinds:
            runs = " or ".join(profile.about for profile in self.table.profiles if profile.kind in row.kinds)
            return f"v1 read it only when training on {runs}"
        return "v1 read it only when training on the service whose section it is in"


def _profile(table: KeyTable, leaves: dict[str, Leaf]) -> Profile:
    leaf = leaves.get(f"{TRAIN_SERVICE}.backend")
    if leaf is None:
        raise V1RecipeError("the recipe's train service names no backend (train_service.backend)")
    profile = table.profile_for(str(leaf.value))
    if profile is None:
        known = ", ".join(name for profile in table.profiles for name in profile.v1_backends)
        raise V1RecipeError(f"{leaf.written} = {leaf.value!r}: not a backend NexRL trains on (v1 backends it converts: {known})")
    return profile


def _direct(converter: Converter, row: KeyRule) -> None:
    """A carried row: its value (or v1's default) to its one NexRL key."""
    (new,) = row.new
    unsent = converter.profile.unsent
    if row.v1 in unsent:
        used = unsent[row.v1]
        if converter.present(row.v1):
            value = converter.leaves[row.v1].value
            converter.carry(row.v1, {new: value})
            if value != used:
                converter.ask(
                    row.v1,
                    f"v1 never sent this to {converter.profile.about}, which trained with {show(used)}; written: the recipe's "
                    f"{show(value)}; set {new}: {show(used)} to train as v1 did",
                )
        else:
            converter.carry(row.v1, {new: used}, note=f"what {converter.profile.about} used: v1 never sent it")
        return
    value = converter.value(row.v1)
    if value is ABSENT:
        return
    if row.values is not None:
        if value not in row.values:
            converter.refuse(row.v1, f"v1 value {value!r} has no NexRL counterpart", f"choose {new} yourself")
            return
        value = row.values[value]
    converter.carry(row.v1, {new: value}, note=row.why if converter.present(row.v1) else "")


def convert_v1_recipe(path: str | Path, *, agent: str | None = None, table: KeyTable | None = None) -> Conversion:
    """Convert the v1 recipe at ``path``.

    :param agent: ``module:function`` of the NexRL agent that replaces v1's rollout worker.
    :raises V1RecipeError: for a recipe that cannot be read as v1 read it, keys the table
        does not know (each named), or a train-service backend NexRL cannot train on.
    """
    from nexrl_core.v1.rules import RULES

    table = table or key_table()
    recipe_path = Path(path)
    raw = read_v1_recipe(recipe_path)
    shaped = _shape(raw, recipe_path)
    shape, leaves = shaped.shape, _leaves(shaped, table)
    unknown = [leaf.written for key, leaf in leaves.items() if table.find(key) is None]
    if unknown:
        raise V1RecipeError(
            "\n".join(f"unknown v1 key {key}: not in the key table (docs/coming-from-v1.md lists every key it knows)" for key in unknown)
        )
    profile = _profile(table, leaves)
    converter = Converter(table, shape, leaves, profile, recipe_path, agent)
    converter.unsupported.extend(shaped.others)
    _set_path(converter.recipe, "backend", {})
    rule_names: list[str] = []
    for key in leaves:
        row = table.find(key)
        assert row is not None
        if not converter.applies(row):
            converter.drop(key, converter.elsewhere(row))
        elif row.fate is Fate.DROPPED:
            converter.drop(key, row.why)
        elif row.fate is Fate.UNSUPPORTED:
            value = leaves[key].value
            if value in row.inert:
                converter.drop(key, row.inert_why)
            else:
                converter.refuse(key, row.why, row.instead)
    for row in table.rules:
        if row.fate is Fate.CARRIED and converter.applies(row):
            _direct(converter, row)
        elif row.fate is Fate.RULE and row.rule not in rule_names:
            rule_names.append(row.rule)  # type: ignore[arg-type]
    for name in rule_names:
        RULES[name](converter)
    left = [leaf.written for key, leaf in leaves.items() if key not in converter.reported]
    if left:
        raise AssertionError(f"the conversion reported nothing for {left}")
    return Conversion(
        shape=shape.name,
        recipe=_ordered(converter.recipe),
        carried=tuple(converter.carried),
        dropped=tuple(converter.dropped),
        unsupported=tuple(converter.unsupported),
        choose=tuple(converter.choose),
    )


SECTION_ORDER = ("task", "backend", "model", "algorithm", "rollout", "schedule", "output", "seed")


def _ordered(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe's sections in the order NexRL's own recipes use."""
    return {key: recipe[key] for key in SECTION_ORDER if key in recipe} | {
        key: value for key, value in recipe.items() if key not in SECTION_ORDER
    }
