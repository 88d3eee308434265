"""The training loop behind ``nexrl train``.

dataloader (each prompt ``group_size`` times) → rollout workers (agents calling the
OpenAI-shaped client) → trainer (advantages, datums, one optimizer step on the backend)
→ weight sync → metrics and checkpoints.

Step k (1-based) trains on batch k. With ``rollout.max_staleness`` s = 0 batch k is
sampled with the weights after step k-1 (on-policy). With s > 0 the batches up to k+s
are rolled out while step k trains, and the loop waits for them before it publishes the
new weights, so batch k is always sampled with the weights after step k-1-s, whatever
the timing. Validation runs before the first step, every ``schedule.validate_every``
steps and after the last one. A checkpoint (``schedule.checkpoint_every``) saves the
backend's weights and optimizer and then, atomically, the small run state (step, data
position, pending batches, metrics so far); ``--resume`` continues from it with the same
results as an uninterrupted run, wall-clock metrics (``time/*``, ``perf/*``) aside.

With ``backend.base_url: null`` the loop starts the registered service (the local
Tinker-compatible one by default) in the background and stops it at the end, on an
error and on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.converter import dump_config, structure_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.data import DataLoader, resolve_task
from nexrl_core.holders import ServiceHolder
from nexrl_core.longlived import freeze_long_lived_objects
from nexrl_core.metrics import (
    METRICS_FILE,
    REWARD_CURVE_FILE,
    TENSORBOARD_DIR,
    MetricsLog,
    ProgressDisplay,
    clean_row,
    plot_reward_curve,
    write_atomic,
)
from nexrl_core.rollout import (
    CompletedBatch,
    PendingBatch,
    RolloutBatch,
    RolloutRunner,
    SamplingDefaults,
    check_error_budget,
)
from nexrl_core.run_state import (
    RUN_STATE_FILE,
    RunState,
    TrainingError,
    config_differences,
    load_run_state,
    save_run_state,
)
from nexrl_core.trainer import Trainer

logger = logging.getLogger("nexrl.train")

CONFIG_FILE = "config.yaml"
SERVICE_DIR = "service"
RESUMABLE_CHANGES = ("schedule.", "output.")
"""Recipe keys a resumed run may change (e.g. more steps); anything else must match."""
RUN_FILES = (METRICS_FILE, RUN_STATE_FILE, CONFIG_FILE, REWARD_CURVE_FILE, TENSORBOARD_DIR, SERVICE_DIR)
"""What a run writes in its output directory; ``--overwrite`` removes exactly these."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after a clean shutdown; the last checkpoint is intact."""

    def __init__(self, output_dir: Path, checkpoint_step: int | None) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.checkpoint_step = checkpoint_step


@attrs.frozen(kw_only=True)
class RunSummary:
    """Where a finished run's results are."""

    output_dir: Path
    metrics_path: Path
    reward_curve: Path | None
    tensorboard_dir: Path | None
    steps: int
    last_row: dict[str, Any] | None
    checkpoint_step: int | None


# --- building the pieces ---------------------------------------------------------------------------


def _component_spec(kind: str, name: str, key: str) -> Any:
    from nexrl_core.registry import UnknownComponentError, find_spec

    try:
        return find_spec(kind, name)
    except UnknownComponentError as error:
        raise ConfigError([f"{key}: {error}"]) from None


def build_trainer(config: TrainConfig) -> Trainer:
    """The trainer ``backend.trainer`` names, configured from the recipe."""
    spec = _component_spec("trainers", config.backend.trainer, "backend.trainer")
    from_recipe = getattr(spec.config_class, "from_recipe", None)
    trainer_config = from_recipe(config) if callable(from_recipe) else spec.config_class()
    return spec.build(trainer_config)


def embedded_api_key(out_dir: Path) -> str:
    """The API key shared by an embedded service and its holder.

    Random on the first run and kept in the service's data directory, so a resumed run
    (a new service process on the same data) still owns the checkpoints it saved.
    """
    import secrets

    key_file = out_dir / SERVICE_DIR / "api_key"
    if not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True)
        key_file.write_text(f"tml-nexrl-{secrets.token_hex(16)}")
        key_file.chmod(0o600)
    return key_file.read_text().strip()


