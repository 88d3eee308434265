"""``nexrl convert-v1``: a NexRL v1 recipe as a NexRL recipe, with what could not be carried."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nexrl_core.commands.config import USAGE_ERROR_EXIT_CODE


def _header(source: str, choose: list[str]) -> str:
    """The converted file's opening comment: where it came from, and each choice left to the user."""
    lines = [f"# Converted from the NexRL v1 recipe {source} by `nexrl convert-v1`.", "# docs/coming-from-v1.md maps every v1 key."]
    if choose:
        lines.append("# Where v1 trained otherwise than its recipe said, this file holds what the recipe said:")
        lines.extend(f"#   {line}" for line in choose)
    return "\n".join(lines) + "\n\n"


def _convert_launch_lines(ctx: click.Context, lines: tuple[str, ...]) -> None:
    """``--launch``: the NexRL command lines on standard output, what to know on standard
    error; with a line that cannot be carried, nothing on standard output and status 2."""
    from nexrl_core.v1.launch import LaunchError, convert_launch

    conversions, problems = [], []
    for line in lines:
        try:
            conversions.append(convert_launch(line))
        except LaunchError as error:
            problems += error.problems
    if problems:
        click.echo("\n".join(f"nexrl convert-v1: {problem}" for problem in problems), err=True)
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    notes = dict.fromkeys(note for conversion in conversions for note in conversion.notes)
    click.echo("\n".join(f"# {note}" for note in notes), err=True)
    click.echo("\n".join(line for conversion in conversions for line in conversion.lines()))


@click.command("convert-v1")
@click.argument("recipe", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the NexRL recipe here [default: standard output]."
)
@click.option("--agent", metavar="MODULE:FUNCTION", help="The NexRL agent that replaces v1's rollout worker (task.agent).")
@click.option(
    "--drop-unsupported", is_flag=True, help="Write the recipe even when some v1 keys that change training have no NexRL equivalent."
)
@click.option(
    "--launch",
    "launch_lines",
    metavar="LINE",
    multiple=True,
    help="Print the NexRL command lines for this v1 launch line (the trainer, the API server or torchrun's workers); repeatable.",
)
@click.pass_context
def convert_v1(
    ctx: click.Context, recipe: Path | None, output: Path | None, agent: str | None, drop_unsupported: bool, launch_lines: tuple[str, ...]
) -> None:
    """Convert the NexRL v1 recipe RECIPE (Hydra defaults and interpolations included),
    or with --launch the v1 command lines that started v1.

    Lists on standard error what was carried (v1 key -> NexRL key = value), what was
    dropped (it means nothing here) and what is not supported (it changes training in a
    way NexRL cannot), each with why, and where v1 trained otherwise than the recipe says.
    Exits with status 2, writing nothing, when a key is unknown or not supported, unless
    --drop-unsupported is given. With --launch, a flag it does not know, or a value NexRL
    cannot honour, is named and the status is 2.
    """
    if launch_lines:
        given = [
            name
            for name, value in (("RECIPE", recipe), ("-o", output), ("--agent", agent), ("--drop-unsupported", drop_unsupported))
            if value
        ]
        if given:
            raise click.UsageError(f"--launch converts command lines only; drop {', '.join(given)} (convert the recipe in its own call)")
        _convert_launch_lines(ctx, launch_lines)
        return
    if recipe is None:
        raise click.UsageError("give a v1 RECIPE to convert, or --launch LINE for a v1 command line")
    from nexrl_core.v1.convert import V1RecipeError, convert_v1_recipe

    try:
        conversion = convert_v1_recipe(recipe, agent=agent)
    except V1RecipeError as error:
        click.echo(f"nexrl convert-v1: {error}", err=True)
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    sections = (
        ("carried", [item.line() for item in conversion.carried]),
        ("dropped (no meaning here)", [item.line() for item in conversion.dropped]),
        ("not supported", [item.line() for item in conversion.unsupported]),
        ("choose (v1 trained otherwise than the recipe says)", [item.line() for item in conversion.choose]),
    )
    click.echo(f"{recipe}: a v1 recipe of the {conversion.shape} shape", err=True)
    for title, lines in sections:
        if lines:
            click.echo(f"{title}:", err=True)
            click.echo("\n".join(f"  {line}" for line in lines), err=True)
    if conversion.unsupported and not drop_unsupported:
        count = len(conversion.unsupported)
        click.echo(
            f"nexrl convert-v1: not converted: {count} key{'' if count == 1 else 's'} change{'s' if count == 1 else ''} training in a way NexRL cannot "
            "(listed under 'not supported'); pass --drop-unsupported to write the recipe without them",
            err=True,
        )
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    text = _header(str(recipe), [item.line() for item in conversion.choose]) + conversion.to_yaml()
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
        click.echo(f"wrote {output}; check it with: nexrl config show {output}", err=True)
