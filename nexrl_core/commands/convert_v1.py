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


@click.command("convert-v1")
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the NexRL recipe here [default: standard output].")
@click.option("--agent", metavar="MODULE:FUNCTION", help="The NexRL agent that replaces v1's rollout worker (task.agent).")
@click.option("--drop-unsupported", is_flag=True, help="Write the recipe even when some v1 keys that change training have no NexRL equivalent.")
@click.pass_context
def convert_v1(ctx: click.Context, recipe: Path, output: Path | None, agent: str | None, drop_unsupported: bool) -> None:
    """Convert the NexRL v1 recipe RECIPE (Hydra defaults and interpolations included).

    Lists on standard error what was carried (v1 key -> NexRL key = value), what was
    dropped (it means nothing here) and what is not supported (it changes training in a
    way NexRL cannot), each with why, and where v1 trained otherwise than the recipe says.
    Exits with status 2, writing nothing, when a key is unknown or not supported, unless
    --drop-unsupported is given.
    """
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
            f"nexrl convert-v1: not converted: {count} key{'' if count == 1 else 's'} change training in a way NexRL cannot "
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
