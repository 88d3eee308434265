"""The recipe's ``teacher`` reaches a backend that can hold one, and is refused by name elsewhere.

A backend says it can hold a teacher with the capability `TEACHER_BACKEND`; the loop
refuses ``teacher.model`` on any other before opening it, so nothing starts and no
teacher is silently dropped.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

import pytest

from nexrl_core.config.components import resolve_options
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.load import load_config
from nexrl_core.plugins.registry import get_registry
from nexrl_core.run.loop import open_backend
from nexrl_core.training.backend import TEACHER_BACKEND

WITHOUT_TEACHER = sorted(name for name, spec in get_registry().specs["backends"].items() if TEACHER_BACKEND not in spec.capabilities)


def _recipe(backend: str, *overrides: str):
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(path, [f"backend.name={backend}", "backend.options={}", *overrides])


@pytest.mark.parametrize("backend", WITHOUT_TEACHER)
def test_a_teacher_is_refused_on_a_backend_that_cannot_hold_one(backend: str, tmp_path: Path) -> None:
    config = _recipe(backend, "teacher.model=nexrl-tiny", "algorithm.advantage.name=on_policy_distillation")
    with pytest.raises(ConfigError, match=f"teacher.model: backend {backend!r} cannot hold a teacher model"):
        open_backend(config, resolve_options("backends", config.backend, "backend"), tmp_path)
    assert not (tmp_path / "backend").exists(), "the refusal comes before the backend gets a directory"


def test_the_backends_shipped_with_nexrl_say_which_hold_a_teacher() -> None:
    """``remote_api`` holds one through its holder, which refuses it when it cannot
    (`nexrl_core.training.holder_backend.HolderBackend`)."""
    assert not {"inprocess", "remote_api"} & set(WITHOUT_TEACHER)
    assert "self-hosted" in WITHOUT_TEACHER


def test_the_teacher_section_is_checked_when_the_recipe_loads() -> None:
    assert _recipe("inprocess").teacher.model is None
    assert _recipe("inprocess", "teacher.model=runs/teacher/final_model").teacher.model == "runs/teacher/final_model"
    with pytest.raises(ConfigError, match="teacher.model"):
        _recipe("inprocess", "teacher.model=''")
    with pytest.raises(ConfigError, match="teacher.world_size"):
        _recipe("inprocess", "teacher.world_size=8")
