"""A chosen component's recipe check (``recipe_check`` of its spec) runs before
any component of the run opens: a recipe it finds fault with is refused without the
backend starting anything, and leaves no output behind."""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.config import load_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import BackendSpec, RolloutSourceSpec
from nexrl_core.run.loop import run_training

LIMIT = 4
PROBLEM = f"rollout.max_tokens: the acme source samples at most {LIMIT} tokens a turn; set it to {LIMIT} or fewer"


class RecordingPlugin:
    """A backend and a rollout source that record being opened; the source checks recipes."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    def _open(self, what: str) -> Callable[[Any], Any]:
        def factory(setup: Any) -> Any:
            self.opened.append(what)
            raise AssertionError(f"the {what} was opened for a recipe its check refuses")

        return factory

    @hookimpl
    def nexrl_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="acme.recording", factory=self._open("backend"))]

    @hookimpl
    def nexrl_rollout_sources(self) -> list[RolloutSourceSpec]:
        def check(recipe: Any, options: Any) -> list[str]:
            return [PROBLEM] if recipe.rollout.max_tokens > LIMIT else []

        return [RolloutSourceSpec(name="acme.checked", factory=self._open("rollout source"), recipe_check=check)]


def test_a_recipe_a_component_refuses_stops_before_the_backend_opens(
    tmp_path: Path, register_nexrl_plugin: Callable[[Any, str], Any]
) -> None:
    plugin = RecordingPlugin()
    register_nexrl_plugin(plugin, "acme")
    out_dir = tmp_path / "run"
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        config = load_config(
            path,
            [f"output.dir={out_dir}", "backend.name=acme.recording", "rollout.source.name=acme.checked", f"rollout.max_tokens={LIMIT + 1}"],
        )
    with pytest.raises(ConfigError) as refused:
        run_training(config)
    assert refused.value.problems == [PROBLEM]
    assert plugin.opened == []
    assert not out_dir.exists()
