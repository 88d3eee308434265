"""``nexrl eval``: score a model on a task's held-out items without training.

A recipe (or a run's saved one) says the task, the agent, the backend and the sampling
settings; `ModelChoice` says which weights to sample from: the recipe's base model, a
Hugging Face directory (a run's ``final_model``), or a checkpoint of a run loaded into
the run's own backend. The held-out items go through the same code as a run's
validation (`nexrl_core.run.validation`), with the same seeds and ``rollout.val_temperature``,
so the final model of a run scores what the run's last validation logged. Several
samples per item (``samples``) give pass@k; sample 0 of each item is the run that
validation makes.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.run.data import DataLoader, resolve_task
from nexrl_core.run.metrics import write_atomic
from nexrl_core.run.rollout import RolloutBatch, check_error_budget
from nexrl_core.run.validation import Validation, run_validation

EVAL_DIR = "eval"
"""Where, in a run's (or a recipe's) output directory, reports go by default."""


@attrs.frozen(kw_only=True)
class ModelChoice:
    """Which weights an evaluation samples from."""

    label: str
    """Short name for the report's file (``base``, ``final_model``, ``step_20``)."""
    description: str
    """What the report says was evaluated."""
    model_dir: str | None = None
    """Replaces the recipe's ``model.name`` (a Hugging Face directory, or a name the backend knows)."""
    checkpoint: str | None = None
    """A run's checkpoint, loaded into the backend with ``load_checkpoint`` before sampling."""
    backend_dir: Path | None = None
    """The run directory whose ``backend/`` the backend opens (a checkpoint may live
    there, e.g. in an embedded service's store); None: a temporary one."""
    step: int = 0
    """The training step the weights are from, as the runs' ``step`` (seeds do not depend on it)."""


@attrs.frozen(kw_only=True)
class ItemResult:
    """Every sample of one held-out item."""

    task_id: str
    rewards: list[float | None]
    """One per sample; None where the agent failed."""
    response_tokens: list[int]


@attrs.frozen(kw_only=True)
class EvalReport:
    """What ``nexrl eval`` prints and writes as JSON."""

    model: str
    recipe: str
    items: int
    samples: int
    """Samples (agent runs) per item."""
    temperature: float
    seed: int
    pass_reward: float
    """A sample passes when its reward is at least this."""
    reward_mean: float | None
    """Mean reward over every sample that did not fail; None when all failed."""
    pass_at_k: dict[str, float]
    """``pass@k`` → the unbiased estimate, averaged over items, for k = 1, 2, 4, ... and ``samples``."""
    response_tokens_per_sample: float
    seconds_per_item: float
    """Wall-clock seconds of the whole pass over the number of items (samples run concurrently)."""
    agent_errors: int
    metrics: dict[str, float]
    """The ``val/`` metrics a run's validation logs for the same pass."""
    per_item: list[ItemResult]

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def pass_at_k(samples: int, passed: int, k: int) -> float:
    """The chance that at least one of ``k`` samples, drawn without replacement from
    ``samples`` of which ``passed`` passed, passes: 1 - C(n-c, k) / C(n, k). Unbiased,
    unlike 1 - (1 - c/n)^k."""
    if not 0 < k <= samples:
        raise ValueError(f"pass@k needs 0 < k <= samples, got k={k}, samples={samples}")
    if samples - passed < k:
        return 1.0
    return 1.0 - math.comb(samples - passed, k) / math.comb(samples, k)


def pass_at_k_sizes(samples: int) -> list[int]:
    """The k reported: powers of two below ``samples``, and ``samples`` itself."""
    sizes = [1 << power for power in range(samples.bit_length()) if 1 << power < samples]
    return sizes + [samples]


def item_results(batch: RolloutBatch, samples: int) -> list[ItemResult]:
    """The batch's runs grouped by item, in item order (runs arrive in request order)."""
    results = []
    for start in range(0, len(batch.runs), samples):
        runs = batch.runs[start : start + samples]
        results.append(
            ItemResult(
                task_id=runs[0].task_id,
                rewards=[run.reward for run in runs],
                response_tokens=[run.response_tokens for run in runs],
            )
        )
    return results


