"""Which recipe keys each test really sets, recorded while the tests run.

The recipe-key walk (``tests/test_recipe_keys.py``) names, for every key a recipe can
set, the tests that show the key's effect or its refusal. A test's name proves nothing;
these records prove that the named test ran with the key set to something other than
its default.

Recording is on while ``NEXRL_RECIPE_KEY_RECORDS`` names a directory. Every process
then appends JSON lines to ``<dir>/<pid>.jsonl``: the pytest process itself, and every
Python process a test starts (``nexrl train``, services, worker ranks), which run the
``sitecustomize`` in `STARTUP_DIR` because the pytest plugin puts that folder on
``PYTHONPATH``. What any of them records goes to what the session runs at that moment,
named in the file ``NEXRL_RECIPE_KEY_NOW`` points to: the test, or the shared fixture
being set up, so that a service a module's tests share records each request for the
test that sent it. A test also sets what the shared fixtures it uses set.

A key is set when a record that carries it to the code is built or structured with a
value other than its default, in any of those processes: the recipe (`TrainConfig`) or
one of its sections (``LoraSettings``, ``KLSettings``, ``AdamWSettings``, ...), the
options object of a registered component (``GrpoConfig(eps=0.5)``), the step a trainer
sends a service holder (`nexrl_core.training.holders.TrainStepConfig`: the loss, its options and
AdamW) and a holder's config (its `nexrl_core.training.holders.HolderTarget` carries the recipe's
``model`` and ``seed``). Data structured into one of them counts before it is checked,
so a test of a refusal sets the key it gets refused. Building a component's options
also sets its choice's ``name`` when the component is not the default one. Keys are
named as the walk names them: ``rollout.top_p``, a component's option as
``algorithm.loss.options.clip_low [ppo]``.

Only what is built while a test (or a shared fixture it uses) runs counts: a module-level
constant is built while pytest collects, for no test.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

RECORDS_ENV = "NEXRL_RECIPE_KEY_RECORDS"
"""Directory the records go to; recording is off while it is unset."""
NOW_ENV = "NEXRL_RECIPE_KEY_NOW"
"""A file naming what the pytest session that started this process runs now: a test
(``/abs/path.py::name[params]``) or a shared fixture being set up (see `fixture_id`)."""
SUITES_ENDED_ENV = "NEXRL_SUITES_ENDED"
"""A file ``make test`` creates once its suites have ended, given to a reader that runs
beside them (the mutation list): it waits for that file before it reads how they went."""
HOLDER_OPTIONS = "backend.options.holder"
"""Where the ``remote_api`` backend takes the chosen service holder's own options."""
STARTUP_DIR = Path(__file__).with_name("key_record_startup")
"""Holds the ``sitecustomize`` that turns recording on in the processes a test starts."""
INSTRUMENTED_MODULES = (
    "nexrl_core.config.converter",
    "nexrl_core.config.schema",
    "nexrl_core.training.holders",
    "nexrl_core.plugins.registry",
)
"""Modules `instrument` hooks into, each once it has been imported."""

_NO_DEFAULT = object()


# --- naming keys ----------------------------------------------------------------------------------


def option_prefixes() -> dict[str, str]:
    """Registry kind → where a recipe gives the options of the component it picks, derived
    from `TrainConfig` (``policy_losses`` → ``algorithm.loss.options``, and for a list of
    components ``metrics_sinks`` → ``output.sinks.options``), plus the service holders
    (whose options sit under `HOLDER_OPTIONS`)."""
    from nexrl_core.config.components import component_choices, component_lists
    from nexrl_core.config.schema import TrainConfig

    prefixes = {kind: f"{path}.options" for path, kind, _ in component_choices(TrainConfig())}
    prefixes.update({kind: f"{path}.options" for path, kind, _ in component_lists(TrainConfig())})
    return {**prefixes, "service_holders": HOLDER_OPTIONS}


def _default(field: attrs.Attribute) -> Any:
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]  # attrs' stub declares Factory a function (so that `x: list = Factory(list)` checks); it is a class
        return _NO_DEFAULT if default.takes_self else default.factory()
    return _NO_DEFAULT if default is attrs.NOTHING else default


def _nested(field: attrs.Attribute) -> bool:
    """Whether the walk names this field's leaves rather than the field itself."""
    return isinstance(field.type, type) and attrs.has(field.type)


