"""``nexrl eval``: score a base model, a run's final model or a checkpoint on held-out items."""

from __future__ import annotations

from pathlib import Path

import attrs
import click

from nexrl_core.commands.config import USAGE_ERROR_EXIT_CODE
from nexrl_core.config import ConfigError, TrainConfig, load_config
from nexrl_core.http.serving import ServiceStartError
from nexrl_core.run.evaluation import EVAL_DIR, ModelChoice

TEACHER_LABEL = "teacher"


@attrs.frozen(kw_only=True)
class EvalTarget:
    """What the command line names: a recipe or a run, and where its relative paths start."""

    recipe: Path
    run_dir: Path | None
    recipe_dir: Path | None


def find_target(path: Path) -> EvalTarget:
    """A run directory (it holds the ``config.yaml`` ``nexrl train`` wrote) or a recipe file.

    :raises TrainingError: for anything else.
    """
    from nexrl_core.run.loop import CONFIG_FILE, RECIPE_DIR_FILE
    from nexrl_core.run.state import TrainingError

    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise TrainingError(f"{path} is a directory but not a run: it has no {CONFIG_FILE} (`nexrl train` writes one)")
        recorded = path / RECIPE_DIR_FILE
        recipe_dir = Path(recorded.read_text(encoding="utf-8").strip()) if recorded.is_file() else None
        return EvalTarget(recipe=path / CONFIG_FILE, run_dir=path, recipe_dir=recipe_dir)
    if not path.is_file():
        raise TrainingError(f"{path} does not exist; pass a recipe (YAML) or the output.dir of a `nexrl train` run")
    return EvalTarget(recipe=path, run_dir=None, recipe_dir=path.parent)


def choose_model(target: EvalTarget, config: TrainConfig, model: str | None, step: int | None) -> ModelChoice:
    """``--model``, else ``--step`` of the run, else the run's ``final_model``, else the recipe's base model.

    :raises TrainingError: for a checkpoint or final model the run does not have.
    """
    from nexrl_core.run.state import TrainingError, load_run_state
    from nexrl_core.training.model_export import FINAL_MODEL_DIR

    if model is not None:
        return named_model(model, label=f"model-{Path(model).expanduser().name or 'root'}")
    if step is not None:
        if target.run_dir is None:
            raise TrainingError("--step picks a checkpoint of a run: pass the run's output directory, not a recipe")
        state = load_run_state(target.run_dir)
        checkpoints = state.checkpoint_paths() if state is not None else {}
        if step not in checkpoints:
            saved = ", ".join(map(str, checkpoints)) or "none"
            raise TrainingError(f"{target.run_dir} has no checkpoint of step {step}; steps with a checkpoint: {saved}")
        return ModelChoice(
            label=f"step_{step}",
            description=f"checkpoint of step {step} of {target.run_dir}",
            checkpoint=checkpoints[step],
            backend_dir=target.run_dir,
            step=step,
        )
    if target.run_dir is not None:
        final = target.run_dir / FINAL_MODEL_DIR
        if not final.is_dir():
            raise TrainingError(
                f"{target.run_dir} has no {FINAL_MODEL_DIR} (the run has not finished, or its backend could not "
                "export); evaluate a checkpoint with --step N"
            )
        return ModelChoice(label=FINAL_MODEL_DIR, description=str(final.resolve()), model_dir=str(final.resolve()))
    return ModelChoice(label="base", description=f"base model {config.model.name}")


def named_model(model: str, *, label: str) -> ModelChoice:
    """A Hugging Face directory (by its absolute path) or a name the backend knows."""
    local = Path(model).expanduser()
    name = str(local.resolve()) if local.is_dir() else model
    return ModelChoice(label=label, description=name, model_dir=name)


def teacher_model(config: TrainConfig) -> ModelChoice:
    """The recipe's ``teacher.model``, for ``--teacher``.

    :raises TrainingError: when the recipe has no teacher.
    """
    from nexrl_core.run.state import TrainingError

    if config.teacher.model is None:
        raise TrainingError("--teacher scores the recipe's teacher.model, and the recipe sets none; set teacher.model=DIR")
    return named_model(config.teacher.model, label=TEACHER_LABEL)


