"""The Weaver service samples from no model but the one it trains: a recipe's teacher on it
is refused before it starts, naming the recipe's key, and so is ``--sampling-model``."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_core.config import ConfigError, load_config
from nexrl_core.http.serving import ServeOptions, ServiceStartError
from nexrl_core.run.loop import run_training
from nexrl_weaver.server.service import WeaverService

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_weaver.yaml"
REASON = "the Local Weaver service samples and scores with no model but the one it trains, so it holds no teacher"


def test_a_teacher_on_the_embedded_weaver_service_is_refused_naming_the_key(tmp_path: Path) -> None:
    config = load_config(
        RECIPE, [f"output.dir={tmp_path / 'run'}", "teacher.model=nexrl-tiny", "algorithm.advantage.name=on_policy_distillation"]
    )
    with pytest.raises(ConfigError) as refused:
        run_training(config, progress_bar=False)
    assert refused.value.problems == [f"teacher.model: {REASON}"]
    assert not (tmp_path / "run").exists()


def test_nexrl_serve_weaver_refuses_a_sampling_model() -> None:
    with pytest.raises(ServiceStartError, match="--sampling-model: the Local Weaver service samples and scores"):
        WeaverService(ServeOptions(port=0, sampling_models=("nexrl-tiny",)))