def _choice_field(field: attrs.Attribute) -> bool:
    from nexrl_core.config.schema import REGISTRY_KIND

    return REGISTRY_KIND in field.metadata


def _plain(value: Any) -> Any:
    """A value as YAML data, so an object's default compares with what a recipe gave."""
    from nexrl_core.config.converter import dump_config

    plain = dump_config(value)
    return list(plain) if isinstance(plain, tuple) else plain


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def section_paths() -> dict[type, str]:
    """Each attrs class that is one section of `TrainConfig` → its path (``LoraSettings`` →
    ``model.lora``), with the attrs bases a section is made of (``AdamWSettings`` →
    ``algorithm``). A class found at two paths names no section."""
    from nexrl_core.config.schema import TrainConfig

    found: dict[type, set[str]] = {}

    def visit(cls: type, path: str) -> None:
        for base in cls.__mro__:
            if attrs.has(base):
                found.setdefault(base, set()).add(path)
        for field in attrs.fields(attrs.resolve_types(cls)):
            if _nested(field) and not _choice_field(field):
                visit(field.type, _join(path, field.name))

    visit(TrainConfig, "")
    return {cls: next(iter(paths)) for cls, paths in found.items() if len(paths) == 1}


def object_keys(config: Any, prefix: str = "") -> Iterator[str]:
    """Leaves of the attrs object ``config`` that differ from their defaults. A component
    choice gives its ``name``; its options count once they are structured."""
    for field in attrs.fields(attrs.resolve_types(type(config))):
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
        elif _nested(field) and attrs.has(type(value)):
            yield from object_keys(value, path)
        elif default is _NO_DEFAULT or _plain(value) != _plain(default):
            yield path


@attrs.frozen
class _Component:
    prefix: str
    name: str
    chosen: str | None
    """``<path>.name`` when building this component's options means a recipe chose it
    instead of the default; None for the default, and for a service holder."""
    target_fields: frozenset[str]
    """Fields of a holder's `HolderTarget`: the recipe's ``model`` and ``seed`` keep their
    own names; ``base_url`` and ``api_key`` come from backend options named elsewhere."""


def _component_keys(leaves: Iterable[str], components: Iterable[_Component]) -> list[str]:
    keys = []
    for component in components:
        keys += [component.chosen] if component.chosen else []
        for leaf in leaves:
            top = leaf.split(".")[0]
            if top in ("model", "seed") and top in component.target_fields:
                keys.append(leaf)
            elif top not in component.target_fields:
                keys.append(f"{component.prefix}.{leaf} [{component.name}]")
    return keys


class KeyNaming:
    """Names the keys a record sets, per record class, from one registry."""

    def __init__(self, registry: Any) -> None:
        from nexrl_core.config.components import component_choices
        from nexrl_core.config.schema import TrainConfig
        from nexrl_core.training.holders import HolderTarget

        self.registry = registry
        self.sections = section_paths()
        self.components: dict[type, list[_Component]] = {}
        target = frozenset(field.name for field in attrs.fields(HolderTarget))
        defaults = {f"{path}.options": choice.name for path, _, choice in component_choices(TrainConfig())}
        self.default_loss = defaults["algorithm.loss.options"]
        for kind, prefix in option_prefixes().items() if registry is not None else ():
            for name, spec in registry.specs[kind].items():
                taken = target if isinstance(spec.config_class, type) and issubclass(spec.config_class, HolderTarget) else frozenset()
                chosen = f"{prefix.removesuffix('.options')}.name" if prefix in defaults and name != defaults[prefix] else None
                self.components.setdefault(spec.config_class, []).append(_Component(prefix, name, chosen, taken))

    def built(self, config: Any) -> list[str]:
        from nexrl_core.training.holders import TrainStepConfig

        cls = type(config)
        if cls in self.sections:
            return list(object_keys(config, self.sections[cls]))
        if cls is TrainStepConfig:
            return self._train_step(config)
        return _component_keys(list(object_keys(config)), self.components.get(cls, ()))

    def structured(self, raw: Any, cls: type) -> list[str]:
        if cls in self.sections:
            return list(data_keys(raw, cls, self.sections[cls]))
        if cls in self.components:
            return _component_keys(list(data_keys(raw, cls)), self.components[cls])
        return []

    def _train_step(self, step: Any) -> list[str]:
        keys = list(object_keys(step.optimizer, self.sections[type(step.optimizer)]))
        if step.loss_fn != self.default_loss:
            keys.append("algorithm.loss.name")
        spec = self.registry.specs["policy_losses"].get(step.loss_fn) if self.registry is not None else None
        fields = {field.name: field for field in attrs.fields(spec.config_class)} if spec is not None else {}
        for option, value in step.loss_fn_config.items():
            default = _default(fields[option]) if option in fields else _NO_DEFAULT
            if default is _NO_DEFAULT or _plain(value) != _plain(default):
                keys.append(f"algorithm.loss.options.{option} [{step.loss_fn}]")
        return keys