def teacher_report_path(model_report: Path) -> Path:
    """The teacher's report, beside the model's: ``<model report>-teacher.json``."""
    return model_report.with_name(f"{model_report.stem}-{TEACHER_LABEL}{model_report.suffix}")


def default_report_path(target: EvalTarget, config: TrainConfig, choice: ModelChoice, data: str | None, samples: int) -> Path:
    """``<run or output.dir>/eval/<model>[-<data>][-samples<K>].json``, so different evaluations keep their reports."""
    base = target.run_dir if target.run_dir is not None else Path(config.output.dir)
    name = choice.label + (f"-{Path(data).stem}" if data is not None else "") + (f"-samples{samples}" if samples > 1 else "")
    return base / EVAL_DIR / f"{name}.json"


@click.command(name="eval")
@click.argument("target_path", metavar="RECIPE_OR_RUN", type=click.Path(path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--model", default=None, help="A Hugging Face model directory (or a model name the backend knows) to evaluate.")
@click.option("--step", type=click.IntRange(min=0), default=None, help="Evaluate the run's checkpoint of this step.")
@click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True, help="Samples per item (pass@k up to k=SAMPLES).")
@click.option(
    "--data",
    default=None,
    help="Held-out items to use instead of the recipe's: a JSONL or parquet file, or a save_to_disk directory (other forms: task.val_data_path={...}).",
)
@click.option("--pass-reward", type=float, default=1.0, show_default=True, help="A sample passes when its reward is at least this.")
@click.option(
    "--teacher",
    is_flag=True,
    help="Also score the recipe's teacher.model on the same items, printed beside the model (its report: <report>-teacher.json).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="JSON report [default: RUN_OR_OUTPUT_DIR/eval/<model>[-<data>][-samples<K>].json].",
)
@click.pass_context
def eval_command(
    ctx: click.Context,
    target_path: Path,
    overrides: tuple[str, ...],
    model: str | None,
    step: int | None,
    samples: int,
    data: str | None,
    pass_reward: float,
    teacher: bool,
    out: Path | None,
) -> None:
    """Score a model on the held-out items of RECIPE_OR_RUN's task, without training.

    RECIPE_OR_RUN is a recipe (YAML) or a run's output directory. The model is, in this
    order: --model DIR, the run's checkpoint of --step N, the run's final_model, or the
    recipe's base model. Items, agent, backend, seed and rollout.val_temperature come
    from the recipe (KEY=VALUE overrides it), so the final model of a run scores what
    the run's last validation logged. Prints a table and writes a JSON report: mean
    reward, pass@k (unbiased), response tokens per sample, seconds per item. With
    --teacher, a distillation run's teacher is scored too, side by side with the student.
    """
    from rich.console import Console
    from rich.table import Table

    from nexrl_core.commands.train import configure_logging
    from nexrl_core.plugins.registry import RegistryError
    from nexrl_core.run.evaluation import evaluate, report_rows, write_report
    from nexrl_core.run.rollout import RolloutError
    from nexrl_core.run.state import TrainingError

    if model is not None and step is not None:
        raise click.UsageError("--model and --step each name the model; give one")
    configure_logging()
    try:
        target = find_target(target_path)
        config = load_config(target.recipe, list(overrides))
        if data is not None:
            config = attrs.evolve(config, task=attrs.evolve(config.task, val_data_path=data))
        choices = [choose_model(target, config, model, step)] + ([teacher_model(config)] if teacher else [])
        reports = [
            evaluate(config, choice, samples=samples, pass_reward=pass_reward, recipe_dir=target.recipe_dir, recipe=str(target.recipe))
            for choice in choices
        ]
    except (ConfigError, ServiceStartError) as error:
        click.echo(str(error), err=True)
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    except (TrainingError, RolloutError, RegistryError) as error:
        raise click.ClickException(str(error)) from error
    first = out if out is not None else default_report_path(target, config, choices[0], data, samples)
    paths = [first, teacher_report_path(first)][: len(reports)]
    written = [write_report(report, path) for report, path in zip(reports, paths, strict=True)]
    table = Table(title="nexrl eval", show_header=teacher)
    table.add_column("what")
    for choice in choices:
        table.add_column(choice.label)
    for rows in zip(*(report_rows(report) for report in reports), strict=True):
        table.add_row(rows[0][0], *(value for _, value in rows))
    Console().print(table)
    for path in written:
        click.echo(f"report: {path}")