def holder_config(config_class: type, config: TrainConfig, base_url: str | None, api_key: str | None = None) -> Any:
    """The service holder's config: fields named like recipe values are filled from the
    recipe (``base_url``, ``base_model``/``model``, ``lora_rank``, ``dtype``, ``seed``,
    ``api_key``: the embedded service's key, else the ``backend.api_key_env`` variable);
    ``backend.options`` sets the rest."""
    if not attrs.has(config_class):
        if config.backend.options:
            raise ConfigError([f"backend.options: service holder {config.backend.service_holder!r} takes no options"])
        return config_class()
    fields = attrs.fields_dict(config_class)
    filled: dict[str, Any] = {
        "base_url": base_url,
        "base_model": config.model.name,
        "model": config.model.name,
        "lora_rank": config.model.lora_rank,
        "dtype": config.model.dtype.value,
        "seed": config.seed,
    }
    api_key = api_key or os.environ.get(config.backend.api_key_env)
    if api_key:
        filled["api_key"] = api_key
    raw = {key: value for key, value in filled.items() if key in fields}
    raw.update(config.backend.options)
    return structure_config(raw, config_class, path="backend.options")


def build_service(config: TrainConfig, out_dir: Path) -> Any:
    """The registered service an embedded run starts (``backend.service``, else the
    service named like ``backend.service_holder``), on a free loopback port, keeping its
    data (database, checkpoints) in ``<output.dir>/service``. It is asked to serve from a
    child process: its request handling then does not share the GIL with the SDK client
    threads of the rollout."""
    from nexrl_core.serving import ServeOptions

    name = config.backend.service or config.backend.service_holder
    spec = _component_spec("services", name, "backend.service" if config.backend.service else "backend.base_url")
    options = ServeOptions(
        port=0,
        model=config.model.name,
        data_dir=str(out_dir / SERVICE_DIR),
        api_key=embedded_api_key(out_dir),
        separate_process=True,
    )
    return spec.build(options)


def build_holder(config: TrainConfig, base_url: str | None, api_key: str | None = None) -> ServiceHolder:
    spec = _component_spec("service_holders", config.backend.service_holder, "backend.service_holder")
    return spec.build(holder_config(spec.config_class, config, base_url, api_key))


def prepare_output(out_dir: Path, resume: bool, overwrite: bool) -> RunState | None:
    """Check the output directory for a previous run; returns its state when resuming.

    :raises TrainingError: resuming without a run state, or starting over a previous run
        without ``overwrite``.
    """
    if resume and overwrite:
        raise TrainingError("--resume and --overwrite contradict each other; choose one")
    if resume:
        state = load_run_state(out_dir)
        if state is None:
            raise TrainingError(
                f"nothing to resume: {out_dir / RUN_STATE_FILE} does not exist (a run writes it at its first "
                "checkpoint, see schedule.checkpoint_every); run without --resume to start"
            )
        return state
    existing = [name for name in (METRICS_FILE, RUN_STATE_FILE) if (out_dir / name).exists()]
    if existing:
        if not overwrite:
            raise TrainingError(
                f"{out_dir} already holds a run ({', '.join(existing)}); pass --resume to continue it, "
                "--overwrite to start over, or choose another output.dir=..."
            )
        for name in RUN_FILES:
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    return None


# --- the loop --------------------------------------------------------------------------------------


