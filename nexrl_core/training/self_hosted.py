"""`SelfHostedTrainer`: trajectories become a `Batch`, an algorithm prepares it, a transport trains on it.

The algorithm is one method. `SelfHostedTrainer._prepare_batch(batch) -> (batch, metrics)`
receives the step's rows (sorted, padded to the workers' world size, padding rows
marked in ``valid_rows``) and returns them with what the loss reads added
(``advantages``, maybe ``old_logprobs`` recomputed on the workers); the base class
sends the result to the workers with `nexrl_core.training.transport.Transport.update_actor`,
less the rows no policy gradient comes from (all-zero advantages), as the remote-API
trainer sends no such datum.
A third party writes a new algorithm by subclassing and overriding that method
(``docs/plugins.md`` shows one); GRPO is nexrl-grpo's ``self_hosted_grpo``.

Checkpoints are written by a background thread: `save_checkpoint` returns a future at
once and the workers save while the next step's rollouts run; the next call that needs
the workers waits for the save first (the transport carries one op at a time). The
save's outcome, its directory or its error, is the future's: whoever started it reports
it (the loop records the checkpoint only once it is done). A checkpoint directory holds
the workers' sharded state (and an HF export of the policy, see
``docs/self-hosted.md``) and ``trainer.json``, written last, so a save that never
finished is refused by `load_checkpoint` by name.

Like `nexrl_core.training.batch`, this module imports torch only inside the functions that use it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from nexrl_core.config.checks import Check
from nexrl_core.config.lr_schedule import LearningRateSchedule
from nexrl_core.run.metrics import readable_train_metrics
from nexrl_core.training.holder_trainer import HolderTrainerConfig, step_with_scheduled_rate
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.types import Trajectory, sort_trajectories

if TYPE_CHECKING:
    import torch

    from nexrl_core.training.batch import Batch
    from nexrl_core.training.transport import Transport

__all__ = ["TRANSPORT_TRAINER", "SelfHostedTrainer", "SelfHostedTrainerConfig", "UpdateSettings", "batch_data_metrics"]

TRANSPORT_TRAINER = "transport"
"""Capability of a `nexrl_core.plugins.specs.TrainerSpec` whose trainer is a `SelfHostedTrainer`
(it trains through a transport's workers, not a service holder)."""

TRAINER_STATE_FILE = "trainer.json"
WORKERS_DIR = "workers"

_positive_int = Check("must be an integer > 0", lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0)


@attrs.frozen(kw_only=True)
class UpdateSettings:
    """How the workers run one update on a step's batch."""

    ppo_epochs: int = attrs.field(default=1, validator=_positive_int)
    """Passes over the batch."""
    mini_batches: int = attrs.field(default=1, validator=_positive_int)
    """Optimizer steps per pass: each rank's rows split into this many parts."""
    micro_batch_rows: int = attrs.field(default=8, validator=_positive_int)
    """Most rows per forward/backward on a rank; gradients accumulate over a mini-batch,
    so this saves memory and changes nothing else."""
    max_tokens_per_microbatch: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive_int))
    """Most padded tokens (rows x longest row) per forward/backward on a rank, as the
    in-process backend's option of that name; None: ``micro_batch_rows`` alone decides.
    Like it, it bounds memory and changes nothing else."""


@attrs.frozen(kw_only=True)
class SelfHostedTrainerConfig:
    """What every self-hosted trainer sends with an update. A trainer's own config
    subclasses it and gets the recipe's loss, optimizer and learning-rate schedule from
    `from_recipe`."""

    train_step: TrainStepConfig = attrs.field(factory=TrainStepConfig)
    """The loss with its options and the AdamW settings."""
    update: UpdateSettings = attrs.field(factory=UpdateSettings)
    lr_schedule: LearningRateSchedule = attrs.field(factory=LearningRateSchedule)
    """Each step's learning rate (``algorithm.lr_schedule``, ``algorithm.warmup_steps``)."""

    @classmethod
    def from_recipe(cls, config: Any) -> SelfHostedTrainerConfig:
        """The recipe's loss with every option, its AdamW settings and its schedule, read
        as the holder trainer reads them (`HolderTrainerConfig.from_recipe`); the
        backend sets ``update``.

        :raises ConfigError: for bad loss or estimator options.
        """
        read = HolderTrainerConfig.from_recipe(config)
        return cls(train_step=read.train_step, lr_schedule=read.lr_schedule)