def build_report(validation: Validation, *, model: str, recipe: str, temperature: float, seed: int, pass_reward: float) -> EvalReport:
    """Summarise one pass: mean reward, pass@k, tokens and time per item."""
    per_item = item_results(validation.batch, validation.samples)
    passed = [sum(reward is not None and reward >= pass_reward for reward in item.rewards) for item in per_item]
    metrics = validation.metrics()
    runs = validation.batch.runs
    return EvalReport(
        model=model,
        recipe=recipe,
        items=validation.items,
        samples=validation.samples,
        temperature=temperature,
        seed=seed,
        pass_reward=pass_reward,
        reward_mean=metrics.get("val/reward/mean"),
        pass_at_k={
            f"pass@{k}": math.fsum(pass_at_k(validation.samples, count, k) for count in passed) / len(per_item)
            for k in pass_at_k_sizes(validation.samples)
        },
        response_tokens_per_sample=sum(run.response_tokens for run in runs) / len(runs),
        seconds_per_item=validation.seconds / validation.items,
        agent_errors=len(validation.batch.errors),
        metrics=metrics,
        per_item=per_item,
    )


def evaluate(
    config: TrainConfig,
    choice: ModelChoice,
    *,
    samples: int = 1,
    pass_reward: float = 1.0,
    recipe_dir: Path | None = None,
    recipe: str = "",
) -> EvalReport:
    """Run the task's held-out items ``samples`` times each through the recipe's agent
    against the chosen model, on the recipe's backend and rollout source.

    :raises ConfigError: for a bad recipe or data, or a task without held-out items,
        before any model is loaded.
    :raises RolloutError: when more agent runs fail than ``rollout.error_budget`` allows.
    """
    from nexrl_core.config.components import resolve_all_options
    from nexrl_core.run.loop import check_context, open_backend, open_rollout_source

    if samples < 1:
        raise ConfigError([f"--samples: must be at least 1, got {samples}"])
    if choice.model_dir is not None:
        config = attrs.evolve(config, model=attrs.evolve(config.model, name=choice.model_dir))
    options = resolve_all_options(config)
    task = resolve_task(config.task, config.seed, recipe_dir)
    if not task.val_items:
        raise ConfigError(["task: no held-out items to evaluate on; set task.val_data_path (or a registered task.name), or pass --data"])
    loader = DataLoader(task, config.rollout.prompts_per_step, config.rollout.group_size, config.seed)
    with tempfile.TemporaryDirectory(prefix="nexrl-eval-") as scratch:
        backend = open_backend(config, options["backend"], choice.backend_dir or Path(scratch))
        try:
            check_context(config, backend)
            if choice.checkpoint is not None:
                backend.load_checkpoint(choice.checkpoint)
            runner = open_rollout_source(config, options["rollout.source"], backend, task, Path(scratch))
            try:
                validation = run_validation(runner, loader, choice.step, temperature=config.rollout.val_temperature, samples=samples)
            finally:
                runner.close()
        finally:
            backend.close()
    assert validation is not None  # the task has held-out items
    errors = len(validation.batch.errors)
    check_error_budget(
        validation.batch,
        fraction=config.rollout.error_budget,
        total_errors=errors,
        max_total=config.rollout.max_agent_errors,
        what="the evaluation",
    )
    return build_report(
        validation,
        model=choice.description,
        recipe=recipe,
        temperature=config.rollout.val_temperature,
        seed=config.seed,
        pass_reward=pass_reward,
    )


def write_report(report: EvalReport, path: Path) -> Path:
    """The report as indented JSON at ``path`` (written atomically, directories created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(report.to_json(), indent=1) + "\n")
    return path


def report_rows(report: EvalReport) -> list[tuple[str, str]]:
    """(what, value) lines of the printed table."""
    rows = [
        ("model", report.model),
        ("items x samples", f"{report.items} x {report.samples}"),
        ("temperature, seed", f"{report.temperature:g}, {report.seed}"),
        ("mean reward", "-" if report.reward_mean is None else f"{report.reward_mean:.4f}"),
    ]
    rows += [(f"{name} (reward >= {report.pass_reward:g})", f"{value:.4f}") for name, value in report.pass_at_k.items()]
    rows += [
        ("response tokens / sample", f"{report.response_tokens_per_sample:.1f}"),
        ("seconds / item", f"{report.seconds_per_item:.3f}"),
        ("agent errors", str(report.agent_errors)),
    ]
    return rows