class TrainingLoop:
    """One run: owns the rollout runner, the metrics log and the progress display."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        holder: ServiceHolder,
        trainer: Trainer,
        loader: DataLoader,
        runner: RolloutRunner,
        metrics: MetricsLog,
        display: ProgressDisplay,
        out_dir: Path,
        state: RunState | None,
    ) -> None:
        self.config = config
        self.holder = holder
        self.trainer = trainer
        self.loader = loader
        self.runner = runner
        self.metrics = metrics
        self.display = display
        self.out_dir = out_dir
        self.step = state.step if state else 0
        self.checkpoint_step: int | None = state.step if state else None
        self.total_errors = state.total_agent_errors if state else 0
        self.pending: dict[int, PendingBatch] = {}
        self._frozen = False
        if state:
            for data in state.pending:
                batch = RolloutBatch.from_json(data)
                self.pending[batch.step] = CompletedBatch(batch)
        self.next_batch = state.next_batch if state else 1

    # -- pieces

    def _validate_due(self, step: int) -> bool:
        every = self.config.schedule.validate_every
        return every > 0 and (step % every == 0 or step == self.config.schedule.steps)

    def _checkpoint_due(self, step: int) -> bool:
        every = self.config.schedule.checkpoint_every
        return every > 0 and (step % every == 0 or step == self.config.schedule.steps)

    def _account(self, batch: RolloutBatch, what: str) -> None:
        self.total_errors += len(batch.errors)
        check_error_budget(
            batch,
            fraction=self.config.rollout.error_budget,
            total_errors=self.total_errors,
            max_total=self.config.rollout.max_agent_errors,
            what=what,
        )

    def validate(self, step: int) -> dict[str, float]:
        requests = self.loader.val_requests(step)
        if not requests:
            return {}
        started = time.monotonic()
        batch = self.runner.submit(step, requests, temperature=self.config.rollout.val_temperature).result()
        self._account(batch, f"validation after step {step}")
        metrics = batch.metrics(prefix="val/")
        metrics["val/count"] = float(len(requests))
        metrics["time/val_s"] = time.monotonic() - started
        return metrics

    def _submit_until(self, last: int) -> None:
        while self.next_batch <= min(last, self.config.schedule.steps):
            step = self.next_batch
            self.pending[step] = self.runner.submit(step, self.loader.requests(step))
            self.next_batch += 1

    def checkpoint(self, step: int) -> None:
        path = self.holder.save_checkpoint(f"step_{step:06d}")
        pending = [self.pending[key].result().to_json() for key in sorted(self.pending)]
        state = RunState(
            step=step,
            checkpoint_path=str(path),
            seed=self.config.seed,
            next_batch=self.next_batch,
            data_position=self.loader.position(self.next_batch),
            total_agent_errors=self.total_errors,
            metrics=self.metrics.rows,
            pending=pending,
            config=dump_config(self.config),
        )
        save_run_state(self.out_dir, state)
        self.checkpoint_step = step
        logger.info("checkpoint at step %d: %s", step, path)

    # -- the run

    def run(self) -> None:
        schedule = self.config.schedule
        staleness = self.config.rollout.max_staleness
        if self.step == 0 and schedule.validate_every > 0:
            row = clean_row(0, self.validate(0))
            if len(row) > 1:
                self.metrics.write(row)
                self.display.step_done(row, None)
        for step in range(self.step + 1, schedule.steps + 1):
            started = time.monotonic()
            self._submit_until(step + staleness)
            batch = self.pending.pop(step).result()
            rolled_out = time.monotonic()
            self._account(batch, f"step {step}")
            metrics = batch.metrics()
            metrics["rollout/agent_errors_total"] = float(self.total_errors)
            metrics.update(self.trainer.train(self.holder, batch.trajectories, step))
            trained = time.monotonic()
            for later in self.pending.values():  # batches sampled with the old weights finish first
                later.result()
            self.trainer.sync_weights(self.holder, step)
            finished = time.monotonic()
            step_seconds = finished - started
            metrics["time/rollout_s"] = rolled_out - started
            metrics["time/train_s"] = trained - rolled_out
            metrics["time/sync_s"] = finished - trained
            metrics["time/step_s"] = step_seconds
            metrics["perf/tokens_per_s"] = (
                metrics.get("rollout/response_tokens", 0.0) / step_seconds if step_seconds > 0 else 0.0
            )
            if not self._frozen:
                # After a first step everything a step reuses (imports, tokenizer, SDK
                # clients) exists; full collections need not walk it again.
                freeze_long_lived_objects()
                self._frozen = True
            self.step = step
            if self._validate_due(step):
                metrics.update(self.validate(step))
            row = clean_row(step, metrics)
            self.metrics.write(row)
            self.display.step_done(row, step_seconds)
            if self._checkpoint_due(step):
                self.checkpoint(step)


def _check_resumable(state: RunState, config: TrainConfig) -> None:
    changed = [
        line for line in config_differences(state.config, dump_config(config)) if not line.startswith(RESUMABLE_CHANGES)
    ]
    if changed:
        raise TrainingError(
            "the recipe differs from the one the run was started with, so resuming would not continue the same run:\n  "
            + "\n  ".join(changed)
            + "\n(only schedule.* and output.* may change on --resume)"
        )


def _close_quietly(what: str, close: Any) -> None:
    try:
        close()
    except Exception:  # cleanup must not hide the error that ended the run
        logger.exception("error while closing the %s", what)


def run_training(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    recipe_dir: Path | None = None,
    holder: ServiceHolder | None = None,
    progress_bar: bool | None = None,
) -> RunSummary:
    """Run (or resume) the training a recipe describes.

    :param recipe_dir: where relative data and agent paths are also looked up.
    :param holder: use this service holder instead of building one from ``backend``
        (no service is started; the caller keeps ownership and closes it).
    :param progress_bar: force the live bar on or off (default: on a terminal, not under CI).
    :raises ConfigError: for a bad recipe, before anything is started.
    :raises TrainingError: when the output directory does not fit ``resume``/``overwrite``.
    :raises RolloutError: when agent failures exceed the error budget.
    :raises TrainingInterrupted: on Ctrl-C, after a clean shutdown.
    """
    from nexrl_core.config.components import resolve_all_options

    out_dir = Path(config.output.dir)
    resolve_all_options(config)
    state = prepare_output(out_dir, resume, overwrite)
    if state is not None:
        _check_resumable(state, config)
    trainer = build_trainer(config)
    task = resolve_task(config.task, config.seed, recipe_dir)
    loader = DataLoader(task, config.rollout.prompts_per_step, config.rollout.group_size, config.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    import yaml

    write_atomic(out_dir / CONFIG_FILE, yaml.safe_dump(dump_config(config), sort_keys=False))
    if state is not None and state.step >= config.schedule.steps:
        logger.info("the run in %s already completed %d steps; nothing to do", out_dir, state.step)
        curve = plot_reward_curve(state.metrics, out_dir / REWARD_CURVE_FILE)
        return RunSummary(
            output_dir=out_dir,
            metrics_path=out_dir / METRICS_FILE,
            reward_curve=curve,
            tensorboard_dir=out_dir / TENSORBOARD_DIR,
            steps=state.step,
            last_row=state.metrics[-1] if state.metrics else None,
            checkpoint_step=state.step,
        )

    service = None
    owns_holder = holder is None
    runner: RolloutRunner | None = None
    metrics: MetricsLog | None = None
    display: ProgressDisplay | None = None
    loop: TrainingLoop | None = None
    try:
        if holder is None:
            base_url = config.backend.base_url
            api_key = None
            if base_url is None:
                service = build_service(config, out_dir)  # stopped in `finally`, even if start is interrupted
                logger.info("starting the embedded service (data in %s)", out_dir / SERVICE_DIR)
                base_url = service.start()
                logger.info("the embedded service is up at %s", base_url)
                api_key = embedded_api_key(out_dir)
            holder = build_holder(config, base_url, api_key)
        if state is not None:
            logger.info("resuming from step %d (%s)", state.step, state.checkpoint_path)
            holder.load_checkpoint(state.checkpoint_path)
            holder.update_sampling_weights()
        runner = RolloutRunner(
            holder,
            task.agent,
            concurrency=config.rollout.runs_in_flight(),
            defaults=SamplingDefaults(
                max_tokens=config.rollout.max_tokens, temperature=config.rollout.temperature, top_p=config.rollout.top_p
            ),
            model=config.model.name,
        )
        metrics = MetricsLog(out_dir, rows=state.metrics if state else ())
        display = ProgressDisplay(config.schedule.steps, state.step if state else 0, bar=progress_bar)
        loop = TrainingLoop(
            config,
            holder=holder,
            trainer=trainer,
            loader=loader,
            runner=runner,
            metrics=metrics,
            display=display,
            out_dir=out_dir,
            state=state,
        )
        loop.run()
    except KeyboardInterrupt:
        checkpoint_step = loop.checkpoint_step if loop else (state.step if state else None)
        raise TrainingInterrupted(out_dir, checkpoint_step) from None
    finally:
        if runner is not None:
            _close_quietly("rollout workers", runner.close)
        if display is not None:
            _close_quietly("progress display", display.close)
        if metrics is not None:
            _close_quietly("metrics log", metrics.close)
            _close_quietly("reward curve", lambda: plot_reward_curve(metrics.rows, out_dir / REWARD_CURVE_FILE))
        if owns_holder and holder is not None:
            close = getattr(holder, "close", None)
            if callable(close):
                _close_quietly("service holder", close)
        if service is not None:
            _close_quietly("embedded service", service.stop)

    rows = metrics.rows if metrics else []
    curve = out_dir / REWARD_CURVE_FILE
    return RunSummary(
        output_dir=out_dir,
        metrics_path=out_dir / METRICS_FILE,
        reward_curve=curve if curve.exists() else None,
        tensorboard_dir=out_dir / TENSORBOARD_DIR if (out_dir / TENSORBOARD_DIR).exists() else None,
        steps=loop.step if loop else 0,
        last_row=rows[-1] if rows else None,
        checkpoint_step=loop.checkpoint_step if loop else None,
    )


def row_summary(row: Mapping[str, Any] | None) -> str:
    if not row:
        return "no metrics"
    parts = [f"step {row['step']}"]
    for key in ("reward/mean", "val/reward/mean"):
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.3f}")
    return ", ".join(parts)
