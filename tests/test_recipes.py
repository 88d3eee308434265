"""Every recipe we ship or document resolves, components and options included."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_core.config import load_config, resolve_all_options

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_recipe_resolves(recipe: Path) -> None:
    config = load_config(recipe, [])
    assert resolve_all_options(config)


def test_hosted_recipe_differs_from_the_quickstart_in_backend_and_model() -> None:
    from importlib.resources import files

    quickstart = load_config(str(files("nexrl_core").joinpath("recipes", "quickstart.yaml")), [])
    hosted = load_config(Path(__file__).resolve().parents[1] / "recipes" / "hosted_tinker.yaml", [])
    assert quickstart.backend.options["base_url"] is None
    assert hosted.backend.options["base_url"] == "https://tinker.thinkingmachines.dev/services/tinker-prod"
    assert hosted.backend.options["service_holder"] == quickstart.backend.options["service_holder"] == "tinker"
    assert quickstart.model.name == "nexrl-tiny" and hosted.model.name != quickstart.model.name
    assert quickstart.model.lora.rank == 0 and hosted.model.lora.rank > 0, "hosted Tinker trains LoRA adapters"


METHOD_QUICKSTARTS = {"quickstart_distill.yaml": ("teacher", "advantage")}
"""Quickstarts of another method, and what they change besides backend and output: the
distillation one adds a teacher and the estimator that reads it."""


def test_backend_quickstarts_differ_from_the_builtin_only_in_backend_and_output() -> None:
    """quickstart_<X>.yaml is the quickstart on another backend or rollout source, nothing
    else, but for what a method quickstart changes (`METHOD_QUICKSTARTS`)."""
    from importlib.resources import files

    from nexrl_core.config import dump_config

    def without_source(config: dict, method: tuple[str, ...] = ()) -> dict:
        plain = {**config, "rollout": {**config["rollout"], "source": None}}
        if "teacher" in method:
            plain["teacher"] = None
        if "advantage" in method:
            plain["algorithm"] = {**config["algorithm"], "advantage": None}
        return plain

    builtin = dump_config(load_config(str(files("nexrl_core").joinpath("recipes", "quickstart.yaml")), []))
    for recipe in (path for path in RECIPES if path.name.startswith("quickstart_")):
        config = dump_config(load_config(recipe, []))
        assert (config["backend"], config["rollout"]["source"]) != (builtin["backend"], builtin["rollout"]["source"]), recipe.name
        assert config["output"]["dir"] == f"runs/{recipe.stem}"
        method = METHOD_QUICKSTARTS.get(recipe.name, ())
        same = without_source(builtin, method)
        differing = {key for key in same if key not in ("backend", "output") and without_source(config, method)[key] != same[key]}
        assert not differing, f"{recipe.name} also changes {sorted(differing)}"


def test_the_distillation_quickstart_distils_the_inprocess_quickstarts_model() -> None:
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    distill = load_config(recipes / "quickstart_distill.yaml", [])
    teacher = load_config(recipes / "quickstart_inprocess.yaml", [])
    assert distill.teacher.model == f"{teacher.output.dir}/final_model"
    assert (distill.backend.name, distill.algorithm.advantage.name) == ("inprocess", "on_policy_distillation")
    assert distill.model.name == teacher.model.name, "the student starts where the teacher started"


def test_hosted_weaver_recipe_differs_from_the_weaver_quickstart_in_backend_and_model() -> None:
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    quickstart = load_config(recipes / "quickstart_weaver.yaml", [])
    hosted = load_config(recipes / "hosted_weaver.yaml", [])
    assert quickstart.backend.options["base_url"] is None
    assert hosted.backend.options["base_url"] == "https://weaver-console.nex-agi.cn"
    assert hosted.backend.options["api_key_env"] == "WEAVER_API_KEY"
    assert hosted.backend.options["service_holder"] == quickstart.backend.options["service_holder"] == "weaver"
    assert quickstart.model.name == "nexrl-tiny" and hosted.model.lora.rank > 0
