"""Entry-point module of nexrl-ray: registers the ``ray`` placer (ray is imported only
when a group is placed)."""

from __future__ import annotations

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import PlacerSpec
from nexrl_ray.options import RayPlacerOptions


@hookimpl
def nexrl_placers() -> list[PlacerSpec]:
    """Worker ranks on a Ray cluster."""
    return [
        PlacerSpec(
            name="ray",
            factory="nexrl_ray.placer:RayPlacer",
            config_class=RayPlacerOptions,
            description="worker ranks on a Ray cluster: one placement group per worker group, a bundle per rank",
        )
    ]
