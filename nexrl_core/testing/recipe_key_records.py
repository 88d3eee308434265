"""Which recipe keys each test really sets, recorded while the tests run.

The recipe-key walk (``tests/test_recipe_keys.py``) names, for every key a recipe can
set, the tests that show the key's effect or its refusal. A test's name proves nothing;
these records prove that the named test ran with the key set to something other than
its default.

Recording is on while ``NEXRL_RECIPE_KEY_RECORDS`` names a directory. Every process
then appends one JSON line per (test, key) to ``<dir>/<pid>.jsonl``: the pytest process
itself, and every Python process a test starts (``nexrl train``, services, worker
ranks), which load `nexrl_core.testing.key_record_startup`'s ``sitecustomize`` because
the pytest plugin puts that folder on ``PYTHONPATH``. The test a process works for is
the one named in ``NEXRL_RECIPE_KEY_TEST``, which the pytest plugin sets around each test
(children inherit it).

What counts as setting a key, named as the walk names it (``rollout.top_p``, a
component's option as ``algorithm.loss.options.clip_low [ppo]``):

- a recipe or a component's options structured from data (`structure_config`): every
  key given a value other than its default, even one then refused, so a test of a
  refusal sets its key;
- a `TrainConfig`, or the config object of a registered component, built in the pytest
  process (``TrainConfig(...)``, ``GrpoConfig(eps=0.5)``, ``attrs.evolve``): each of its
  leaves that differs from the default.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

RECORDS_ENV = "NEXRL_RECIPE_KEY_RECORDS"
"""Directory the records go to; recording is off while it is unset."""
TEST_ENV = "NEXRL_RECIPE_KEY_TEST"
"""The test (``/abs/path.py::name[params]``) the current process works for."""
HOLDER_OPTIONS = "backend.options.holder"
"""Where the ``remote_api`` backend takes the chosen service holder's own options."""
STARTUP_DIR = Path(__file__).with_name("key_record_startup")
"""Holds the ``sitecustomize`` that turns recording on in the processes a test starts."""

_NO_DEFAULT = object()


# --- naming keys ----------------------------------------------------------------------------------


def option_prefixes() -> dict[str, str]:
    """Registry kind → where a recipe gives the options of the component it picks, derived
    from `TrainConfig` (``policy_losses`` → ``algorithm.loss.options``), plus the service
    holders (whose options sit under `HOLDER_OPTIONS`)."""
    from nexrl_core.config.components import component_choices
    from nexrl_core.config.schema import TrainConfig

    prefixes = {kind: f"{path}.options" for path, kind, _ in component_choices(TrainConfig())}
    return {**prefixes, "service_holders": HOLDER_OPTIONS}


def _default(field: attrs.Attribute) -> Any:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return _NO_DEFAULT if default.takes_self else default.factory()
    return _NO_DEFAULT if default is attrs.NOTHING else default


def _nested(field: attrs.Attribute) -> bool:
    """Whether the walk names this field's leaves rather than the field itself."""
    return isinstance(field.type, type) and attrs.has(field.type)


def _plain(value: Any) -> Any:
    """A value as YAML data, so an object's default compares with what a recipe gave."""
    from nexrl_core.config.converter import dump_config

    plain = dump_config(value)
    return list(plain) if isinstance(plain, tuple) else plain


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _choice_field(field: attrs.Attribute) -> bool:
    from nexrl_core.config.schema import REGISTRY_KIND

    return REGISTRY_KIND in field.metadata


def object_keys(config: Any, prefix: str = "") -> Iterator[str]:
    """Leaves of the attrs object ``config`` that differ from their defaults. A component
    choice gives its ``name``; its options are counted when they are structured."""
    cls = attrs.resolve_types(type(config))
    for field in attrs.fields(cls):
        value, default = getattr(config, field.name), _default(field)
        path = _join(prefix, field.name)
        if _choice_field(field):
            if default is _NO_DEFAULT or value.name != default.name:
                yield f"{path}.name"
        elif _nested(field) and attrs.has(type(value)):
            yield from object_keys(value, path)
        elif default is _NO_DEFAULT or value != default:
            yield path