def batch_data_metrics(batch: Batch) -> dict[str, float]:
    """Mean/max/min of the prepared batch's real rows: outcome score, shaped reward,
    advantages and returns over trained tokens, response and prompt lengths, and the
    share of padding cells the workers will carry."""
    import torch

    valid = batch.tensors["valid_rows"]
    mask = batch.tensors["loss_mask"][valid] > 0
    attention = batch.tensors["attention_mask"][valid].bool()
    prompt = batch.prompt_length
    metrics: dict[str, float] = {}

    def describe(name: str, values: torch.Tensor) -> None:
        if values.numel():
            values = values.to(torch.float64)
            metrics.update(
                {
                    f"data/{name}/mean": float(values.mean()),
                    f"data/{name}/max": float(values.max()),
                    f"data/{name}/min": float(values.min()),
                }
            )

    describe("score", batch.tensors["rewards"][valid])
    if "token_level_rewards" in batch.tensors:
        describe("reward", batch.tensors["token_level_rewards"][valid].sum(dim=1))
    for name in ("advantages", "returns"):
        if name in batch.tensors:
            describe(name, batch.tensors[name][valid][mask])
    describe("response_length", attention[:, prompt:].sum(dim=1))
    describe("prompt_length", attention[:, :prompt].sum(dim=1))
    cells = batch.tensors["attention_mask"].numel()
    metrics["data/padding_fraction"] = 1.0 - float(batch.tensors["attention_mask"].sum()) / cells if cells else 0.0
    return metrics


