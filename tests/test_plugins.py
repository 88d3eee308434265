"""Plugin discovery and the registries, through real entry points and in-process plugins."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.loading import load_plugins
from nexrl_core.plugins.registry import (
    DuplicateComponentError,
    UnknownComponentError,
    build_registry,
    get_advantage_estimator,
)
from nexrl_core.plugins.specs import AdvantageEstimatorSpec, PolicyLossSpec

GRPO_ESTIMATORS = ["dr_grpo", "grpo", "on_policy_distillation", "reinforce_plus_plus", "rloo"]
GRPO_LOSSES = ["cispo", "cross_entropy", "dro", "gspo", "importance_sampling", "ppo"]


def plugin_module(name: str, **hooks: object) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, function)
    return module


def test_grpo_plugin_is_discovered_through_its_entry_point() -> None:
    registry = build_registry(load_plugins())
    info = registry.plugins.info("grpo")
    assert info is not None and info.error is None
    assert info.distribution == "nexrl-grpo"
    assert set(GRPO_ESTIMATORS) <= set(registry.names("advantage_estimators"))
    assert set(GRPO_LOSSES) <= set(registry.names("policy_losses"))
    assert registry.providers[("advantage_estimators", "grpo")] == "grpo"


def test_unknown_name_lists_known_names_and_providers() -> None:
    registry = build_registry(load_plugins())
    with pytest.raises(UnknownComponentError) as error:
        registry.find_spec("advantage_estimators", "grpoo")
    message = str(error.value)
    assert "unknown advantage estimator 'grpoo'" in message
    assert "grpo (from grpo)" in message
    assert "Did you mean 'grpo'?" in message


def test_an_uninstalled_name_that_is_an_extra_of_nexrl_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXRL_DISABLE_PLUGINS", "tinker")
    registry = build_registry(load_plugins())
    with pytest.raises(UnknownComponentError) as error:
        registry.find_spec("service_holders", "tinker")
    message = str(error.value)
    assert "'tinker' is provided by an extra of NexRL: pip install 'nexrl[tinker]'" in message
    assert "Disabled by NEXRL_DISABLE_PLUGINS: tinker" in message
    with pytest.raises(UnknownComponentError) as error:
        registry.find_spec("policy_losses", "no_such_loss")
    assert "pip install" not in str(error.value)


def test_disabled_plugin_is_not_imported_or_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXRL_DISABLE_PLUGINS", " example , grpo")
    plugins = load_plugins()
    assert plugins.info("grpo") is None and plugins.info("example") is None
    assert plugins.disabled == {"example", "grpo"}
    assert build_registry(plugins).names("advantage_estimators") == []


def test_duplicate_name_names_both_plugins() -> None:
    @hookimpl
    def nexrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
        return [AdvantageEstimatorSpec(name="grpo", factory="nowhere:nothing")]

    plugins = load_plugins({"copycat": plugin_module("copycat", nexrl_advantage_estimators=nexrl_advantage_estimators)})
    with pytest.raises(DuplicateComponentError, match="'grpo' is registered by both plugin 'grpo' and plugin 'copycat'"):
        build_registry(plugins)


def test_misspelled_hook_is_a_plugin_error_with_a_suggestion() -> None:
    @hookimpl
    def nexrl_advantage_estimator() -> list[AdvantageEstimatorSpec]:
        return []

    plugins = load_plugins({"typo": plugin_module("typo", nexrl_advantage_estimator=nexrl_advantage_estimator)})
    info = plugins.info("typo")
    assert info is not None
    assert info.error == "hook 'nexrl_advantage_estimator' is not a NexRL hook; did you mean 'nexrl_advantage_estimators'?"
    assert "typo" not in dict(plugins.manager.list_name_plugin())
    assert "grpo" in build_registry(plugins).names("advantage_estimators")


def test_hook_that_raises_or_returns_wrong_records_is_reported_not_fatal() -> None:
    @hookimpl
    def nexrl_policy_losses() -> list[PolicyLossSpec]:
        raise RuntimeError("boom")

    @hookimpl
    def nexrl_advantage_estimators() -> list[PolicyLossSpec]:
        return [PolicyLossSpec(name="wrong", factory="x:y")]

    registry = build_registry(
        load_plugins(
            {
                "raises": plugin_module("raises", nexrl_policy_losses=nexrl_policy_losses),
                "wrong": plugin_module("wrong", nexrl_advantage_estimators=nexrl_advantage_estimators),
            }
        )
    )
    assert registry.hook_errors["raises"] == "RuntimeError in nexrl_policy_losses: boom"
    assert "must return AdvantageEstimatorSpec records, got PolicyLossSpec" in registry.hook_errors["wrong"]
    assert "ppo" in registry.names("policy_losses")


def test_in_process_plugin_via_fixture(register_nexrl_plugin) -> None:  # type: ignore[no-untyped-def]
    class Constant:
        requires = frozenset()
        group_relative = False

        def __init__(self, config: object) -> None:
            self.config = config

    @hookimpl
    def nexrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
        return [AdvantageEstimatorSpec(name="test.constant", factory=Constant)]

    register_nexrl_plugin(plugin_module("constant", nexrl_advantage_estimators=nexrl_advantage_estimators), "constant")
    assert isinstance(get_advantage_estimator("test.constant"), Constant)


def _fake_distribution(site: Path, name: str, entry_point: str) -> None:
    """A real installed-distribution record (dist-info) whose entry point cannot import."""
    dist_info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[nexrl.plugins]\n{entry_point}\n")


def test_plugin_that_fails_to_import_is_listed_and_the_rest_still_works(tmp_path: Path) -> None:
    _fake_distribution(tmp_path, "nexrl-broken", "broken = nexrl_broken_missing_module")
    script = textwrap.dedent(
        """
        import json, sys
        from click.testing import CliRunner
        from nexrl_core.cli import cli
        from nexrl_core.plugins.registry import get_policy_loss
        result = CliRunner().invoke(cli, ["plugins", "--json"])
        get_policy_loss("ppo")
        print(result.output)
        """
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 0, completed.stderr
    rows = {row["name"]: row for row in json.loads(completed.stdout)}
    assert rows["broken"]["distribution"] == "nexrl-broken"
    assert rows["broken"]["version"] == "1.0"
    assert "No module named 'nexrl_broken_missing_module'" in rows["broken"]["error"]
    assert rows["grpo"]["error"] is None
