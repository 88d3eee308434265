"""The ``nexrl`` command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TypedDict

import click
import yaml

from nexrl_core import __version__
from nexrl_core.commands.config import USAGE_ERROR_EXIT_CODE, config
from nexrl_core.commands.convert_v1 import convert_v1
from nexrl_core.commands.eval import eval_command
from nexrl_core.commands.export import export
from nexrl_core.commands.train import train
from nexrl_core.config.checks import SERVICE_DEVICE
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH, ServeOptions, ServiceStartError
from nexrl_core.plugins.registry import RegistryError, find_spec, get_registry


@click.group()
@click.version_option(__version__, prog_name="nexrl")
def cli() -> None:
    """NexRL: reinforcement-learning post-training of language models."""


class PluginRow(TypedDict):
    """A row of `nexrl plugins` (and of its ``--json`` list)."""

    name: str
    distribution: str | None
    version: str | None
    registers: dict[str, list[str]]
    error: str | None


def plugin_rows() -> list[PluginRow]:
    """One row per plugin: where it comes from, what it registers, and why it failed."""
    registry = get_registry()
    rows: list[PluginRow] = []
    for info in registry.plugins.infos:
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "registers": registry.provided_by(info.name),
                "error": info.error or registry.hook_errors.get(info.name),
            }
        )
    return rows


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def plugins(as_json: bool) -> None:
    """List installed plugins and what each registers."""
    try:
        rows = plugin_rows()
    except RegistryError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="NexRL plugins")
    for column in ("plugin", "distribution", "registers", "status"):
        table.add_column(column)
    for row in rows:
        registers = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in row["registers"].items() if names)
        distribution = f"{row['distribution']} {row['version']}" if row["distribution"] else "(in process)"
        status = f"[red]{row['error']}[/red]" if row["error"] else "[green]ok[/green]"
        table.add_row(str(row["name"]), distribution, registers or "-", status)
    Console().print(table)


def _device(value: str) -> str:
    """``--device``, spelled as a service accepts it (`nexrl_core.config.checks.SERVICE_DEVICE`)."""
    if SERVICE_DEVICE.fullmatch(value.strip().lower()) is None:
        raise click.BadParameter(f"{value!r} is not a device a service runs on; use cpu, cuda or cuda:N")
    return value.strip().lower()


def _placement_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--placement-option KEY=VALUE`` pairs as a mapping, each VALUE read as YAML (``30`` a number)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE (e.g. address=10.0.0.1:6379)")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise click.BadParameter(f"{pair!r}: the value is not YAML ({error})") from None
    return options


@cli.command()
@click.argument("name")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0: any free one).")
@click.option("--db", default=None, help="SQLAlchemy URL of the state store [default: a SQLite file in the data dir].")
@click.option("--model", default="nexrl-tiny", show_default=True, help="Shipped model name or local HF directory.")
@click.option(
    "--model-name",
    default=None,
    metavar="ORG/NAME",
    help="What clients call the model: a Hugging Face-style name, as by-name lookups of models and tokenizers expect "
    "[default: the shipped model's own name; the --model path for a directory].",
)
@click.option(
    "--sampling-model",
    "sampling_models",
    multiple=True,
    metavar="MODEL",
    help="A model served beside --model for sampling and scoring only, never trained (a distillation teacher): a "
    "shipped name or a local HF directory with the same vocabulary; repeatable. Clients name it as a base model.",
)
@click.option(
    "--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]), help="Precision the service trains and samples in."
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=lambda _ctx, _param, value: _device(value),
    help="Where the service's engines live (the models it trains in its own process, and every sampler): cpu, cuda or cuda:N.",
)
@click.option("--api-key", default=None, envvar="NEXRL_API_KEY", help="Refuse requests without this key.")
@click.option("--data-dir", default=None, help="Where checkpoints and the default database live.")
@click.option(
    "--workers",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Ranks per training model: 0 trains in the service process, N gives each model its own worker group of N processes.",
)
@click.option(
    "--max-worker-groups",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --workers: most training models (worker groups) at once; one more is refused.",
)
@click.option(
    "--placement",
    default=None,
    help="With --workers: the placer that starts each group's ranks (default: this machine). `nexrl plugins` lists the installed placers.",
)
@click.option(
    "--placement-option",
    "placement_option",
    multiple=True,
    metavar="KEY=VALUE",
    callback=lambda _ctx, _param, value: _placement_options(value),
    help="An option of the placer, repeatable (e.g. address=HEAD:6379); VALUE is read as YAML.",
)
@click.option(
    "--worker-save-every",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --workers: save a model's whole training state every N optimizer steps; the calls in between are "
    "journaled and replayed after a restart (larger: less writing per step, longer restarts).",
)
@click.option(
    "--max-tokens-per-microbatch",
    default=DEFAULT_MAX_TOKENS_PER_MICROBATCH,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most padded tokens (rows x longest row) per forward or forward/backward pass of every model and sampler; "
    "a larger batch runs in several passes (smaller: less memory, the same loss and gradient).",
)
def serve(
    name: str,
    host: str,
    port: int,
    db: str | None,
    model: str,
    model_name: str | None,
    sampling_models: tuple[str, ...],
    dtype: str,
    device: str,
    api_key: str | None,
    data_dir: str | None,
    workers: int,
    max_worker_groups: int,
    placement: str | None,
    placement_option: dict[str, Any],
    worker_save_every: int,
    max_tokens_per_microbatch: int,
) -> None:
    """Run the service a plugin registers as NAME (e.g. `tinker`) until Ctrl-C."""
    try:
        spec = find_spec("services", name)
    except RegistryError as exc:
        raise click.ClickException(str(exc)) from exc
    options = ServeOptions(
        host=host,
        port=port,
        db=db,
        model=model,
        model_name=model_name,
        sampling_models=sampling_models,
        dtype=dtype,
        device=device,
        api_key=api_key,
        data_dir=data_dir,
        workers=workers,
        max_worker_groups=max_worker_groups,
        placement=placement,
        placement_options=placement_option,
        worker_save_every=worker_save_every,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
    )
    try:
        spec.build(options).serve_forever()
    except ServiceStartError as exc:
        click.echo(f"nexrl serve {name}: {exc}", err=True)
        sys.exit(USAGE_ERROR_EXIT_CODE)


cli.add_command(config)
cli.add_command(convert_v1)
cli.add_command(eval_command)
cli.add_command(export)
cli.add_command(train)


def main() -> None:
    cli()
