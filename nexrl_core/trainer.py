"""What a registered trainer is: the algorithm half of a backend that trains through a service holder.

A trainer turns a step's trajectories into training calls on a `ServiceHolder`
(advantages, datums, one optimizer step) and publishes the new weights to sampling.
Backends built on a service holder (the remote-API and in-process backends) pick one by
name from the ``nexrl_trainers`` registry; `nexrl_core.testing.TrainerContract` is the
bar every trainer meets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from nexrl_core.holders import ServiceHolder, TrainStepConfig
from nexrl_core.types import Trajectory


class Trainer(Protocol):
    """Trains a service holder's model on trajectories.

    A trainer spec's config class may define ``from_recipe(config: TrainConfig)``; the
    backend then builds the trainer's config from the recipe, otherwise with its defaults.
    """

    train_step: TrainStepConfig
    """The loss and optimizer settings every step sends; a backend checks them against
    its holder (`ServiceHolder.refused_options`) before the first step."""

    def train(self, holder: ServiceHolder, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        """One update from ``trajectories`` (training step ``step``, 1-based); returns metrics."""
        ...

    def sync_weights(self, holder: ServiceHolder, step: int) -> str | None:
        """Make sampling use the weights of the last `train` call; returns their path, or
        None when that call changed nothing."""
        ...

    def state(self) -> dict[str, Any]:
        """What the trainer must remember across ``--resume`` (JSON-able), e.g. an
        adaptive KL coefficient."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        ...