# --- recording ------------------------------------------------------------------------------------


class _Recorder:
    """Appends each new (test, key) of this process to the records directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.RLock()
        self._naming: KeyNaming | None = None
        self._busy = threading.local()
        """Set while this thread records: what naming builds (a default `TrainConfig`) is not recorded."""

    def write(self, entry: Mapping[str, Any]) -> None:
        with open(self.directory / f"{os.getpid()}.jsonl", "a", encoding="utf-8") as records:
            records.write(json.dumps(entry) + "\n")

    def naming(self) -> KeyNaming:
        """The naming of the registry built last in this process (none is built here)."""
        registry = getattr(sys.modules.get("nexrl_core.plugins.registry"), "_default", None)
        if self._naming is None or (registry is not None and self._naming.registry is not registry):
            self._naming = KeyNaming(registry)
        return self._naming

    def note(self, keys: Callable[[KeyNaming], list[str]]) -> None:
        """Record ``keys(naming)`` for the current test; never lets an error reach the code
        under test."""
        test = running_now()
        if test is None or getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            with self._lock:
                new = sorted({key for key in keys(self.naming()) if (test, key) not in self._seen})
                self._seen |= {(test, key) for key in new}
                if new:
                    self.write({"test": test, "keys": new})
        except Exception as error:  # noqa: BLE001 - recording never changes what the code under test sees
            self.write({"test": test, "error": f"{type(error).__name__}: {error}"})
        finally:
            self._busy.on = False


class _RecordingConverter:
    """Stands in for the config converter where `structure_config` reaches it, noting what
    each record's data sets before structuring it."""

    def __init__(self, converter: Any, recorder: _Recorder) -> None:
        self._converter = converter
        self._recorder = recorder

    def structure(self, raw: Any, cls: Any) -> Any:
        if isinstance(cls, type):
            self._recorder.note(lambda naming: naming.structured(raw, cls))
        return self._converter.structure(raw, cls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._converter, name)


_recorder: _Recorder | None = None


def _record_constructions(classes: Iterable[type[Any]]) -> None:
    """Record the keys every object of ``classes`` sets when it is built: each class's
    ``__init__`` is replaced (``type[Any]``: mypy refuses to set ``__init__`` on a plain ``type``)."""
    for cls in classes:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_nexrl_records_keys", False):
            continue

        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            if _recorder is not None:
                _recorder.note(lambda naming: naming.built(self))

        init._nexrl_records_keys = True  # type: ignore[attr-defined]
        cls.__init__ = init


def instrument(module: Any) -> None:
    """Hook recording into one of `INSTRUMENTED_MODULES`, once it has been imported."""
    if _recorder is None:
        return
    try:
        _instrument(module)
    except Exception as error:  # noqa: BLE001 - recording never breaks an import
        _recorder.write({"test": running_now() or "(no test)", "error": f"instrumenting {module.__name__}: {error!r}"})


def _instrument(module: Any) -> None:
    assert _recorder is not None
    name = module.__name__
    if name == "nexrl_core.config.converter" and not isinstance(module.converter, _RecordingConverter):
        module.converter = _RecordingConverter(module.converter, _recorder)
    elif name == "nexrl_core.config.schema":
        _record_constructions(section_paths())
    elif name == "nexrl_core.training.holders":
        _record_constructions([module.TrainStepConfig])
    elif name == "nexrl_core.plugins.registry" and not getattr(module.build_registry, "_nexrl_records_keys", False):
        build = module.build_registry

        def build_registry(*args: Any, **kwargs: Any) -> Any:
            registry = build(*args, **kwargs)
            _record_constructions(
                spec.config_class for specs in registry.specs.values() for spec in specs.values() if attrs.has(spec.config_class)
            )
            return registry

        build_registry._nexrl_records_keys = True  # type: ignore[attr-defined]
        module.build_registry = build_registry
        if module._default is not None:
            _record_constructions(
                spec.config_class for specs in module._default.specs.values() for spec in specs.values() if attrs.has(spec.config_class)
            )


