"""What a registered trainer is: the algorithm half of a backend that trains through a service holder.

A trainer turns a step's trajectories into training calls on a `ServiceHolder`
(advantages, datums, one optimizer step) and publishes the new weights to sampling.
Backends built on a service holder (the remote-API and in-process backends) pick one by
name from the ``nexrl_trainers`` registry; `nexrl_core.testing.TrainerContract` is the
bar every trainer meets. `build_trainer` is how every backend, the self-hosted one too
(whose trainers drive a transport, `nexrl_core.training.self_hosted`), picks and configures its
trainer from the recipe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.training.holders import ServiceHolder, TrainStepConfig
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


def build_trainer(
    recipe: TrainConfig,
    name: str,
    key: str,
    *,
    through_transport: bool = False,
    settings: Mapping[str, tuple[str, Any]] | None = None,
) -> Any:
    """The registered trainer ``name``, configured from the recipe.

    :param through_transport: whether the backend drives workers through a transport
        (it needs a trainer with capability ``transport``) or a service holder (one without).
    :param settings: trainer config field -> (recipe key, value) the backend sets; a
        value other than None for a field the trainer's config lacks is refused by key.
    :raises ConfigError: naming ``key`` for an unknown or unfit trainer or bad settings.
    """
    from nexrl_core.plugins.registry import UnknownComponentError, find_spec, get_registry
    from nexrl_core.training.self_hosted import TRANSPORT_TRAINER

    try:
        spec = find_spec("trainers", name)
    except UnknownComponentError as error:
        raise ConfigError([f"{key}: {error}"]) from None
    if (TRANSPORT_TRAINER in spec.capabilities) != through_transport:
        needs = f"a trainer with capability {TRANSPORT_TRAINER!r}" if through_transport else "a trainer that drives a service holder"
        fitting = [
            known
            for known in get_registry().names("trainers")
            if (TRANSPORT_TRAINER in find_spec("trainers", known).capabilities) == through_transport
        ]
        raise ConfigError(
            [f"{key}: trainer {name!r} does not fit this backend, which needs {needs} ({', '.join(fitting) or 'none registered'})"]
        )
    from_recipe = getattr(spec.config_class, "from_recipe", None)
    trainer_config = from_recipe(recipe) if callable(from_recipe) else spec.config_class()
    fields = attrs.fields_dict(type(trainer_config)) if attrs.has(type(trainer_config)) else {}
    changes = {}
    for field, (path, value) in (settings or {}).items():
        if field in fields:
            if value is not None:
                changes[field] = value
        elif value is not None:
            raise ConfigError([f"{path}: trainer {name!r} has no setting {field!r}; remove it or pick another trainer"])
    return spec.build(attrs.evolve(trainer_config, **changes) if changes else trainer_config)
