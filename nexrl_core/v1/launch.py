"""NexRL v1 launch lines as NexRL command lines (``nexrl convert-v1 --launch LINE``).

v1 was started with three lines (the design documents show them): the trainer
(``python -m nexrl.main --config-path=DIR --config-name=NAME``), the workers' API server
(``python -m nexrl.train_service_backend.api.api_server --host H --port P``) and the worker
ranks (``torchrun ... -m nexrl.train_service_backend.distributed.worker_process ...``).
Each becomes what does the same job here: the recipe converted and trained, ``nexrl serve
workers`` and ``torchrun ... -m MODULE``, MODULE the rank of the installed plugin that runs
worker groups, whose flags keep v1's meaning. That module and the values its flags accept
are the plugin's facts, read from its `nexrl_core.plugins.specs.RankCommand`
(`nexrl_core.training.worker_groups.rank_command`), so the core names no plugin and refuses exactly
what the rank would. Every flag is either carried or named as a problem (unknown, or a
value NexRL cannot honour), so nothing on a v1 line is silently lost. Environment
assignments before the program (``API_SERVER_URL=... torchrun ...``) stay in front of the
line that reads them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import PurePosixPath

import attrs

from nexrl_core.plugins.registry import RegistryError, install_hint
from nexrl_core.plugins.specs import RankCommand
from nexrl_core.training.worker_groups import NoGroupEngines, rank_command

__all__ = ["LaunchConversion", "LaunchError", "convert_launch"]

V1_MAIN = "nexrl.main"
V1_API_SERVER = "nexrl.train_service_backend.api.api_server"
V1_WORKER = "nexrl.train_service_backend.distributed.worker_process"

WORKER_FLAGS = ("--api-server-url", "--identifier", "--backend", "--dispatch-mode")
"""v1's worker flags; the values the rank accepts for each are its plugin's (`RankCommand.choices`)."""
SERVER_FLAGS = ("--host", "--port")
MAIN_FLAGS = {"--config-path": "--config-path", "-cp": "--config-path", "--config-name": "--config-name", "-cn": "--config-name"}
"""Hydra's flags v1's trainer was given, long and short, by their long name."""
KEY_NOTE = "nexrl serve workers, the ranks and nexrl train need the same NEXRL_WORKER_KEY in their environment (docs/self-hosted.md)"

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")


class LaunchError(ValueError):
    """A v1 line that cannot be carried; ``problems`` names each flag or value, with why."""

    def __init__(self, line: str, problems: list[str]) -> None:
        super().__init__(f"{line!r}: " + "; ".join(problems))
        self.problems = problems


@attrs.frozen
class LaunchConversion:
    """The NexRL command lines for one v1 line, in the order to run them, and what to know."""

    commands: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """Each command as one shell line."""
        return [shlex.join(command) for command in self.commands]


@attrs.define
class _Flags:
    """A program's ``--flag value`` / ``--flag=value`` arguments in order, its other words,
    and what was wrong."""

    program: str
    values: list[tuple[str, str]] = attrs.field(factory=list)
    words: list[str] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)

    def get(self, flag: str) -> str | None:
        return next((value for name, value in self.values if name == flag), None)

    def carried(self) -> list[str]:
        """The flags as ``--flag value`` pairs, in the order given."""
        return [part for pair in self.values for part in pair]


def _flags(program: str, tokens: list[str], known: dict[str, str]) -> _Flags:
    """Read ``tokens`` as ``program``'s flags (``known`` maps each spelling to its name);
    a flag it does not know and a flag without a value are problems. The word after an
    unknown flag is named with it as its value, unless it is a Hydra override (``k=v``)."""
    flags = _Flags(program)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not token.startswith("-"):
            flags.words.append(token)
            continue
        name, equals, value = token.partition("=")
        following = tokens[index] if index < len(tokens) and not tokens[index].startswith("-") else None
        if name not in known:
            if not equals and following is not None and "=" not in following:
                token, index = f"{name} {following}", index + 1
            flags.problems.append(f"{program}: unknown v1 flag {token}")
            continue
        if not equals:
            if following is None:
                flags.problems.append(f"{program}: {name} needs a value")
                continue
            value, index = following, index + 1
        flags.values.append((known[name], value))
    return flags


def _strays(flags: _Flags) -> None:
    """A word that is no flag's value is a problem where the program takes none."""
    flags.problems += [f"{flags.program}: unexpected argument {word!r}" for word in flags.words]


def _main(launcher: list[str], env: list[str], args: list[str]) -> LaunchConversion:
    """v1's trainer: its recipe converted, then trained."""
    flags = _flags(V1_MAIN, args, MAIN_FLAGS)
    flags.problems += [
        f"{V1_MAIN}: Hydra override {override!r}: write it into the v1 recipe before converting it (convert-v1 maps recipe keys)"
        for override in flags.words
    ]
    folder, name = flags.get("--config-path"), flags.get("--config-name")
    if folder is None:
        flags.problems.append(f"{V1_MAIN}: give --config-path, the v1 recipe's folder")
    if name is None:
        flags.problems.append(f"{V1_MAIN}: give --config-name, the v1 recipe's name")
    if flags.problems or folder is None or name is None:
        raise LaunchError(shlex.join([*env, *launcher, *args]), flags.problems)
    recipe = PurePosixPath(folder) / f"{name.removesuffix('.yaml')}.yaml"
    converted = recipe.name
    return LaunchConversion(
        commands=(("nexrl", "convert-v1", str(recipe), "-o", converted), (*env, "nexrl", "train", converted)),
        notes=(f"nexrl convert-v1 lists what became of every key of {recipe}; nexrl config show {converted} shows what will run",),
    )


