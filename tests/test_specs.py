"""Spec records build their implementation lazily and check what they are given."""

from __future__ import annotations

import attrs
import pytest

from nexrl_core.plugins.specs import NoOptions, PolicyLossSpec


@attrs.frozen
class Options:
    scale: float = 1.0


def test_string_factory_is_imported_on_build() -> None:
    spec = PolicyLossSpec(name="demo", factory="copy:deepcopy", config_class=Options)
    assert spec.build(Options(scale=2.0)) == Options(scale=2.0)


def test_default_config_is_the_config_class_defaults() -> None:
    spec = PolicyLossSpec(name="demo", factory=lambda config: config, config_class=Options)
    assert spec.build() == Options()
    assert PolicyLossSpec(name="plain", factory=lambda config: config).build() == NoOptions()


def test_wrong_config_type_is_rejected() -> None:
    spec = PolicyLossSpec(name="demo", factory=lambda config: config, config_class=Options)
    with pytest.raises(TypeError, match="policy_loss 'demo' takes a Options config, got NoOptions"):
        spec.build(NoOptions())


def test_malformed_factory_reference() -> None:
    spec = PolicyLossSpec(name="demo", factory="collections.OrderedDict")
    with pytest.raises(ValueError, match="must look like 'package.module:attribute'"):
        spec.build()


@pytest.mark.parametrize("name", ["Grpo", "", "has space", "-lead"])
def test_names_are_lower_case_identifiers(name: str) -> None:
    with pytest.raises(ValueError):
        PolicyLossSpec(name=name, factory="x:y")
