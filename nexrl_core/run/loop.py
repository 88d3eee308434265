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
backend's state (weights, optimizer, trainer state) and then, atomically, the small run
state (step, data position, pending batches, metrics so far); ``--resume`` continues
from it with the same results as an uninterrupted run, wall-clock metrics (``time/*``,
``perf/*``) aside. A backend may save in the background (its ``save_checkpoint``
returns a future): the next step then runs while it writes, and the run state names
the checkpoint only once the save has finished, in step order (`nexrl_core.run.checkpoints`);
the loop waits for every save before the final export, at the end, on an error and on
Ctrl-C. After the last step the backend writes the policy sampling used last
to ``<output.dir>/final_model``, a plain Hugging Face directory; a backend that cannot
is reported and the run still ends as done.

Where the model runs and where runs happen are plugins: the loop opens the registered
backend ``backend.name`` and the rollout source ``rollout.source.name``, and closes
both at the end, on an error and on Ctrl-C (see `nexrl_core.training.backend`). So are the
trackers the rows go to besides ``metrics.jsonl``: the metrics sinks ``output.sinks``
picks, started before the backend and told how the run ended (`nexrl_core.run.sinks`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.converter import dump_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.http.serving import ServiceStartError
from nexrl_core.longlived import freeze_long_lived_objects
from nexrl_core.run import interrupts
from nexrl_core.run.checkpoints import PendingCheckpoints
from nexrl_core.run.data import DataLoader, TaskData, resolve_task
from nexrl_core.run.limits import context_problems
from nexrl_core.run.metrics import (
    METRICS_FILE,
    REWARD_CURVE_FILE,
    MetricsLog,
    ProgressDisplay,
    clean_row,
    plot_reward_curve,
    write_atomic,
)
from nexrl_core.run.rollout import CompletedBatch, PendingBatch, RolloutBatch, check_error_budget
from nexrl_core.run.sinks import SINKS_DIR, RunOutcome, RunSinks, open_sinks, resolve_sinks
from nexrl_core.run.state import (
    RUN_STATE_FILE,
    RunState,
    TrainingError,
    config_differences,
    load_run_state,
    save_run_state,
)
from nexrl_core.run.validation import run_validation
from nexrl_core.training.backend import (
    CONTEXT_KEY,
    TEACHER_BACKEND,
    Backend,
    BackendLost,
    BackendSetup,
    RolloutSetup,
    RolloutSource,
    backend_lost_reason,
)
from nexrl_core.training.model_export import FINAL_MODEL_DIR, ModelExportError, export_into

logger = logging.getLogger("nexrl.train")

CONFIG_FILE = "config.yaml"
RECIPE_DIR_FILE = "recipe_dir.txt"
"""The directory of the recipe a run was started from, where its relative data and agent
paths are also looked up; ``nexrl eval RUN`` reads it."""
BACKEND_DIR = "backend"
ROLLOUT_DIR = "rollout"
RESUMABLE_CHANGES = ("schedule.", "output.")
"""Recipe keys a resumed run may change (e.g. more steps); anything else must match."""
RUN_FILES = (
    METRICS_FILE,
    RUN_STATE_FILE,
    CONFIG_FILE,
    RECIPE_DIR_FILE,
    REWARD_CURVE_FILE,
    SINKS_DIR,
    BACKEND_DIR,
    ROLLOUT_DIR,
    FINAL_MODEL_DIR,
)
"""What a run writes in its output directory; ``--overwrite`` removes exactly these."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after a clean shutdown; the last checkpoint is intact."""

    def __init__(self, output_dir: Path, checkpoint_step: int | None) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.checkpoint_step = checkpoint_step


class TrainingGaveUp(RuntimeError):
    """The backend was lost and could not be restarted (restarts spent, or it cannot
    heal); the last checkpoint is intact and ``--resume`` continues from it."""

    def __init__(self, output_dir: Path, checkpoint_step: int | None, reason: str, restarts: int) -> None:
        super().__init__(reason)
        self.output_dir = output_dir
        self.checkpoint_step = checkpoint_step
        self.reason = reason
        self.restarts = restarts


RESTARTS_METRIC = "backend/restarts"
"""How many times the backend was restarted so far in the run, on every row after the first."""


@attrs.frozen(kw_only=True)
class RunSummary:
    """Where a finished run's results are."""

    output_dir: Path
    metrics_path: Path
    reward_curve: Path | None
    steps: int
    last_row: dict[str, Any] | None
    checkpoint_step: int | None
    final_model: Path | None = None
    """The final policy as a Hugging Face directory, or None when it was not written."""
    final_model_error: str | None = None
    """Why the final policy was not written (the checkpoints are intact)."""
    sinks: Mapping[str, str] = attrs.field(factory=dict)
    """Metrics sink name → where to look at its run (a sink turned off says why)."""


# --- building the pieces ---------------------------------------------------------------------------


def _component_spec(kind: str, name: str, key: str) -> Any:
    from nexrl_core.plugins.registry import UnknownComponentError, find_spec

    try:
        return find_spec(kind, name)
    except UnknownComponentError as error:
        raise ConfigError([f"{key}: {error}"]) from None


def open_backend(config: TrainConfig, options: Any, out_dir: Path) -> Backend:
    """The backend ``backend.name`` names, opened for this run (it may start services)."""
    assert config.backend.name is not None  # resolve_all_options refused a missing name
    spec = _component_spec("backends", config.backend.name, "backend.name")
    if config.teacher.model is not None and TEACHER_BACKEND not in spec.capabilities:
        raise ConfigError(
            [
                f"teacher.model: backend {config.backend.name!r} cannot hold a teacher model beside the student; "
                f"remove teacher or choose a backend with capability {TEACHER_BACKEND!r} (nexrl plugins lists them)"
            ]
        )
    work_dir = out_dir / BACKEND_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    backend: Backend = spec.open(BackendSetup(recipe=config, options=options, work_dir=work_dir))
    return backend


def open_rollout_source(config: TrainConfig, options: Any, backend: Backend, task: TaskData, out_dir: Path) -> RolloutSource:
    """The rollout source ``rollout.source.name`` names, sampling from the backend's chat model."""
    assert config.rollout.source.name is not None
    spec = _component_spec("rollout_sources", config.rollout.source.name, "rollout.source.name")
    work_dir = out_dir / ROLLOUT_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    setup = RolloutSetup(
        recipe=config,
        options=options,
        model=backend.chat_model(),
        agent=task.agent,
        work_dir=work_dir,
        backend_lost=lambda: backend_lost_reason(backend),
    )
    source: RolloutSource = spec.open(setup)
    return source


def check_context(config: TrainConfig, backend: Backend) -> None:
    """``rollout.max_tokens``, and ``rollout.max_prompt_tokens`` with it, fit the context
    the backend reports for its model (a remote service's model is known only once it
    answers; local models are checked before they load), by
    `nexrl_core.run.limits.context_problems`.

    :raises ConfigError: naming the key that does not fit.
    """
    context = backend.run_info().get(CONTEXT_KEY)
    if context is not None:
        problems = context_problems(config.rollout, config.model.name, int(context), "as the backend reports")
        if problems:
            raise ConfigError(problems)


def _remove_run_files(out_dir: Path) -> None:
    """Remove exactly what a run writes in ``out_dir`` (`RUN_FILES`)."""
    for name in RUN_FILES:
        target = out_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


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
        _remove_run_files(out_dir)
        logger.info("--overwrite: removed the previous run in %s; starting a fresh one", out_dir)
    return None


# --- the loop --------------------------------------------------------------------------------------


class TrainingLoop:
    """One run's steps: rollouts from the source, updates and weight syncs on the backend."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        backend: Backend,
        loader: DataLoader,
        runner: RolloutSource,
        metrics: MetricsLog,
        sinks: RunSinks,
        display: ProgressDisplay,
        out_dir: Path,
        state: RunState | None,
        restarts: int = 0,
    ) -> None:
        self.config = config
        self.restarts = restarts
        """Backend restarts before this loop started; every row of a run that had one
        says how many (`RESTARTS_METRIC`)."""
        self.backend = backend
        self.loader = loader
        self.runner = runner
        self.metrics = metrics
        self.sinks = sinks
        self.display = display
        self.out_dir = out_dir
        self.step = state.step if state else 0
        self.checkpoint_step: int | None = state.step if state else None
        self.total_errors = state.total_agent_errors if state else 0
        self.pending: dict[int, PendingBatch] = {}
        self.checkpoints: dict[int, str] = state.checkpoint_paths() if state else {}
        """Complete checkpoints by step; a save still running is in `saving`."""
        self.saving = PendingCheckpoints()
        self._frozen = False
        self._run_info = {} if state else {f"backend/{key}": value for key, value in backend.run_info().items()}
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
        validation = run_validation(self.runner, self.loader, step, temperature=self.config.rollout.val_temperature)
        if validation is None:
            return {}
        self._account(validation.batch, f"validation after step {step}")
        return validation.metrics()

    def _submit_until(self, last: int) -> None:
        while self.next_batch <= min(last, self.config.schedule.steps):
            step = self.next_batch
            self.pending[step] = self.runner.submit(step, self.loader.requests(step))
            self.next_batch += 1

    def checkpoint(self, step: int) -> None:
        """Start the backend's save of ``step`` and capture the run state as it stands
        now; both are recorded once the save has finished (`_record`)."""
        saved = self.backend.save_checkpoint(f"step_{step:06d}")
        pending = [self.pending[key].result().to_json() for key in sorted(self.pending)]
        state = RunState(
            step=step,
            checkpoint_path="",
            seed=self.config.seed,
            next_batch=self.next_batch,
            data_position=self.loader.position(self.next_batch),
            total_agent_errors=self.total_errors,
            metrics=list(self.metrics.rows),
            pending=pending,
            config=dump_config(self.config),
        )
        self.saving.add(step, saved, lambda path: self._record(state, path))

    def _record(self, state: RunState, path: str) -> None:
        """Name a finished checkpoint in the run state (saves finish here in step order)."""
        self.checkpoints[state.step] = path
        listed = [{"step": done, "path": where} for done, where in sorted(self.checkpoints.items())]
        save_run_state(self.out_dir, attrs.evolve(state, checkpoint_path=path, checkpoints=listed))
        self.checkpoint_step = state.step
        logger.info("checkpoint at step %d: %s", state.step, path)

    def _write(self, row: dict[str, Any]) -> None:
        """Log ``row``; the first row of a fresh run also says how the backend runs the model."""
        row.update(self._run_info)
        self._run_info = {}
        if self.restarts:
            row[RESTARTS_METRIC] = self.restarts
        self.metrics.write(row)
        self.sinks.log(row)

    # -- the run

    def run(self) -> None:
        schedule = self.config.schedule
        staleness = self.config.rollout.max_staleness
        if self.step == 0 and schedule.validate_every > 0:
            row = clean_row(0, self.validate(0))
            if len(row) > 1:
                self._write(row)
                self.display.step_done(row, None)
        for step in range(self.step + 1, schedule.steps + 1):
            interrupts.raise_if_asked()
            started = time.monotonic()
            self._submit_until(step + staleness)
            batch = self.pending.pop(step).result()
            rolled_out = time.monotonic()
            self._account(batch, f"step {step}")
            metrics = batch.metrics()
            metrics["rollout/agent_errors_total"] = float(self.total_errors)
            metrics.update(self.backend.train(batch.trajectories, step))
            trained = time.monotonic()
            for later in self.pending.values():  # batches sampled with the old weights finish first
                later.result()
            self.backend.sync_weights(step)
            finished = time.monotonic()
            step_seconds = finished - started
            metrics["time/rollout_s"] = rolled_out - started
            metrics["time/train_s"] = trained - rolled_out
            metrics["time/sync_s"] = finished - trained
            metrics["time/step_s"] = step_seconds
            metrics["perf/tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / step_seconds if step_seconds > 0 else 0.0
            if not self._frozen:
                # After a first step everything a step reuses (imports, tokenizer, SDK
                # clients) exists; full collections need not walk it again.
                freeze_long_lived_objects()
                self._frozen = True
            self.step = step
            if self._validate_due(step):
                metrics.update(self.validate(step))
            row = clean_row(step, metrics)
            self._write(row)
            self.display.step_done(row, step_seconds)
            interrupts.raise_if_asked()  # a stop asked for during the step starts no checkpoint
            if self._checkpoint_due(step):
                self.checkpoint(step)
            self.saving.harvest()
        self.saving.harvest(wait=True)


def write_final_model(backend: Backend, out_dir: Path) -> tuple[Path | None, str | None]:
    """Export the policy sampling used last to ``<out_dir>/final_model``; returns the
    directory, or None and the reason when the backend could not write it. A failed
    export does not fail the run: training is done and its checkpoints are intact."""
    target = out_dir / FINAL_MODEL_DIR
    try:
        written = export_into(backend, target)
    except ModelExportError as error:
        reason = str(error)
    except Exception as error:  # the run is done; report, keep the checkpoints
        logger.exception("exporting the final model failed")
        reason = f"{type(error).__name__}: {error}"
    else:
        logger.info("final model: %s", written)
        return written, None
    logger.error("the final model was not written: %s", reason)
    return None, reason


def _as_lost(backend: Backend, error: Exception) -> BackendLost | None:
    """``error`` as the loss of part of the backend, or None when it is not one: a
    `BackendLost`, or any error met while the backend says a part it started died
    (`WatchedBackend.lost`)."""
    if isinstance(error, BackendLost):
        return error
    reason = backend_lost_reason(backend)
    if reason is None:
        return None
    lost = BackendLost(reason)
    lost.__cause__ = error
    return lost


def _restart(backend: Backend, loop: TrainingLoop, out_dir: Path, lost: BackendLost, restarts: int) -> RunState | None:
    """Restart a lost backend from the last complete checkpoint; returns the run state
    to go on from (None: from the start, when no checkpoint was complete yet).

    :raises TrainingGaveUp: when the backend cannot restart (or will not: restarts spent).
    """
    with contextlib.suppress(Exception):  # a save that needed the lost part fails; the one before stays
        loop.saving.settle()
    for pending in loop.pending.values():  # rollouts already asked for finish against the sampler
        with contextlib.suppress(Exception):
            pending.result()
    restart = getattr(backend, "restart", None)
    state = load_run_state(out_dir)
    checkpoint_step = state.step if state else None
    if restart is None or not restart():
        raise TrainingGaveUp(out_dir, checkpoint_step, str(lost), restarts - 1) from lost
    logger.warning(
        "restart %d: %s; the backend restarted, going on from %s",
        restarts,
        lost,
        f"the checkpoint of step {checkpoint_step}" if state else "the start (no checkpoint was complete yet)",
    )
    if state is not None:
        backend.load_checkpoint(state.checkpoint_path)
    return state


def _check_resumable(state: RunState, config: TrainConfig) -> None:
    changed = [line for line in config_differences(state.config, dump_config(config)) if not line.startswith(RESUMABLE_CHANGES)]
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


@attrs.define
class _OpenParts:
    """What a run has opened so far; `close` closes each, whatever ended the run, in the
    order that lets each finish its work (saves, then rollouts, then logs, then sinks,
    then the backend the others use)."""

    backend: Backend | None = None
    runner: RolloutSource | None = None
    sinks: RunSinks | None = None
    metrics: MetricsLog | None = None
    display: ProgressDisplay | None = None
    loop: TrainingLoop | None = None

    def discard_unstarted(self, out_dir: Path) -> None:
        """A fresh run that never started: close what opened and leave nothing that
        blocks running the fixed command again."""
        if self.backend is not None:
            _close_quietly("backend", self.backend.close)
            self.backend = None
        if self.sinks is not None:
            sinks = self.sinks
            _close_quietly("metrics sinks", lambda: sinks.close(RunOutcome.FAILED))
            self.sinks = None
        _remove_run_files(out_dir)
        if not any(out_dir.iterdir()):
            out_dir.rmdir()

    def close(self, outcome: RunOutcome, out_dir: Path) -> None:
        if self.loop is not None:
            _close_quietly("checkpoints", self.loop.saving.settle)
        if self.runner is not None:
            _close_quietly("rollout source", self.runner.close)
        if self.display is not None:
            _close_quietly("progress display", self.display.close)
        if self.metrics is not None:
            metrics = self.metrics
            _close_quietly("metrics log", metrics.close)
            _close_quietly("reward curve", lambda: plot_reward_curve(metrics.rows, out_dir / REWARD_CURVE_FILE))
        if self.sinks is not None:
            sinks = self.sinks
            _close_quietly("metrics sinks", lambda: sinks.close(outcome))
        if self.backend is not None:
            _close_quietly("backend", self.backend.close)


def _open_parts(
    parts: _OpenParts,
    config: TrainConfig,
    options: Mapping[str, Any],
    chosen_sinks: Any,
    task: TaskData,
    out_dir: Path,
    state: RunState | None,
) -> None:
    """Open the run's sinks, backend (at the checkpoint resumed from) and rollout source
    into ``parts``; a fresh run the recipe's components refuse leaves nothing behind.

    :raises ConfigError, ServiceStartError: what refused the recipe.
    """
    try:
        parts.sinks = open_sinks(config, chosen_sinks, out_dir, resumed_from=state.step if state else None)
        parts.backend = open_backend(config, options["backend"], out_dir)
        check_context(config, parts.backend)
        if state is not None:
            logger.info("resuming from step %d (%s)", state.step, state.checkpoint_path)
            parts.backend.load_checkpoint(state.checkpoint_path)
        parts.runner = open_rollout_source(config, options["rollout.source"], parts.backend, task, out_dir)
    except (ConfigError, ServiceStartError):
        if state is None:
            parts.discard_unstarted(out_dir)
        raise


def _train(
    config: TrainConfig, parts: _OpenParts, loader: DataLoader, out_dir: Path, state: RunState | None, progress_bar: bool | None
) -> None:
    """The steps from ``state`` on; a lost backend restarts from the last complete
    checkpoint (`_restart`) and the steps go on from there."""
    assert parts.backend is not None and parts.runner is not None and parts.sinks is not None
    restarts = 0
    while True:
        parts.metrics = MetricsLog(out_dir, rows=state.metrics if state else ())
        parts.display = ProgressDisplay(config.schedule.steps, state.step if state else 0, bar=progress_bar)
        parts.loop = TrainingLoop(
            config,
            backend=parts.backend,
            loader=loader,
            runner=parts.runner,
            metrics=parts.metrics,
            sinks=parts.sinks,
            display=parts.display,
            out_dir=out_dir,
            state=state,
            restarts=restarts,
        )
        try:
            parts.loop.run()
            return
        except Exception as error:
            lost = _as_lost(parts.backend, error)
            if lost is None:
                raise
            restarts += 1
            state = _restart(parts.backend, parts.loop, out_dir, lost, restarts)
            _close_quietly("progress display", parts.display.close)
            _close_quietly("metrics log", parts.metrics.close)


def _completed_summary(out_dir: Path, state: RunState) -> RunSummary:
    """A resumed run whose steps were all done already: what it left."""
    logger.info("the run in %s already completed %d steps; nothing to do", out_dir, state.step)
    curve = plot_reward_curve(state.metrics, out_dir / REWARD_CURVE_FILE)
    return RunSummary(
        output_dir=out_dir,
        metrics_path=out_dir / METRICS_FILE,
        reward_curve=curve,
        steps=state.step,
        last_row=state.metrics[-1] if state.metrics else None,
        checkpoint_step=state.step,
        final_model=out_dir / FINAL_MODEL_DIR if (out_dir / FINAL_MODEL_DIR).is_dir() else None,
    )


def run_training(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    recipe_dir: Path | None = None,
    progress_bar: bool | None = None,
) -> RunSummary:
    """Run (or resume) the training a recipe describes.

    :param recipe_dir: where relative data and agent paths are also looked up.
    :param progress_bar: force the live bar on or off (default: on a terminal, not under CI).
    :raises ConfigError: for a bad recipe, before anything is started.
    :raises TrainingError: when the output directory does not fit ``resume``/``overwrite``.
    :raises RolloutError: when agent failures exceed the error budget.
    :raises CheckpointError: naming the step, when a checkpoint's save failed.
    :raises TrainingInterrupted: on Ctrl-C, after a clean shutdown.
    """
    from nexrl_core.config.components import check_recipe_with_components, resolve_all_options

    out_dir = Path(config.output.dir)
    options = resolve_all_options(config)
    check_recipe_with_components(config, options)
    chosen_sinks = resolve_sinks(config)
    state = prepare_output(out_dir, resume, overwrite)
    if state is not None:
        _check_resumable(state, config)
    task = resolve_task(config.task, config.seed, recipe_dir)
    loader = DataLoader(task, config.rollout.prompts_per_step, config.rollout.group_size, config.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    import yaml

    write_atomic(out_dir / CONFIG_FILE, yaml.safe_dump(dump_config(config), sort_keys=False))
    if recipe_dir is not None:
        write_atomic(out_dir / RECIPE_DIR_FILE, f"{recipe_dir.resolve()}\n")
    if state is not None and state.step >= config.schedule.steps:
        return _completed_summary(out_dir, state)

    parts = _OpenParts()
    outcome = RunOutcome.FAILED
    final_model: Path | None = None
    final_model_error: str | None = None
    try:
        _open_parts(parts, config, options, chosen_sinks, task, out_dir, state)
        _train(config, parts, loader, out_dir, state, progress_bar)
        assert parts.backend is not None and parts.sinks is not None, "_open_parts opened both"
        final_model, final_model_error = write_final_model(parts.backend, out_dir)
        if final_model is not None:
            parts.sinks.log_final_model(final_model)
        outcome = RunOutcome.FINISHED
    except KeyboardInterrupt:
        outcome = RunOutcome.INTERRUPTED
        loop = parts.loop
        if loop is not None:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C stops waiting for saves
                loop.saving.settle()
        checkpoint_step = loop.checkpoint_step if loop else (state.step if state else None)
        raise TrainingInterrupted(out_dir, checkpoint_step) from None
    finally:
        parts.close(outcome, out_dir)

    rows = parts.metrics.rows if parts.metrics else []
    curve = out_dir / REWARD_CURVE_FILE
    return RunSummary(
        output_dir=out_dir,
        metrics_path=out_dir / METRICS_FILE,
        reward_curve=curve if curve.exists() else None,
        steps=parts.loop.step if parts.loop else 0,
        last_row=rows[-1] if rows else None,
        checkpoint_step=parts.loop.checkpoint_step if parts.loop else None,
        final_model=final_model,
        final_model_error=final_model_error,
        sinks=parts.sinks.locations() if parts.sinks else {},
    )


def row_summary(row: Mapping[str, Any] | None) -> str:
    if not row:
        return "no metrics"
    parts = [f"step {row['step']}"]
    for key in ("reward/mean", "val/reward/mean"):
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.3f}")
    return ", ".join(parts)