def _api_server(launcher: list[str], env: list[str], args: list[str]) -> LaunchConversion:
    """v1's API server: ``nexrl serve workers`` on the same interface and port."""
    flags = _flags(V1_API_SERVER, args, {flag: flag for flag in SERVER_FLAGS})
    _strays(flags)
    if flags.problems:
        raise LaunchError(shlex.join([*env, *launcher, *args]), flags.problems)
    return LaunchConversion(commands=((*env, "nexrl", "serve", "workers", *flags.carried()),), notes=(KEY_NOTE,))


def _rank_command(line: str, backend: str | None) -> RankCommand:
    """The installed plugin's `RankCommand`, or a `LaunchError` saying none provides worker
    ranks and what to install: the extra of NexRL named like v1's ``--backend`` when the
    core distribution has one (`install_hint`), the plugin's own name being no core fact."""
    try:
        return rank_command()
    except NoGroupEngines as error:
        extra = install_hint(backend) if backend is not None else None
        if extra is not None:
            fix = f"pip install '{extra}' brings them"
        else:
            fix = "pip install the NexRL extra named like v1's --backend (pip install 'nexrl[BACKEND]'); nexrl plugins lists what is installed"
        raise LaunchError(line, [f"{V1_WORKER}: {error}; {fix}"]) from None
    except RegistryError as error:
        raise LaunchError(line, [f"{V1_WORKER}: {error}"]) from None


def _worker(launcher: list[str], env: list[str], args: list[str]) -> LaunchConversion:
    """v1's worker ranks: the installed plugin's rank module under the same launcher, v1's
    flags kept, each value checked against what that rank accepts."""
    flags = _flags(V1_WORKER, args, {flag: flag for flag in WORKER_FLAGS})
    command = _rank_command(shlex.join([*env, *launcher, *args]), flags.get("--backend"))
    _strays(flags)
    for name, value in flags.values:
        accepted = command.choices.get(name)
        if accepted is None or value in accepted:
            continue
        why = command.refused.get(name, {}).get(value)
        if why is not None:
            flags.problems.append(f"{V1_WORKER}: {name} {value} is not supported: {why}; use {name} {' or '.join(accepted)}")
        else:
            flags.problems.append(f"{V1_WORKER}: {name} {value} is not supported; NexRL's worker accepts {', '.join(accepted)}")
    if flags.get("--identifier") is None:
        flags.problems.append(f"{V1_WORKER}: give --identifier, the worker group's name (the recipe's backend.options.identifier)")
    if flags.problems:
        raise LaunchError(shlex.join([*env, *launcher, *args]), flags.problems)
    notes = [KEY_NOTE]
    if flags.get("--api-server-url") is None:
        notes.append("the ranks read the API server from API_SERVER_URL, as v1's did (a URL, HOST:PORT or a host, then port 8000)")
    return LaunchConversion(commands=((*env, *launcher, "-m", command.module, *flags.carried()),), notes=tuple(notes))


_MODULES: dict[str, Callable[[list[str], list[str], list[str]], LaunchConversion]] = {
    V1_MAIN: _main,
    V1_API_SERVER: _api_server,
}


def _torchrun(line: str, env: list[str], launcher: list[str], args: list[str]) -> LaunchConversion:
    """``torchrun [its options] -m WORKER_PROCESS [the worker's flags]``: torchrun's options
    mean the same to NexRL's ranks and are kept as written."""
    for index, token in enumerate(args):
        if token == V1_WORKER or token.endswith("worker_process.py"):
            options = args[:index]
            if options and options[-1] in ("-m", "--module"):
                options = options[:-1]
            return _worker([*launcher, *options], env, args[index + 1 :])
    raise LaunchError(line, [f"{launcher[-1]} runs no v1 worker ({V1_WORKER}): this converts v1's worker lines only"])


def convert_launch(line: str) -> LaunchConversion:
    """The NexRL command lines for the v1 launch ``line`` (shell quoting and ``\\``
    continuations as a shell reads them).

    :raises LaunchError: naming each flag or value that cannot be carried.
    """
    try:
        tokens = shlex.split(re.sub(r"\\\r?\n", " ", line))
    except ValueError as error:
        raise LaunchError(line, [f"cannot read it as a shell line ({error})"]) from None
    env: list[str] = []
    while tokens and _ASSIGNMENT.match(tokens[0]):
        env.append(tokens.pop(0))
    if not tokens:
        raise LaunchError(line, ["no command in it"])
    program = PurePosixPath(tokens[0]).name
    if program == "torchrun":
        return _torchrun(line, env, tokens[:1], tokens[1:])
    if _PYTHON.match(program) and len(tokens) >= 3 and tokens[1] == "-m":
        module, args = tokens[2], tokens[3:]
        if module == "torch.distributed.run":
            return _torchrun(line, env, tokens[:3], args)
        if module in _MODULES:
            return _MODULES[module](tokens[:3], env, args)
        if module == V1_WORKER:
            raise LaunchError(
                line, [f"{V1_WORKER} runs under torchrun: give the torchrun line (torchrun --standalone --nproc_per_node=1 -m ...)"]
            )
    raise LaunchError(
        line,
        [f"not a v1 launch line: expected python -m {V1_MAIN} ..., python -m {V1_API_SERVER} ... or torchrun ... -m {V1_WORKER} ..."],
    )
