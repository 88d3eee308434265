"""The module the ``nexrl.plugins`` entry point names: only spec records, no torch."""

from __future__ import annotations

import attrs

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import AdvantageEstimatorSpec


@attrs.frozen(kw_only=True)
class MedianBaselineConfig:
    """Options of ``example.median``."""

    scale: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    """Multiplies every advantage, e.g. to match the magnitude of a std-normalised estimator."""


@hookimpl
def nexrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
    return [
        AdvantageEstimatorSpec(
            name="example.median",
            factory="nexrl_example_plugin.median:MedianBaseline",
            config_class=MedianBaselineConfig,
            description="reward minus the median reward of its group",
            capabilities={"group_relative"},
        )
    ]
