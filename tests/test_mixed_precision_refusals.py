"""Where ``model.mixed_precision`` cannot mean anything it is refused, by key: with
``model.dtype: fp32`` when the recipe loads (there is no bfloat16 to mix), and on the
``remote_api`` backend before step 1 (the Tinker and Weaver APIs have no such setting,
and NexRL's services train in the one dtype they were started with)."""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

import pytest

from nexrl_core.config import ConfigError, load_config
from nexrl_core.config.schema import DType, ModelConfig
from nexrl_core.run.loop import run_training
from nexrl_core.training.holders import fixed_precision_refusals


def test_mixed_precision_with_fp32_is_refused_naming_both_keys(tmp_path: Path) -> None:
    """The same one-line problem from an override and from a recipe file; with bf16 it loads."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  name: nexrl-tiny\n  mixed_precision: true\n")
    for path, overrides in ((None, ["model.mixed_precision=true"]), (recipe, [])):
        with pytest.raises(ConfigError) as refused:
            load_config(path, overrides)
        (problem,) = refused.value.problems
        assert problem.startswith("model: mixed_precision: true needs dtype: bf16") and "\n" not in problem
        assert "model.dtype: bf16" in problem and "model.mixed_precision" in problem
    config = load_config(recipe, ["model.dtype=bf16"])
    assert config.model.mixed_precision and config.model.dtype is DType.BF16
    with pytest.raises(ValueError, match="needs dtype: bf16"):
        ModelConfig(name="nexrl-tiny", mixed_precision=True)


def test_a_hosted_service_refuses_it_by_key() -> None:
    model = ModelConfig(name="nexrl-tiny", dtype=DType.BF16, mixed_precision=True)
    assert "no mixed-precision setting" in fixed_precision_refusals(model, "Tinker", None)["model.mixed_precision"]
    assert "model.mixed_precision" not in fixed_precision_refusals(ModelConfig(name="nexrl-tiny", dtype=DType.BF16), "Tinker", None)


@pytest.mark.parametrize("holder", ["tinker", "weaver"])
def test_the_remote_api_backend_refuses_it_before_step_1(tmp_path: Path, holder: str) -> None:
    """The quickstart on the embedded service, in bf16 (which the service is started in)
    with mixed precision: the run stops where the backend checks the holder, naming the
    key, and no step is written."""
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        config = load_config(
            path,
            [f"output.dir={tmp_path / 'run'}", f"backend.options.service_holder={holder}", "model.dtype=bf16", "model.mixed_precision=true",
             "schedule.steps=1", "schedule.validate_every=0"],
        )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        run_training(config, progress_bar=False)
    (problem,) = refused.value.problems
    assert problem.startswith(
        f"model.mixed_precision: backend 'remote_api' cannot honour it: the {holder.capitalize()} API has no mixed-precision"
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "no step ran"
