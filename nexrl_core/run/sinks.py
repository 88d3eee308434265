"""Metrics sinks: the trackers a run reports to besides ``metrics.jsonl``.

Plugins register sinks through the ``nexrl_metrics_sinks`` hook and a recipe picks them
in ``output.sinks``; the core itself writes only ``metrics.jsonl``, the reward curve and
the progress display, and names no tracker. Each sink gets every metrics row at its
step, the resolved recipe (`SinkSetup.config`) and, at the end, the final model's path.

A sink that cannot start refuses the run before step 1, with what it needs (a package
to install, a setting to make). A sink that raises later is reported once, turned off,
and the run goes on: a dashboard that goes away must not cost a training run. Each sink
keeps what it needs to continue its tracker's run on ``--resume`` (a run id) in its own
work directory, ``<output.dir>/sinks/<name>``, which ``--overwrite`` removes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from nexrl_core.config.components import ResolvedChoice, component_lists, resolve_choice_list
from nexrl_core.config.converter import dump_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig

logger = logging.getLogger("nexrl.train")

SINKS_DIR = "sinks"
"""Folder of a run's output directory that holds one work directory per sink."""
SINK_KIND = "metrics_sinks"
"""Registry kind of metrics sinks."""


class RunOutcome(str, enum.Enum):
    """How a run ended, as a sink's tracker records it."""

    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    """Ctrl-C or SIGTERM: the last checkpoint is intact and ``--resume`` continues."""


@attrs.frozen(kw_only=True)
class SinkSetup:
    """What a sink's factory gets for one run."""

    recipe: TrainConfig
    options: Any
    """The sink's own options, an instance of its spec's ``config_class``."""
    output_dir: Path
    """The run's ``output.dir``."""
    work_dir: Path
    """``<output.dir>/sinks/<name>``: the sink's own files, kept across ``--resume``."""
    resumed_from: int | None
    """The checkpoint step a resumed run goes on from; None for a fresh run."""

    @property
    def config(self) -> dict[str, Any]:
        """The resolved recipe as plain data: what ``config.yaml`` holds."""
        return dump_config(self.recipe)

    @property
    def run_name(self) -> str:
        """A name for the tracker's run when the sink's options give none: the output
        directory's name (``runs/quickstart`` → ``quickstart``)."""
        return Path(self.recipe.output.dir).resolve().name


class MetricsSink(Protocol):
    """A tracker one run reports to; built by a `MetricsSinkSpec` factory from a `SinkSetup`."""

    def log(self, row: Mapping[str, Any]) -> None:
        """Record one metrics row at ``row["step"]`` (values are numbers or None)."""

    def log_final_model(self, path: Path) -> None:
        """Record where the trained policy was written (a Hugging Face directory)."""

    def close(self, outcome: RunOutcome) -> None:
        """End the tracker's run (also after an error or Ctrl-C); called once."""

    def location(self) -> str | None:
        """One line saying where to look at the run (a command, a URL, a path), or None."""


def resolve_sinks(config: TrainConfig) -> list[ResolvedChoice]:
    """The sinks ``output.sinks`` picks, with their options checked.

    :raises ConfigError: naming each unknown sink and bad option.
    """
    chosen: list[ResolvedChoice] = []
    for path, kind, entries in component_lists(config):
        if kind == SINK_KIND:
            chosen += resolve_choice_list(kind, entries, path)
    return chosen


class RunSinks:
    """The open sinks of one run: each row goes to every sink still working."""

    def __init__(self, opened: list[tuple[str, MetricsSink]]) -> None:
        self._active = dict(opened)
        self._where = {name: _location(sink) for name, sink in opened}
        self.failures: dict[str, str] = {}
        """Sinks turned off during the run, with what they raised."""
        self._last_step: int | None = None

    def _call(self, name: str, what: str, call: Any) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a sink never stops training
            reason = f"{type(error).__name__}: {error}"
            self.failures[name] = f"{what}: {reason}"
            del self._active[name]
            logger.warning("metrics sink %r failed %s and is off for the rest of this run: %s", name, what, reason)

    def log(self, row: Mapping[str, Any]) -> None:
        """Send ``row`` to every working sink; a step already sent (the loop went back to a
        checkpoint after a backend restart) is not sent again."""
        step = int(row["step"])
        if self._last_step is not None and step <= self._last_step:
            return
        self._last_step = step
        for name, sink in list(self._active.items()):
            self._call(name, f"at step {step}", lambda sink=sink: sink.log(row))

    def log_final_model(self, path: Path) -> None:
        for name, sink in list(self._active.items()):
            self._call(name, "recording the final model", lambda sink=sink: sink.log_final_model(path))

    def close(self, outcome: RunOutcome) -> None:
        """Close every working sink, each on its own (one failing does not skip the rest)."""
        for name, sink in list(self._active.items()):
            self._call(name, "while closing", lambda sink=sink: sink.close(outcome))
        self._active.clear()

    def locations(self) -> dict[str, str]:
        """Sink name → where to look at its run; a sink turned off says why instead."""
        shown = {name: f"turned off {self.failures[name]}" for name in self.failures}
        shown.update({name: where for name, where in self._where.items() if where and name not in self.failures})
        return {name: shown[name] for name in self._where if name in shown}


def _location(sink: MetricsSink) -> str | None:
    try:
        return sink.location()
    except Exception:  # noqa: BLE001 - where to look is a courtesy, never a reason to stop
        logger.exception("a metrics sink could not say where its run is")
        return None


def open_sinks(config: TrainConfig, chosen: list[ResolvedChoice], output_dir: Path, resumed_from: int | None) -> RunSinks:
    """Start every chosen sink for this run.

    :raises ConfigError: naming the sink that could not start and why (the sinks started
        before it are closed again).
    """
    from nexrl_core.plugins.registry import find_spec
    from nexrl_core.plugins.specs import MetricsSinkSpec

    opened: list[tuple[str, MetricsSink]] = []
    for choice in chosen:
        spec = find_spec(SINK_KIND, choice.name)
        assert isinstance(spec, MetricsSinkSpec), "the registry holds only MetricsSinkSpec records under this kind"
        work_dir = output_dir / SINKS_DIR / choice.name
        work_dir.mkdir(parents=True, exist_ok=True)
        setup = SinkSetup(recipe=config, options=choice.options, output_dir=output_dir, work_dir=work_dir, resumed_from=resumed_from)
        try:
            opened.append((choice.name, spec.open(setup)))
        except Exception as error:  # noqa: BLE001 - whatever stops a sink, the run must not start
            RunSinks(opened).close(RunOutcome.FAILED)
            raise ConfigError([f"{choice.path}: metrics sink {choice.name!r} could not start: {error}"]) from None
    return RunSinks(opened)