def data_keys(raw: Any, cls: type, prefix: str = "") -> Iterator[str]:
    """Keys of the recipe data ``raw`` for ``cls`` given a value other than the default
    (unknown keys included: a recipe set them, and the run refuses them)."""
    if not isinstance(raw, Mapping):
        return
    fields = {field.name: field for field in attrs.fields(attrs.resolve_types(cls))}
    for name, value in raw.items():
        path = _join(prefix, str(name))
        field = fields.get(name)
        if field is None:
            yield path
            continue
        default = _default(field)
        if _choice_field(field):
            given = value.get("name") if isinstance(value, Mapping) else value
            if default is _NO_DEFAULT or given != default.name:
                yield f"{path}.name"
        elif _nested(field) and isinstance(value, Mapping):
            yield from data_keys(value, field.type, path)
        elif default is _NO_DEFAULT or _plain(value) != _plain(default):
            yield path


# --- recording ------------------------------------------------------------------------------------


class _Recorder:
    """Appends each new (test, key) of this process to the records directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._names: dict[type, list[tuple[str, str]]] | None = None
        self._names_of: Any = None

    def write(self, entry: Mapping[str, Any]) -> None:
        with open(self.directory / f"{os.getpid()}.jsonl", "a", encoding="utf-8") as records:
            records.write(json.dumps(entry) + "\n")

    def keys(self, keys: Iterable[str]) -> None:
        test = os.environ.get(TEST_ENV)
        if test is None:
            return
        with self._lock:
            new = sorted({key for key in keys if (test, key) not in self._seen})
            self._seen |= {(test, key) for key in new}
            if new:
                self.write({"test": test, "keys": new})

    def components(self, cls: type) -> list[tuple[str, str]]:
        """(prefix, name) of every registered component whose config class is ``cls``, by
        the registry already built in this process (none is built here)."""
        registry_module = sys.modules.get("nexrl_core.registry")
        registry = getattr(registry_module, "_default", None)
        if registry is not None and self._names_of is not registry:
            prefixes = option_prefixes()
            self._names = {}
            for kind, prefix in prefixes.items():
                for name, spec in registry.specs[kind].items():
                    self._names.setdefault(spec.config_class, []).append((prefix, name))
            self._names_of = registry
        return (self._names or {}).get(cls, [])

    def structured(self, raw: Any, cls: type) -> None:
        from nexrl_core.config.schema import TrainConfig

        if cls is TrainConfig:
            self.keys(data_keys(raw, cls))
        elif attrs.has(cls):
            self.keys(_named(data_keys(raw, cls), self.components(cls), cls))

    def built(self, config: Any) -> None:
        from nexrl_core.config.schema import TrainConfig

        cls = type(config)
        if cls is TrainConfig:
            self.keys(object_keys(config))
        else:
            self.keys(_named(object_keys(config), self.components(cls), cls))


def _named(leaves: Iterator[str], components: list[tuple[str, str]], cls: type) -> list[str]:
    """Option leaves of ``cls`` as the walk names them, once per component using it."""
    if not components:
        return []
    from nexrl_core.holders import HolderTarget

    target = {field.name for field in attrs.fields(HolderTarget)} if issubclass(cls, HolderTarget) else set()
    leaves = [leaf for leaf in leaves if leaf.split(".")[0] not in target]
    return [f"{prefix}.{leaf} [{name}]" for prefix, name in components for leaf in leaves]


class _RecordingConverter:
    """Stands in for the config converter where `structure_config` reaches it, noting what
    each recipe sets before structuring it."""

    def __init__(self, converter: Any, recorder: _Recorder) -> None:
        self._converter = converter
        self._recorder = recorder

    def structure(self, raw: Any, cls: Any) -> Any:
        try:
            self._recorder.structured(raw, cls)
        except Exception:  # recording never changes what the code under test sees
            pass
        return self._converter.structure(raw, cls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._converter, name)


_recorder: _Recorder | None = None


def start_recording(directory: str | os.PathLike[str]) -> None:
    """Record what every recipe structured in this process sets (idempotent)."""
    global _recorder
    if _recorder is not None:
        return
    converter_module = importlib.import_module("nexrl_core.config.converter")
    _recorder = _Recorder(Path(directory))
    converter_module.converter = _RecordingConverter(converter_module.converter, _recorder)  # type: ignore[assignment]


def record_constructions(classes: Iterable[type]) -> None:
    """Also record the leaves of every object of ``classes`` built directly."""
    if _recorder is None:
        return
    for cls in classes:
        original = cls.__init__
        if getattr(original, "_nexrl_records_keys", False):
            continue

        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            if _recorder is not None:
                try:
                    _recorder.built(self)
                except Exception:  # recording never changes what the code under test sees
                    pass

        init._nexrl_records_keys = True  # type: ignore[attr-defined]
        cls.__init__ = init


def recipe_classes() -> list[type]:
    """`TrainConfig` and the config class of every installed component a recipe configures."""
    from nexrl_core.config.schema import TrainConfig
    from nexrl_core.registry import get_registry

    registry = get_registry()
    classes = {spec.config_class for kind in option_prefixes() for spec in registry.specs[kind].values()}
    return [TrainConfig, *sorted((cls for cls in classes if attrs.has(cls)), key=lambda cls: cls.__qualname__)]


def record_test(test: str, event: str) -> None:
    """Note that ``test`` ran (``"ran"``) or was skipped (``"skipped"``) in this process."""
    if _recorder is not None:
        _recorder.write({"test": test, "event": event})


# --- reading --------------------------------------------------------------------------------------


@attrs.frozen
class TestRecord:
    """What one test (every parametrisation together) did to the recipe keys."""

    __test__ = False  # not a pytest class

    keys: frozenset[str] = frozenset()
    ran: bool = False
    skipped: bool = False
    """Every run of it was skipped."""


def read_records(directory: Path) -> dict[str, TestRecord]:
    """Records by test id (``/abs/path.py::name[params]``)."""
    keys: dict[str, set[str]] = {}
    events: dict[str, set[str]] = {}
    for file in sorted(directory.glob("*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            keys.setdefault(entry["test"], set()).update(entry.get("keys", ()))
            if "event" in entry:
                events.setdefault(entry["test"], set()).add(entry["event"])
    return {
        test: TestRecord(keys=frozenset(keys.get(test, ())), ran="ran" in events.get(test, ()), skipped=events.get(test) == {"ran", "skipped"})
        for test in keys.keys() | events.keys()
    }


def record_of(named: str, root: Path, records: Mapping[str, TestRecord]) -> TestRecord | None:
    """The record of the test named ``path::name`` (path from ``root``; a class names all
    its tests, a function all its parametrisations), or None if it never ran."""
    path, _, name = named.partition("::")
    wanted = f"{(root / path).resolve()}::{name}"
    matching = [record for test, record in records.items() if test == wanted or test.startswith((f"{wanted}[", f"{wanted}::"))]
    if not any(record.ran for record in matching):
        return None
    return TestRecord(
        keys=frozenset().union(*(record.keys for record in matching)),
        ran=True,
        skipped=all(record.skipped for record in matching if record.ran),
    )


# --- running named tests with recording on --------------------------------------------------------


def distribution_dir(test_file: Path) -> Path:
    """The folder a test file's tests run from: the nearest one above it with a
    ``pyproject.toml`` (each distribution's tests run from its own folder)."""
    for folder in test_file.resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml above {test_file}")


def run_recording(named: Iterable[str], root: Path, directory: Path, timeout_s: float = 1800) -> None:
    """Run the tests named ``path::name`` (path from ``root``) with recording into
    ``directory``: one pytest per distribution, each from its own folder. Their outcomes
    do not matter here (their own runs report them); what they set does."""
    import subprocess

    by_dir: dict[Path, list[str]] = {}
    for test in sorted(set(named)):
        path, _, name = test.partition("::")
        folder = distribution_dir(root / path)
        by_dir.setdefault(folder, []).append(f"{(root / path).resolve().relative_to(folder)}::{name}")
    env = {**os.environ, RECORDS_ENV: str(directory)}
    for folder, node_ids in by_dir.items():
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *node_ids],
            cwd=folder, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
        )  # fmt: skip
