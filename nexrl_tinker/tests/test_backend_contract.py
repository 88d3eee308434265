"""The ``remote_api`` backend on the embedded local Tinker service (the quickstart's
backend) passes the BackendContract: real SDK, real service process, real checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path

import pytest

from nexrl_core.config import load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.run.loop import open_backend
from nexrl_core.testing import BackendContract
from nexrl_core.training.backend import Backend


@pytest.fixture(scope="module")
def quickstart_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    out_dir: Path = tmp_path_factory.mktemp("quickstart")
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        recipe = load_config(path, [f"output.dir={out_dir}"])
    assert recipe.backend.name == "remote_api"
    backend = open_backend(recipe, resolve_options("backends", recipe.backend, "backend"), out_dir)
    try:
        yield backend
    finally:
        backend.close()


class TestRemoteApiBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, quickstart_backend: Backend) -> Backend:
        return quickstart_backend