class SelfHostedTrainer:
    """Trains a worker group through a `Transport`; subclasses implement `_prepare_batch`.

    ``config`` is a `SelfHostedTrainerConfig` or any attrs record with its fields; one
    without ``lr_schedule`` trains at a constant rate, and the self-hosted backend refuses
    a schedule for such a trainer by its key.
    A backend calls `bind` once its workers are up, then `train` each step.
    """

    supports_kl = False
    """Whether the algorithm applies ``algorithm.kl``; a backend refuses a KL coefficient
    for a trainer that does not."""

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else SelfHostedTrainerConfig()
        self.train_step: TrainStepConfig = self.config.train_step
        self.update: UpdateSettings = self.config.update
        self._transport: Transport | None = None
        self._teacher: Transport | None = None
        self.world_size = 1
        self.teacher_world_size = 1
        self.pad_token_id = 0
        self.trained_since_publish = False
        """Whether the workers hold weights sampling has not been given yet."""
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nexrl-checkpoint")
        self._saving: concurrent.futures.Future[str] | None = None

    # --- wiring ----------------------------------------------------------------------------

    def bind(
        self, transport: Transport, *, world_size: int, pad_token_id: int, teacher: Transport | None = None, teacher_world_size: int = 1
    ) -> None:
        """Use ``transport``'s workers (``world_size`` ranks; ``pad_token_id`` fills padding),
        and ``teacher``'s (``teacher_world_size`` ranks), whose model, the recipe's
        ``teacher``, is never trained, to score tokens with `teacher_log_prob`."""
        self._transport = transport
        self._teacher = teacher
        self.world_size = world_size
        self.teacher_world_size = teacher_world_size
        self.pad_token_id = pad_token_id

    def teacher_log_prob(self, batch: Batch) -> torch.Tensor:
        """The teacher model's log-prob of every token of ``batch`` (as
        `Transport.compute_log_prob` lays them out), in passes as the update runs.

        :raises RuntimeError: when the backend bound no teacher.
        """
        if self._teacher is None:
            raise RuntimeError(f"{type(self).__name__} has no teacher; a backend binds one when the recipe sets teacher.model")
        rows = batch.batch_size
        scored = self._teacher.compute_log_prob(
            batch.pad_to_world_size(self.teacher_world_size), self.update.micro_batch_rows, self.update.max_tokens_per_microbatch
        )
        return scored[:rows]

    @property
    def transport(self) -> Transport:
        """The bound transport, once any background checkpoint has finished with it."""
        if self._transport is None:
            raise RuntimeError(f"{type(self).__name__} has no transport; a backend calls bind() first")
        self._wait_for_save()
        return self._transport

    # --- one step ----------------------------------------------------------------------------

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The algorithm: add what the loss reads (at least ``advantages`` for a policy
        gradient) to ``batch`` and return it with float metrics. Rows whose
        ``valid_rows`` is False were added to fill the last rank; they must not move any
        statistic (their loss mask is 0, so the loss never sees them)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _prepare_batch(batch) -> (batch, metrics)")

    def update_options(self, step: int | None = None) -> dict[str, Any]:
        """What `Transport.update_actor` gets besides the batch: loss, optimizer (with the
        learning rate ``config.lr_schedule`` gives ``step``, when one is given), update settings."""
        train_step = self.train_step
        if step is not None:
            train_step = step_with_scheduled_rate(train_step, getattr(self.config, "lr_schedule", None), step)
        return {
            "loss_fn": train_step.loss_fn,
            "loss_fn_config": dict(train_step.loss_fn_config),
            "optimizer": attrs.asdict(train_step.optimizer),
            **attrs.asdict(self.update),
        }

    def train(self, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        """One update from a step's trajectories (``step`` is 1-based); returns float metrics."""
        from nexrl_core.training.batch import Batch

        transport = self.transport
        ordered = sort_trajectories(trajectories)
        if not ordered:
            return {"datums/trained": 0.0}
        batch = Batch.from_trajectories(ordered, pad_token_id=self.pad_token_id).pad_to_world_size(self.world_size)
        batch, metrics = self._prepare_batch(batch)
        batch, skipped = self._rows_worth_training(batch)
        trained = len(ordered) - skipped
        metrics.update({"datums/trained": float(trained), "datums/skipped": float(skipped), "datums/trained_tokens": 0.0})
        if trained:
            metrics["datums/trained_tokens"] = float(batch.tensors["loss_mask"].sum())
            options = self.update_options(step)
            metrics["optim/lr"] = float(options["optimizer"]["learning_rate"])
            metrics.update(readable_train_metrics(transport.update_actor(batch, options)))
            self.trained_since_publish = True
        return {key: float(value) for key, value in metrics.items()}

    def _rows_worth_training(self, batch: Batch) -> tuple[Batch, int]:
        """The prepared batch without the rows no policy gradient comes from, and how many
        real rows that leaves out: rows whose advantages are all zero (a GRPO group whose
        runs all scored the same) and rows of fewer than two tokens. The holder trainer
        sends no such datum, so a recipe's step aggregates over the same tokens on every
        backend, and the workers spend no pass on them.

        A batch without ``advantages`` (an algorithm whose loss reads none) is trained
        whole; so is one whose rows with a gradient are too few to give every rank
        `UpdateSettings.mini_batches` rows, as the update needs. When no row is worth
        training, every real row is left out and the batch is returned unchanged."""
        tensors = batch.tensors
        if "advantages" not in tensors:
            return batch, 0
        valid = tensors["valid_rows"].bool()
        worth = valid & (tensors["advantages"] != 0).any(dim=1) & (tensors["attention_mask"].sum(dim=1) >= 2)
        real, kept = int(valid.sum()), worth.nonzero().flatten().tolist()
        if not kept:
            return batch, real
        if len(kept) == real:
            return batch, 0
        trimmed = batch.select(kept).remove_redundant_left_padding().remove_redundant_right_padding()
        trimmed = trimmed.pad_to_world_size(self.world_size)
        if trimmed.batch_size // self.world_size < self.update.mini_batches:
            return batch, 0
        return trimmed, real - len(kept)

    # --- resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What the algorithm must remember across ``--resume`` (JSON-able)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""

    def save_checkpoint(self, directory: Path) -> concurrent.futures.Future[str]:
        """Start saving the workers' state and `state` under ``directory`` in the
        background; returns at once a future of ``directory`` (as `load_checkpoint`
        takes it) that resolves once the checkpoint is complete. The next use of the
        workers waits for the save."""
        transport = self.transport
        directory = Path(directory)
        state = self.state()

        def save() -> str:
            directory.mkdir(parents=True, exist_ok=True)
            transport.save_checkpoint(str(directory / WORKERS_DIR))
            partial = directory / f"{TRAINER_STATE_FILE}.partial"
            partial.write_text(json.dumps(state))
            os.replace(partial, directory / TRAINER_STATE_FILE)
            return str(directory)

        self._saving = self._saver.submit(save)
        return self._saving

    def _wait_for_save(self) -> None:
        """Block until a background save has finished; its error is the future's, for
        whoever started it to report."""
        saving, self._saving = self._saving, None
        if saving is not None:
            concurrent.futures.wait([saving])

    def load_checkpoint(self, directory: str | Path) -> None:
        """Continue from a directory `save_checkpoint` finished.

        :raises ValueError: when its save never finished (``trainer.json`` is missing).
        """
        transport = self.transport  # a save still running finishes first
        directory = Path(directory)
        record = directory / TRAINER_STATE_FILE
        if not record.is_file():
            raise ValueError(
                f"checkpoint {str(directory)!r} is incomplete ({TRAINER_STATE_FILE} is missing): its background save "
                "did not finish; resume from an earlier checkpoint"
            )
        transport.load_checkpoint(str(directory / WORKERS_DIR))
        self.load_state(json.loads(record.read_text()))
        self.trained_since_publish = True

    def close(self) -> None:
        """Let a running save finish, then stop the saving thread."""
        self._saver.shutdown(wait=True)
