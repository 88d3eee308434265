"""``nexrl train``: run the RL loop a recipe describes."""

from __future__ import annotations

import faulthandler
import logging
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import click

from nexrl_core.commands.config import USAGE_ERROR_EXIT_CODE, split_file_and_overrides
from nexrl_core.config import ConfigError, load_config
from nexrl_core.http.serving import ServiceStartError
from nexrl_core.run import interrupts

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C, as shells report SIGINT."""

QUICKSTART = "quickstart.yaml"


def quickstart_recipe(stack: ExitStack) -> Path:
    """The built-in recipe shipped as package data, as a file path valid while ``stack`` is open."""
    from importlib.resources import as_file, files

    return stack.enter_context(as_file(files("nexrl_core") / "recipes" / QUICKSTART))


def configure_logging() -> None:
    """NexRL's progress messages on stderr; other libraries' warnings only."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("nexrl").setLevel(logging.INFO)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM (``kill``, a job scheduler) like Ctrl-C, so the run shuts down cleanly,
    and keep either asked for (`nexrl_core.run.interrupts`) should the exception be lost;
    SIGUSR1 dumps every thread's stack, so a run that hangs can say where."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        interrupts.ask()
        raise KeyboardInterrupt

    interrupts.forget()
    previous_int = signal.signal(signal.SIGINT, interrupt) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else None
    previous = signal.signal(signal.SIGTERM, interrupt)
    # ``kill -USR1`` prints every thread's stack to the process's own stderr (a stream
    # standing in for it, as click's test runner gives, has no file descriptor to write to;
    # a process started without a stderr has nowhere to print it).
    if sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        interrupts.forget()
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)


@click.command()
@click.argument("arguments", nargs=-1, metavar="[RECIPE] [KEY=VALUE]...")
@click.option("--resume", is_flag=True, help="Continue the run in output.dir from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Start over, deleting a previous run's files in output.dir.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Force the live progress bar on or off [default: on a terminal, off under CI].",
)
@click.pass_context
def train(ctx: click.Context, arguments: tuple[str, ...], resume: bool, overwrite: bool, progress: bool | None) -> None:
    """Train with the recipe RECIPE (YAML), or the built-in quickstart when none is given.

    Each KEY=VALUE overrides one recipe value by its dotted path, e.g.
    rollout.group_size=4 or schedule.steps=10; VALUE is YAML. Results go to output.dir:
    metrics.jsonl, reward_curve.png, checkpoints, final_model (the trained policy as a
    Hugging Face directory) and what the metrics sinks in output.sinks write. Ctrl-C (or SIGTERM)
    stops cleanly and keeps the last checkpoint; --resume continues from it.
    """
    from nexrl_core.plugins.registry import RegistryError
    from nexrl_core.run.checkpoints import CheckpointError
    from nexrl_core.run.loop import TrainingGaveUp, TrainingInterrupted, row_summary, run_training
    from nexrl_core.run.rollout import RolloutError
    from nexrl_core.run.state import TrainingError
    from nexrl_core.training.backend import BackendStartError

    path, overrides = split_file_and_overrides(arguments)
    with ExitStack() as stack:
        recipe = Path(path) if path is not None else quickstart_recipe(stack)
        try:
            config = load_config(recipe, overrides)
        except ConfigError as error:
            click.echo(str(error), err=True)
            ctx.exit(USAGE_ERROR_EXIT_CODE)
        if path is None:
            click.echo(f"no recipe given: running the built-in quickstart ({QUICKSTART}) into {config.output.dir}")
        configure_logging()
        stack.enter_context(_sigterm_as_interrupt())
        try:
            summary = run_training(
                config,
                resume=resume,
                overwrite=overwrite,
                recipe_dir=recipe.parent if path is not None else None,
                progress_bar=progress,
            )
        except (ConfigError, ServiceStartError, TrainingError, BackendStartError) as error:  # the input: recipe, output dir, flags
            click.echo(f"Error: {error}" if isinstance(error, (TrainingError, BackendStartError)) else str(error), err=True)
            ctx.exit(USAGE_ERROR_EXIT_CODE)
        except (RolloutError, RegistryError, CheckpointError) as error:
            raise click.ClickException(str(error)) from error
        except TrainingGaveUp as gave_up:
            again = shlex.join(["nexrl", "train", *arguments, "--resume"])
            where = (
                f"the last checkpoint (step {gave_up.checkpoint_step}) is intact; continue with: {again}"
                if gave_up.checkpoint_step is not None
                else f"no checkpoint was complete yet; start again with: {shlex.join(['nexrl', 'train', *arguments])}"
            )
            click.echo(f"Error: {gave_up.reason} (after {gave_up.restarts} restarts); {where}", err=True)
            ctx.exit(1)
        except TrainingInterrupted as interrupted:
            again = shlex.join(["nexrl", "train", *arguments, "--resume"])
            where = (
                f"the last checkpoint (step {interrupted.checkpoint_step}) is intact; continue with: {again}"
                if interrupted.checkpoint_step is not None
                else "no checkpoint was saved yet"
            )
            click.echo(f"\ninterrupted: {where}", err=True)
            ctx.exit(INTERRUPTED_EXIT_CODE)

    click.echo(f"done: {summary.steps} steps ({row_summary(summary.last_row)})")
    click.echo(f"metrics:      {summary.metrics_path}")
    if summary.reward_curve is not None:
        click.echo(f"reward curve: {summary.reward_curve}")
    for sink, where in summary.sinks.items():
        click.echo(f"{sink + ':':<13} {where}")
    if summary.final_model is not None:
        click.echo(f"final model:  {summary.final_model}  (a Hugging Face directory: AutoModelForCausalLM.from_pretrained)")
    elif summary.final_model_error is not None:
        click.echo(
            f"final model:  not written: {summary.final_model_error}\n"
            f"              the checkpoints are intact; try: nexrl export {summary.output_dir}"
        )
