"""``python -m nexrl_fsdp.worker``'s command line: NexRL v1's worker flags and ``API_SERVER_URL``
taken as v1 wrote them, and every value the ranks cannot honour refused by name (the seed's
launch line starting real ranks is tests/test_convert_v1.py's design run)."""

from __future__ import annotations

import pytest

from nexrl_core.plugins.loading import load_plugins
from nexrl_core.plugins.registry import build_registry
from nexrl_core.plugins.specs import GroupEngineSpec
from nexrl_fsdp.worker.arguments import ENV_API_SERVER_URL, RANK_COMMAND, WorkerArguments, parse_arguments


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str]) -> str:
    """The error line ``argv`` gets, after the usage lines (it must exit with status 2)."""
    with pytest.raises(SystemExit) as exited:
        parse_arguments(argv, environ)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m nexrl_fsdp.worker: error: ")
    return error


@pytest.mark.parametrize(
    ("value", "url"),
    [
        ("10.0.0.2", "http://10.0.0.2:8000"),
        ("api-server", "http://api-server:8000"),
        ("api-server:8100", "http://api-server:8100"),
        ("[::1]:8100", "http://[::1]:8100"),
        ("http://api-server:8000", "http://api-server:8000"),
        ("http://api-server:8000/", "http://api-server:8000"),
        ("https://workers.example", "https://workers.example"),
    ],
)
def test_api_server_url_is_a_url_host_port_or_bare_host(value: str, url: str) -> None:
    assert parse_arguments(["--identifier", "g"], {ENV_API_SERVER_URL: value}) == WorkerArguments(url, "g")
    assert parse_arguments(["--identifier", "g", "--api-server-url", value], {}).api_server_url == url


def test_the_flag_wins_over_the_environment() -> None:
    parsed = parse_arguments(["--identifier", "g", "--api-server-url", "http://flag:1"], {ENV_API_SERVER_URL: "env"})
    assert parsed.api_server_url == "http://flag:1"


@pytest.mark.parametrize("environ", [{}, {ENV_API_SERVER_URL: ""}, {ENV_API_SERVER_URL: "  "}])
def test_without_a_server_both_places_are_named(capsys: pytest.CaptureFixture[str], environ: dict[str, str]) -> None:
    error = refusal(capsys, ["--identifier", "g"], environ)
    assert "--api-server-url" in error and ENV_API_SERVER_URL in error


@pytest.mark.parametrize("value", ["ftp://api-server", "api-server:99999", "http://:8000", "api-server:8000?x=1"])
def test_a_server_that_is_no_url_is_refused_naming_where_it_came_from(capsys: pytest.CaptureFixture[str], value: str) -> None:
    error = refusal(capsys, ["--identifier", "g"], {ENV_API_SERVER_URL: value})
    assert f"{ENV_API_SERVER_URL}={value!r} is not the workers' API server" in error


def test_the_seed_s_flags_are_taken() -> None:
    argv = ["--identifier", "actor-group", "--backend", "fsdp", "--dispatch-mode", "scatter"]
    assert parse_arguments(argv, {ENV_API_SERVER_URL: "10.0.0.1"}) == WorkerArguments("http://10.0.0.1:8000", "actor-group")
    assert parse_arguments(["--identifier=g", "--backend=fsdp", "--dispatch-mode=scatter", "--api-server-url=h"], {}).identifier == "g"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--backend", "megatron", "argument --backend: 'megatron' is not supported. Accepted: fsdp"),
        ("--dispatch-mode", "broadcast", "argument --dispatch-mode: 'broadcast' is not supported: NexRL's ranks never get a whole batch"),
        ("--dispatch-mode", "round-robin", "argument --dispatch-mode: 'round-robin' is not supported. Accepted: scatter"),
    ],
    ids=["other-backend", "broadcast", "other-dispatch-mode"],
)
def test_a_value_the_ranks_cannot_honour_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    error = refusal(capsys, ["--identifier", "g", "--api-server-url", "h", flag, value], {})
    assert message in error
    if value == "broadcast":
        assert "scatters its rows over the ranks" in error and error.endswith("Accepted: scatter")


def test_the_plugin_tells_the_core_how_its_ranks_start() -> None:
    """The registered group engines carry this parser's own `RANK_COMMAND` (the one place
    its module and values live), so ``nexrl convert-v1 --launch`` writes what it takes."""
    spec = build_registry(load_plugins()).find_spec("group_engines", "fsdp")
    assert isinstance(spec, GroupEngineSpec) and spec.rank_command is RANK_COMMAND
    assert RANK_COMMAND.module == "nexrl_fsdp.worker"
    assert RANK_COMMAND.choices == {"--backend": ("fsdp",), "--dispatch-mode": ("scatter",)}
    assert set(RANK_COMMAND.refused["--dispatch-mode"]) == {"broadcast"}
