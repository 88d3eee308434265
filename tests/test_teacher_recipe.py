"""The recipe's ``teacher`` reaches a backend that can hold one, and is refused by name elsewhere.

A backend says it can hold a teacher with the capability `TEACHER_BACKEND`; the loop
refuses ``teacher.model`` on any other before opening it, so nothing starts and no
teacher is silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.config.components import resolve_options
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.load import load_config
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.registry import get_registry
from nexrl_core.plugins.specs import BackendSpec
from nexrl_core.run.loop import open_backend
from nexrl_core.training.backend import TEACHER_BACKEND

SHIPPED = ("inprocess", "remote_api", "self-hosted")


class PlainBackendPlugin:
    """A backend that holds no teacher (no `TEACHER_BACKEND` capability), as a third
    party's may be; opening it would be a bug."""

    @hookimpl
    def nexrl_backends(self) -> list[BackendSpec]:
        def never_opened(setup: Any) -> Any:
            raise AssertionError("a backend that holds no teacher was opened for a recipe with one")

        return [BackendSpec(name="acme.plain", factory=never_opened)]


def _recipe(backend: str, *overrides: str):
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(path, [f"backend.name={backend}", "backend.options={}", *overrides])


def test_a_teacher_is_refused_on_a_backend_that_cannot_hold_one(tmp_path: Path, register_nexrl_plugin: Callable[[Any, str], Any]) -> None:
    register_nexrl_plugin(PlainBackendPlugin(), "acme")
    config = _recipe("acme.plain", "teacher.model=nexrl-tiny", "algorithm.advantage.name=on_policy_distillation")
    with pytest.raises(ConfigError, match="teacher.model: backend 'acme.plain' cannot hold a teacher model"):
        open_backend(config, resolve_options("backends", config.backend, "backend"), tmp_path)
    assert not (tmp_path / "backend").exists(), "the refusal comes before the backend gets a directory"


def test_every_backend_shipped_with_nexrl_holds_a_teacher() -> None:
    """``remote_api`` holds one through its holder, which refuses it when it cannot
    (`nexrl_core.training.holder_backend.HolderBackend`); ``self-hosted`` on a group of
    its own."""
    backends = get_registry().specs["backends"]
    assert [name for name in SHIPPED if TEACHER_BACKEND not in backends[name].capabilities] == []


def test_the_teacher_section_is_checked_when_the_recipe_loads() -> None:
    assert _recipe("inprocess").teacher.model is None
    assert _recipe("inprocess", "teacher.model=runs/teacher/final_model").teacher.model == "runs/teacher/final_model"
    with pytest.raises(ConfigError, match="teacher.model"):
        _recipe("inprocess", "teacher.model=''")
    with pytest.raises(ConfigError, match="teacher.world_size"):
        _recipe("inprocess", "teacher.world_size=8")
