"""`HolderBackend`: any service holder plus a registered trainer is a `nexrl_core.training.backend.Backend`.

Every backend whose model sits behind a `ServiceHolder` (the remote-API backend over a
hosted or local service, the in-process engine) is this class with its own holder; a
plugin that ships a holder needs no backend code of its own. `nexrl_core.training.trainer.build_trainer`
picks and configures the trainer.

The holder samples for rollouts and trains; the trainer turns trajectories into the
holder's training calls. A checkpoint is a small JSON file in the backend's work
directory that names the holder's checkpoint and holds the trainer's state (an
adaptive KL coefficient, say), so ``--resume`` restores both. Exporting the model is
the holder's `ServiceHolder.export_model`; whatever stops it is reported as a
`ModelExportError` that names this backend.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nexrl_core.chat.model import ChatModel
from nexrl_core.config.errors import ConfigError
from nexrl_core.training.holders import ServiceHolder
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.training.trainer import Trainer
from nexrl_core.types import Trajectory

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
OPTION_PATHS = {"loss_fn_config.": "algorithm.loss.options.", "optimizer.": "algorithm.", "model.": "model."}
"""Where each `ServiceHolder.refused_options` key sits in a recipe."""


def recipe_path(key: str) -> str:
    """A `ServiceHolder.refused_options` key as the recipe key a user edits."""
    for prefix, path in OPTION_PATHS.items():
        if key.startswith(prefix):
            return path + key[len(prefix) :]
    return key


class HolderBackend:
    """A backend over one service holder, shared by rollouts and the trainer."""

    def __init__(
        self,
        holder: ServiceHolder,
        trainer: Trainer,
        *,
        name: str,
        work_dir: Path,
        on_close: Sequence[Callable[[], None]] = (),
        watch: Callable[[], str | None] = lambda: None,
    ) -> None:
        """:param name: the backend's registered name, for messages.
        :param on_close: called after the holder is closed (stop an embedded service).
        :param watch: why a part the backend started (an embedded service) died, or None
            while it serves; the backend's `lost`.
        :raises ConfigError: when the holder cannot honour the trainer's settings.
        """
        self.holder = holder
        self.trainer = trainer
        self.name = name
        self.work_dir = work_dir
        self._on_close = list(on_close)
        self._watch = watch
        refused = dict(holder.refused_options(trainer.train_step))
        teacher = getattr(getattr(trainer, "config", None), "teacher", None)
        if teacher is not None and teacher.model is not None and not callable(getattr(holder, "teacher_logprobs", None)):
            refused["teacher.model"] = (
                f"its {type(holder).__name__} scores tokens under no second model (it has no teacher_logprobs); "
                "remove teacher, or choose a holder or backend that holds a teacher (nexrl plugins lists them)"
            )
        if refused:
            raise ConfigError([f"{recipe_path(key)}: backend {name!r} cannot honour it: {reason}" for key, reason in refused.items()])

    def chat_model(self) -> ChatModel:
        return self.holder

    def lost(self) -> str | None:
        """`nexrl_core.training.backend.WatchedBackend.lost`: an embedded service's death."""
        return self._watch()

    def run_info(self) -> Mapping[str, str]:
        return self.holder.run_info()

    def train(self, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        return self.trainer.train(self.holder, trajectories, step)

    def sync_weights(self, step: int) -> str | None:
        return self.trainer.sync_weights(self.holder, step)

    def save_checkpoint(self, name: str) -> str:
        record = {"holder": self.holder.save_checkpoint(name), "trainer": self.trainer.state()}
        path = self.work_dir / CHECKPOINT_DIR / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
        return str(path)

    def load_checkpoint(self, path: str) -> None:
        """Continue from a `save_checkpoint` record, or load a service's own checkpoint path
        (``tinker://...``, ``weaver://...``: weights and optimizer, no trainer state)."""
        if "://" in path:
            self.holder.load_checkpoint(path)
            self.holder.update_sampling_weights()
            return
        record: dict[str, Any] = json.loads(Path(path).read_text())
        self.holder.load_checkpoint(record["holder"])
        self.holder.update_sampling_weights()
        self.trainer.load_state(record["trainer"])

    def export_model(self, directory: Path) -> Path:
        export = getattr(self.holder, "export_model", None)
        if export is None:
            raise ModelExportError(
                f"backend {self.name!r} cannot export the model: its service holder {type(self.holder).__name__} has no export_model"
            )
        try:
            return Path(export(Path(directory)))
        except ModelExportError as error:
            raise ModelExportError(f"backend {self.name!r} cannot export the model: {error}") from error
        except Exception as error:
            raise ModelExportError(f"backend {self.name!r} failed to export the model: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Close the holder, then stop what the backend started. A holder that cannot say
        goodbye to a service that died is only noted: the run already reported the death."""
        try:
            self.holder.close()
        except Exception as error:
            lost = self._watch()
            if lost is None:
                raise
            logger.warning("could not close the %s holder's session (%s): %s", self.name, lost, type(error).__name__)
        finally:
            for close in self._on_close:
                close()
