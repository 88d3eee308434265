"""``nexrl export``: the model of any checkpoint of a run, as a Hugging Face directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from nexrl_core.commands.config import USAGE_ERROR_EXIT_CODE
from nexrl_core.config import ConfigError


def export_checkpoint(run_dir: Path, step: int | None = None, out: Path | None = None) -> Path:
    """Open the run's backend from its saved recipe, load the checkpoint of ``step``
    (default: the last) and write its policy to ``out`` (default
    ``<run_dir>/export_step_<step>``), the same directory ``nexrl train`` leaves in
    ``final_model``; returns where it went.

    :raises TrainingError: for a missing run directory, recipe or checkpoint.
    :raises ConfigError: when the saved recipe no longer opens a backend here.
    :raises ModelExportError: when the backend cannot export.
    """
    from nexrl_core.config import load_config
    from nexrl_core.config.components import resolve_options
    from nexrl_core.run.loop import CONFIG_FILE, open_backend
    from nexrl_core.run.state import RUN_STATE_FILE, TrainingError, load_run_state
    from nexrl_core.training.model_export import export_into

    if not run_dir.is_dir():
        raise TrainingError(f"{run_dir} does not exist; pass the output.dir of a `nexrl train` run")
    recipe = run_dir / CONFIG_FILE
    if not recipe.is_file():
        raise TrainingError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE} (`nexrl train` writes one)")
    state = load_run_state(run_dir)
    if state is None:
        raise TrainingError(
            f"{run_dir} has no checkpoint ({RUN_STATE_FILE} is missing): a run saves one every "
            "schedule.checkpoint_every steps and at its last step"
        )
    checkpoints = state.checkpoint_paths()
    if step is None:
        step = max(checkpoints)
    elif step not in checkpoints:
        raise TrainingError(f"{run_dir} has no checkpoint of step {step}; steps with a checkpoint: {', '.join(map(str, checkpoints))}")
    config = load_config(recipe, [])
    backend = open_backend(config, resolve_options("backends", config.backend, "backend"), run_dir)
    try:
        backend.load_checkpoint(checkpoints[step])
        return export_into(backend, out if out is not None else run_dir / f"export_step_{step}")
    finally:
        backend.close()


def export_service_checkpoint(path: str, recipe: Path | None, overrides: Sequence[str], out: Path) -> Path:
    """Open the backend a recipe names, load a service's own checkpoint ``path``
    (``tinker://...``, ``weaver://...``) into it, and write that policy to ``out``
    through the backend's own download API; returns ``out``.

    :raises ConfigError: for a bad recipe, or a backend that cannot open.
    :raises ModelExportError: when the backend cannot export.
    """
    import tempfile

    from nexrl_core.config import load_config
    from nexrl_core.config.components import resolve_options
    from nexrl_core.run.loop import open_backend
    from nexrl_core.training.model_export import export_into

    config = load_config(recipe, list(overrides))
    with tempfile.TemporaryDirectory(prefix="nexrl-export-") as work:
        backend = open_backend(config, resolve_options("backends", config.backend, "backend"), Path(work))
        try:
            backend.load_checkpoint(path)
            return export_into(backend, out)
        finally:
            backend.close()


@click.command()
@click.argument("run_dir", metavar="RUN_DIR_OR_PATH")
@click.option("--step", type=click.IntRange(min=0), default=None, help="Checkpoint to export [default: the last].")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory to write (replaced if it exists) [default: RUN_DIR/export_step_<STEP>].",
)
@click.option(
    "--recipe",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="With a service path: the recipe whose backend reaches that service.",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="With a service path: recipe overrides.")
@click.pass_context
def export(ctx: click.Context, run_dir: str, step: int | None, out: Path | None, recipe: Path | None, overrides: tuple[str, ...]) -> None:
    """Write the policy of a checkpoint of the run in RUN_DIR as a Hugging Face directory.

    Instead of a run directory, a service's own checkpoint path (tinker://..., weaver://...)
    works with --recipe (and --set KEY=VALUE overrides) naming the backend that reaches the
    service; the backend downloads the weights through the service's own API.

    The directory is what `nexrl train` leaves in RUN_DIR/final_model: weights, config,
    tokenizer and chat template (LoRA merged, the adapter also in adapter/), loadable with
    transformers.AutoModelForCausalLM.from_pretrained. The run's own backend writes it,
    opened from the run's saved recipe (RUN_DIR/config.yaml).
    """
    from nexrl_core.commands.train import configure_logging
    from nexrl_core.plugins.registry import RegistryError
    from nexrl_core.run.state import TrainingError
    from nexrl_core.training.model_export import ModelExportError

    configure_logging()
    try:
        if "://" in run_dir:
            if recipe is None or step is not None:
                raise click.UsageError("a service checkpoint path needs --recipe (and takes no --step)")
            written = export_service_checkpoint(run_dir, recipe, overrides, out or Path("export"))
        else:
            written = export_checkpoint(Path(run_dir), step, out)
    except ConfigError as error:
        source = recipe if "://" in run_dir else Path(run_dir) / "config.yaml"
        click.echo(f"the recipe {source} does not open a backend here:\n{error}", err=True)
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    except (TrainingError, ModelExportError, RegistryError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(str(written))