def start_recording(directory: str | os.PathLike[str]) -> None:
    """Record into ``directory`` from now on, in this process (idempotent); hooks into the
    `INSTRUMENTED_MODULES` already imported (the rest call `instrument` when they are)."""
    global _recorder
    if _recorder is None:
        _recorder = _Recorder(Path(directory))
    for name in INSTRUMENTED_MODULES:
        module = sys.modules.get(name)
        if module is not None and not getattr(module.__spec__, "_initializing", False):
            instrument(module)


def running_now() -> str | None:
    """The test or shared fixture this process records for now, if any."""
    now = os.environ.get(NOW_ENV)
    try:
        return Path(now).read_text(encoding="utf-8") or None if now else None
    except OSError:
        return None


def set_running_now(what: str | None) -> None:
    """Name what the session runs now (the pytest process only)."""
    now = Path(os.environ[NOW_ENV])
    part = now.with_name(f"{now.name}.part")
    part.write_text(what or "", encoding="utf-8")
    os.replace(part, now)


def record_test(test: str, event: str, uses: Iterable[str] = ()) -> None:
    """Note that ``test`` ran (``"ran"``, with the shared fixtures it ``uses``), was
    skipped (``"skipped"``), passed its call (``"passed"``) or failed a phase (``"failed"``)
    in this process."""
    if _recorder is not None:
        _recorder.write({"test": test, "event": event, "uses": sorted(uses)})


def fixture_id(scope_node_id: str, name: str) -> str:
    """What a shared fixture records under: its name and the node it is shared by."""
    return f"fixture {name} of {scope_node_id or 'the session'}"


# --- reading --------------------------------------------------------------------------------------


@attrs.frozen
class TestRecord:
    """What one test (every parametrisation together) did to the recipe keys."""

    __test__ = False  # not a pytest class

    keys: frozenset[str] = frozenset()
    ran: bool = False
    skipped: bool = False
    """Every run of it was skipped."""
    passed: bool = False
    """It passed or was skipped, every run of it: what pytest's exit status 0 says."""
    errors: frozenset[str] = frozenset()
    """Why recording failed while it ran, if it did (a bug of the recorder)."""


def wait_for_the_suites(poll_s: float = 1.0) -> None:
    """Return once the suites running beside this one have ended (`SUITES_ENDED_ENV`);
    at once where nothing runs beside it."""
    ended = os.environ.get(SUITES_ENDED_ENV)
    while ended and not Path(ended).exists():
        time.sleep(poll_s)


def read_records(directory: Path) -> dict[str, TestRecord]:
    """Records by test id (``/abs/path.py::name[params]``); a test's keys include those of
    the shared fixtures it used."""
    keys: dict[str, set[str]] = {}
    events: dict[str, set[str]] = {}
    uses: dict[str, set[str]] = {}
    errors: dict[str, set[str]] = {}
    for file in sorted(directory.glob("*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line) if line.strip() else {}
            if "test" not in entry:
                continue
            keys.setdefault(entry["test"], set()).update(entry.get("keys", ()))
            uses.setdefault(entry["test"], set()).update(entry.get("uses", ()))
            errors.setdefault(entry["test"], set()).update([entry["error"]] if "error" in entry else [])
            if "event" in entry:
                events.setdefault(entry["test"], set()).add(entry["event"])
    return {
        test: TestRecord(
            keys=frozenset(keys[test].union(*(keys.get(fixture, ()) for fixture in uses[test]))),
            ran="ran" in seen,
            skipped=seen == {"ran", "skipped"},
            passed="ran" in seen and "failed" not in seen and bool(seen & {"passed", "skipped"}),
            errors=frozenset(errors[test].union(*(errors.get(fixture, ()) for fixture in uses[test]))),
        )
        for test, seen in events.items()
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
        passed=all(record.passed for record in matching if record.ran),
        errors=frozenset().union(*(record.errors for record in matching)),
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
