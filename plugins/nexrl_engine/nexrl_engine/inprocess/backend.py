"""``open_inprocess``: the ``inprocess`` backend, an `EngineHolder` driven by a registered trainer.

The same `HolderBackend` as the remote-API backend, so the trainer, its checkpoint
record and the option checks are shared; only the holder differs. Engine checkpoints
go to ``<output.dir>/backend/engine``, next to the backend's own records, so
``--resume`` finds them.
"""

from __future__ import annotations

from nexrl_core.config.errors import ConfigError
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holder_backend import HolderBackend
from nexrl_core.training.trainer import build_trainer
from nexrl_engine.inprocess.config import EngineHolderConfig, InProcessBackendConfig
from nexrl_engine.inprocess.holder import EngineHolder
from nexrl_engine.recipe_checks import check_device, check_model_name

__all__ = ["ENGINE_DIR", "open_inprocess"]

ENGINE_DIR = "engine"
"""Where, under the backend's work directory, the engine's checkpoints go."""


def _open_holder(setup: BackendSetup, options: InProcessBackendConfig) -> EngineHolder:
    name = check_model_name(setup.recipe)
    check_device(options.device, "backend.options.device")
    config = EngineHolderConfig(
        model=setup.recipe.model, seed=setup.recipe.seed, engine=options.engine_options(), teacher=setup.recipe.teacher.model
    )
    try:
        return EngineHolder(config, setup.work_dir / ENGINE_DIR)
    except ConfigError:
        raise
    except (ValueError, OSError) as error:
        raise ConfigError([f"model.name: cannot load {name!r}: {error}"]) from None


def open_inprocess(setup: BackendSetup) -> HolderBackend:
    """Open the ``inprocess`` backend for one run.

    :raises ConfigError: naming ``model.name`` (or ``teacher.model``) for a model that is
        missing or cannot be loaded, ``backend.options.*`` for a bad trainer or device, or a setting the
        engine cannot honour; the engine is released first.
    """
    options: InProcessBackendConfig = setup.options
    trainer = build_trainer(setup.recipe, options.trainer, "backend.options.trainer")
    holder = _open_holder(setup, options)
    try:
        return HolderBackend(holder, trainer, name="inprocess", work_dir=setup.work_dir)
    except BaseException:
        holder.close()
        raise
