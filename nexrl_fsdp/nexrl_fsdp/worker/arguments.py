"""The worker's command line, which also takes NexRL v1's launch lines as they were written.

v1 started its ranks with ``torchrun -m ...worker_process --backend fsdp`` (sometimes with
``--dispatch-mode scatter``) and often gave the API server only in ``API_SERVER_URL``, as
a bare host. Those lines start NexRL's ranks unchanged, and a value this worker cannot
honour is refused by name before the rank joins anything, never accepted and ignored:

- ``--backend``: ``fsdp`` only (the ranks are FSDP2; `actor`).
- ``--dispatch-mode``: ``scatter`` only, which is what the ranks always do: rank 0 takes
  each batch from the driver and scatters its rows over the ranks (`runtime`). v1's
  ``broadcast`` had every rank receive the whole batch on the command channel; v1's own
  client refused it, and nothing here sends a batch that way.
- ``API_SERVER_URL`` when ``--api-server-url`` is absent: a URL, ``host:port`` or a bare
  host (then port 8000, v1's API server port and ``nexrl serve``'s default).

`RANK_COMMAND` states the module and those values once, for this parser and for the plugin's
`GroupEngineSpec`, from which ``nexrl convert-v1 --launch`` writes v1's worker lines as
lines this worker takes and refuses what it would refuse, without naming this package.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence

import attrs

from nexrl_core.plugins.specs import RankCommand

__all__ = ["ENV_API_SERVER_URL", "RANK_COMMAND", "WorkerArguments", "api_server_url", "parse_arguments"]

ENV_API_SERVER_URL = "API_SERVER_URL"
"""Where v1's launch lines gave the workers' API server."""
DEFAULT_PORT = 8000
"""The port of an API server given as a bare host."""
BACKENDS = ("fsdp",)
"""``--backend`` values: the ranks are FSDP2."""
DISPATCH_MODES = ("scatter",)
"""``--dispatch-mode`` values: rank 0 scatters each batch's rows over the ranks, always."""
REFUSED_DISPATCH_MODES: Mapping[str, str] = {
    "broadcast": "NexRL's ranks never get a whole batch each: rank 0 takes it from the driver and scatters its rows "
    "over the ranks (v1's own client refused broadcast groups too)",
}
"""v1's other ``--dispatch-mode``, with why it is refused."""
RANK_COMMAND = RankCommand(
    module="nexrl_fsdp.worker",
    choices={"--backend": BACKENDS, "--dispatch-mode": DISPATCH_MODES},
    refused={"--dispatch-mode": REFUSED_DISPATCH_MODES},
)
"""How a rank is started (``python -m``) and the values its v1 flags take: what this parser
accepts, and what the plugin's `GroupEngineSpec` tells the core."""


@attrs.frozen
class WorkerArguments:
    """What a rank needs from its command line and environment."""

    api_server_url: str
    identifier: str


def api_server_url(value: str, source: str) -> str:
    """``http[s]://HOST:PORT`` from a URL, ``host:port`` or bare host (port `DEFAULT_PORT`).

    :raises ValueError: naming ``source`` when ``value`` is none of those.
    """
    text = value.strip()
    parsed = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1 or parsed.query or parsed.fragment:
        raise ValueError(f"{source}={value!r} is not the workers' API server: give a URL (http://HOST:PORT), HOST:PORT or a host")
    if "://" in text:
        return text.rstrip("/")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"http://{host}:{DEFAULT_PORT if port is None else port}{parsed.path.rstrip('/')}"


def _choice(flag: str) -> Callable[[str], str]:
    """An argparse type that names what ``flag`` accepts and, for a value it knows, why not
    (both from `RANK_COMMAND`)."""
    accepted, refused = RANK_COMMAND.choices[flag], RANK_COMMAND.refused.get(flag, {})

    def check(value: str) -> str:
        if value in accepted:
            return value
        why = f": {refused[value]}" if value in refused else ""
        raise argparse.ArgumentTypeError(f"{value!r} is not supported{why}. Accepted: {', '.join(accepted)}")

    return check


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {RANK_COMMAND.module}",
        description="One rank of a NexRL FSDP worker group (run it under torchrun or nexrl_fsdp.worker.loopback).",
    )
    parser.add_argument(
        "--api-server-url",
        help=f"base URL of `nexrl serve workers`, e.g. http://127.0.0.1:8100 [default: ${ENV_API_SERVER_URL}, "
        f"a URL, HOST:PORT or a host (port {DEFAULT_PORT})]",
    )
    parser.add_argument("--identifier", required=True, help="the worker group's name (a driver names the same)")
    parser.add_argument("--backend", type=_choice("--backend"), default="fsdp", help=f"accepted: {', '.join(BACKENDS)} (v1's flag)")
    parser.add_argument(
        "--dispatch-mode",
        type=_choice("--dispatch-mode"),
        default="scatter",
        help="accepted: scatter, what the ranks always do (v1's flag; broadcast is refused)",
    )
    return parser


def parse_arguments(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerArguments:
    """The rank's arguments; exits with status 2 and a usage line naming what is wrong."""
    parser = _parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    if args.api_server_url is not None:
        value, source = args.api_server_url, "--api-server-url"
    elif environ.get(ENV_API_SERVER_URL, "").strip():
        value, source = environ[ENV_API_SERVER_URL], ENV_API_SERVER_URL
    else:
        parser.error(f"give the workers' API server with --api-server-url URL or in {ENV_API_SERVER_URL} (a URL, HOST:PORT or a host)")
    try:
        return WorkerArguments(api_server_url=api_server_url(value, source), identifier=args.identifier)
    except ValueError as error:
        parser.error(str(error))
