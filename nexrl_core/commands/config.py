"""``nexrl config``: inspect recipes without running them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import yaml

from nexrl_core.config import ConfigError, dump_config, load_config, resolve_all_options
from nexrl_core.config.components import component_lists, resolve_choice_list
from nexrl_core.plugins.registry import RegistryError

USAGE_ERROR_EXIT_CODE = 2
"""Exit status for a bad recipe, the same click uses for a bad command line."""


def split_file_and_overrides(arguments: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[FILE] [KEY=VALUE]...``: the first argument is a file unless it contains ``=``."""
    if arguments and "=" not in arguments[0]:
        return arguments[0], list(arguments[1:])
    return None, list(arguments)


def resolved_config_data(path: str | None, overrides: Sequence[str]) -> dict[str, Any]:
    """The recipe as plain data, with the options of every chosen component filled in with
    defaults, and each list of components (``output.sinks``) as the run would take it.

    :raises ConfigError: for any problem in the recipe or in a component's options.
    """
    train_config = load_config(path, overrides)
    data = dump_config(train_config)
    for component_path, options in resolve_all_options(train_config, require_names=False).items():
        node = data
        for key in component_path.split("."):
            node = node[key]
        node["options"] = dump_config(options)
    for list_path, kind, entries in component_lists(train_config):
        *parents, last = list_path.split(".")
        node = data
        for key in parents:
            node = node[key]
        chosen = resolve_choice_list(kind, entries, list_path)
        node[last] = [{"name": choice.name, "options": dump_config(choice.options)} for choice in chosen]
    return data


@click.group()
def config() -> None:
    """Inspect and check recipes."""


@config.command()
@click.argument("arguments", nargs=-1, metavar="[FILE] [KEY=VALUE]...")
@click.pass_context
def show(ctx: click.Context, arguments: tuple[str, ...]) -> None:
    """Print the recipe FILE with overrides applied and every default filled in.

    Without FILE the defaults are shown. Each KEY=VALUE sets one value by its dotted
    path, e.g. rollout.group_size=4; VALUE is YAML. Component options (such as
    algorithm.loss.options) are checked against the installed plugin and shown with
    their defaults. On a bad recipe, lists every problem and exits with status 2.
    """
    path, overrides = split_file_and_overrides(arguments)
    try:
        data = resolved_config_data(path, overrides)
    except ConfigError as error:
        click.echo(str(error), err=True)
        ctx.exit(USAGE_ERROR_EXIT_CODE)
    except RegistryError as error:
        raise click.ClickException(str(error)) from error
    click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
