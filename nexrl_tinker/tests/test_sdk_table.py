"""docs/tinker-sdk.md, kept true: it has a row for exactly the public methods of the SDK's
clients, and each row's claim holds against one real service.

The SDK's methods are listed here from the installed SDK, so a method a new SDK adds
fails `test_the_table_lists_every_public_sdk_method` until the page has a row for it.
Every row has a probe below, which calls the method (and its ``_async`` variant where
the row says so) with valid arguments; a row that quotes the words of a refusal also has
a refusal, the call that must raise with them.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState

from nexrl_engine.loading import SHIPPED_HUB_NAMES
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, sft_data

TABLE = Path(__file__).resolve().parents[2] / "docs" / "tinker-sdk.md"
STATUSES = ("works", "differs", "refused", "client-side")
SERVED_NAME = SHIPPED_HUB_NAMES[BASE_MODEL].model_name
RANK = 2
BILLING_WINDOW = ("2025-01-01T00:00:00Z", "2025-01-02T00:00:00Z")
ROW = re.compile(r"^\| `(\w+\.\w+)` \| (yes|no) \| ([\w-]+) \| (.+) \|$")
QUOTED = re.compile(r'"([^"]+)"')
CODE = re.compile(r"`[^`]*`")


def sdk_methods() -> dict[str, bool]:
    """``Class.member`` -> whether it has an ``_async`` variant, for every public member of
    every public ``*Client`` class of the installed SDK (an ``_async`` variant is its
    method's, not a member of its own)."""
    methods: dict[str, bool] = {}
    for class_name in sorted(n for n in dir(tinker) if n.endswith("Client") and inspect.isclass(getattr(tinker, n))):
        names = {n for n in dir(getattr(tinker, class_name)) if not n.startswith("_")}
        variants = {n for n in names if n.endswith("_async") and n.removesuffix("_async") in names}
        for name in sorted(names - variants):
            methods[f"{class_name}.{name}"] = f"{name}_async" in variants
    return methods


@dataclass(frozen=True)
class Row:
    method: str
    has_async: bool
    status: str
    text: str

    @property
    def words(self) -> str | None:
        """The words of the row's refusal: its first quoted phrase outside code."""
        quoted = QUOTED.search(CODE.sub("", self.text))
        return quoted.group(1) if quoted else None


def table_rows() -> list[Row]:
    rows = []
    for line in TABLE.read_text().splitlines():
        if match := ROW.match(line):
            method, has_async, status, text = match.groups()
            rows.append(Row(method, has_async == "yes", status, text))
    return rows


@dataclass
class Sdk:
    """The clients every probe shares: one session, one training run, one sampler."""

    base_url: str
    service: tinker.ServiceClient
    archive: tinker.ServiceClient
    """Made with a ``project_id``, which ``ServiceClient.copy_weights`` copies into."""
    training: tinker.TrainingClient
    sampler: tinker.SamplingClient
    rest: tinker.RestClient
    admin: tinker.AdminClient
    data: list[types.Datum]
    prompt: types.ModelInput
    numbers: Iterator[int] = field(default_factory=itertools.count)

    @property
    def session_id(self) -> str:
        return self.service.holder.get_session_id()

    def name(self, stem: str) -> str:
        return f"{stem}-{next(self.numbers)}"

    def state(self) -> str:
        """A new ``weights`` checkpoint of the shared run."""
        return self.training.save_state(self.name("state")).result(timeout=120).path

    def sampler_path(self) -> str:
        return self.training.save_weights_for_sampler(self.name("sampler")).result(timeout=120).path

    def checkpoint(self, path: str) -> types.Checkpoint | None:
        listed = self.rest.list_checkpoints(self.training.model_id).result(timeout=30).checkpoints
        return next((c for c in listed if c.tinker_path == path), None)

    @cached_property
    def loss(self) -> Any:
        """`neg_ll`'s ``LossHandle``: a session creates each loss once."""
        return self.service.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result(timeout=60)

    def scratch(self) -> tinker.TrainingClient:
        """A training run of its own, for a call that is refused."""
        return self.service.create_lora_training_client(base_model=BASE_MODEL, rank=RANK).result(timeout=120)


Call = Callable[..., Any]
"""``call(obj, *args, **kwargs)``: the method under test (or its ``_async`` variant) of
``obj``, called, with any future it returns resolved."""
Probe = Callable[[Sdk, Call], None]
PROBES: dict[str, Probe] = {}
REFUSALS: dict[str, Probe] = {}


def probe(method: str) -> Callable[[Probe], Probe]:
    def register(fn: Probe) -> Probe:
        PROBES[method] = fn
        return fn

    return register


def refusal(method: str) -> Callable[[Probe], Probe]:
    def register(fn: Probe) -> Probe:
        REFUSALS[method] = fn
        return fn

    return register


def caller(name: str, variant: str) -> Call:
    def call(obj: object, *args: Any, **kwargs: Any) -> Any:
        method = getattr(obj, name + variant)
        value = asyncio.run(method(*args, **kwargs)) if variant else method(*args, **kwargs)
        while isinstance(value, tinker.APIFuture):
            value = value.result(timeout=120)
        return value

    return call


def neg_ll(logprobs: Any, weights: Any) -> tuple[Any, dict[str, Any]]:
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def weighted_logprob(logprobs: Any, weights: Any) -> tuple[Any, dict[str, Any]]:
    loss = (logprobs * weights).sum()
    return loss, {"custom/weighted_logprob:sum": loss}


def no_telemetry(call: Call, client: object) -> None:
    assert call(client) is None, "telemetry under TINKER_TELEMETRY=0"


# --- ServiceClient ------------------------------------------------------------------------------


@probe("ServiceClient.close")
def _(sdk: Sdk, call: Call) -> None:
    client = tinker.ServiceClient(base_url=sdk.base_url)
    session_id = client.holder.get_session_id()
    call(client, "success")
    beat = httpx.post(f"{sdk.base_url}/api/v1/session_heartbeat", json={"session_id": session_id}, headers={"X-API-Key": TEST_API_KEY})
    assert beat.status_code == 410, beat.text


@probe("ServiceClient.copy_weights")
def _(sdk: Sdk, call: Call) -> None:
    source = sdk.state()
    copy = call(sdk.archive, source)
    assert copy != source and copy.startswith("tinker://"), copy


@refusal("ServiceClient.copy_weights")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.archive, sdk.state(), weights_access_token="token")


@probe("ServiceClient.create_custom_loss")
def _(sdk: Sdk, call: Call) -> None:
    handle = call(sdk.service, weighted_logprob, {"logprobs": 1, "weights": 1})
    assert handle.loss_id is None, "the loss was uploaded"


@probe("ServiceClient.create_lora_training_client")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.service, base_model=BASE_MODEL, rank=RANK).get_info().lora_rank == RANK


@refusal("ServiceClient.create_lora_training_client")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.service, base_model=BASE_MODEL, rank=RANK, optimizer=tinker.DimuonOptimizerConfig())


@probe("ServiceClient.create_rest_client")
def _(sdk: Sdk, call: Call) -> None:
    assert isinstance(call(sdk.service), tinker.RestClient)


@probe("ServiceClient.create_sampling_client")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.service, base_model=SERVED_NAME).get_base_model() == SERVED_NAME
    assert call(sdk.service, model_path=sdk.state()).get_base_model() == SERVED_NAME


@refusal("ServiceClient.create_sampling_client")
def _(sdk: Sdk, call: Call) -> None:
    stability = call(sdk.service, base_model=BASE_MODEL, record_stability_info=True)
    stability.sample(sdk.prompt, 1, types.SamplingParams(max_tokens=2)).result(timeout=120)


@probe("ServiceClient.create_training_client_from_state")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.service, sdk.state()).model_id != sdk.training.model_id


@probe("ServiceClient.create_training_client_from_state_with_optimizer")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.service, sdk.state()).model_id != sdk.training.model_id


@probe("ServiceClient.get_console_url")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.service).startswith("https://")


@probe("ServiceClient.get_server_capabilities")
def _(sdk: Sdk, call: Call) -> None:
    assert [m.model_name for m in call(sdk.service).supported_models] == [SERVED_NAME]


@probe("ServiceClient.get_telemetry")
def _(sdk: Sdk, call: Call) -> None:
    no_telemetry(call, sdk.service)


@probe("ServiceClient.holder")
def _(sdk: Sdk, call: Call) -> None:
    assert sdk.service.holder.get_session_id() in sdk.rest.list_sessions(limit=1000).result(timeout=30).sessions


# --- TrainingClient -----------------------------------------------------------------------------


@probe("TrainingClient.create_sampling_client")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.training, sdk.sampler_path()).get_base_model() == SERVED_NAME


@probe("TrainingClient.forward")
def _(sdk: Sdk, call: Call) -> None:
    assert len(call(sdk.training, sdk.data, "cross_entropy").loss_fn_outputs) == len(sdk.data)


@probe("TrainingClient.forward_backward")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.training, sdk.data, "cross_entropy").metrics["loss:sum"] > 0


@refusal("TrainingClient.forward_backward")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.scratch(), sdk.data, "stable_reinforce")


@probe("TrainingClient.forward_backward_custom")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.training, sdk.data, sdk.loss).metrics["custom/neg_ll:sum"] > 0


@probe("TrainingClient.get_console_url")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.training).startswith("https://")


@probe("TrainingClient.get_info")
def _(sdk: Sdk, call: Call) -> None:
    info = call(sdk.training)
    assert info.model_data.model_name == SERVED_NAME and info.lora_rank == RANK, info


@probe("TrainingClient.get_telemetry")
def _(sdk: Sdk, call: Call) -> None:
    no_telemetry(call, sdk.training)


@probe("TrainingClient.get_tokenizer")
def _(sdk: Sdk, call: Call) -> None:
    tokenizer = call(sdk.training)
    assert tokenizer.decode(tokenizer.encode("12+34=")) == "12+34="


@probe("TrainingClient.load_state")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    assert call(sdk.training, path).path == path


@probe("TrainingClient.load_state_with_optimizer")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    assert call(sdk.training, path).path == path


@probe("TrainingClient.optim_step")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.training, types.AdamParams(learning_rate=1e-4))


@refusal("TrainingClient.optim_step")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.scratch(), tinker.DimuonParams(learning_rate=1e-4))


@probe("TrainingClient.save_state")
def _(sdk: Sdk, call: Call) -> None:
    name = sdk.name("saved")
    assert call(sdk.training, name).path == f"tinker://{sdk.training.model_id}/weights/{name}"


@probe("TrainingClient.save_weights_and_get_sampling_client")
def _(sdk: Sdk, call: Call) -> None:
    for kind in ("snapshot", "inflight"):
        scored = call(sdk.training, kind=kind).compute_logprobs(sdk.prompt).result(timeout=120)
        assert len(scored) == sdk.prompt.length, kind


@probe("TrainingClient.save_weights_external")
def _(sdk: Sdk, call: Call) -> None:
    name = sdk.name("external")
    assert call(sdk.training, name).path == f"tinker://{sdk.training.model_id}/external_weights/{name}"


@probe("TrainingClient.save_weights_for_sampler")
def _(sdk: Sdk, call: Call) -> None:
    name = sdk.name("for-sampler")
    assert call(sdk.training, name).path == f"tinker://{sdk.training.model_id}/sampler_weights/{name}"


# --- SamplingClient -----------------------------------------------------------------------------


@probe("SamplingClient.compute_logprobs")
def _(sdk: Sdk, call: Call) -> None:
    scored = call(sdk.sampler, sdk.prompt)
    assert scored[0] is None and len(scored) == sdk.prompt.length, scored


@probe("SamplingClient.create")
def _(sdk: Sdk, call: Call) -> None:
    assert call(tinker.SamplingClient, sdk.service.holder, base_model=SERVED_NAME).get_base_model() == SERVED_NAME


@probe("SamplingClient.from_sampler_handle")
def _(sdk: Sdk, call: Call) -> None:
    again = call(tinker.SamplingClient, sdk.sampler.get_sampler_handle(), api_key=TEST_API_KEY)
    scored = again.compute_logprobs(sdk.prompt).result(timeout=120)
    assert scored[1:] == pytest.approx(sdk.sampler.compute_logprobs(sdk.prompt).result(timeout=120)[1:], abs=1e-4)


@probe("SamplingClient.get_base_model")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.sampler) == SERVED_NAME


@probe("SamplingClient.get_sampler_handle")
def _(sdk: Sdk, call: Call) -> None:
    assert isinstance(call(sdk.sampler), str)


@probe("SamplingClient.get_telemetry")
def _(sdk: Sdk, call: Call) -> None:
    no_telemetry(call, sdk.sampler)


TOKENIZER_CLIENT = """
import sys, tinker
tokenizer = tinker.SamplingClient.from_sampler_handle(sys.argv[1]).get_tokenizer()
print(tokenizer.decode(tokenizer.encode("12+34=")))
"""


@probe("SamplingClient.get_tokenizer")
def _(sdk: Sdk, call: Call) -> None:
    """It loads by the served name, which this machine's cache does not hold (the service
    seeds it under its tokenizer id): called in a process whose only Hub is the service's."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    with tempfile.TemporaryDirectory() as home:
        env.update(HF_HOME=home, HF_ENDPOINT=f"{sdk.base_url}/hf", TINKER_API_KEY=TEST_API_KEY)
        done = subprocess.run(
            [sys.executable, "-c", TOKENIZER_CLIENT, sdk.sampler.get_sampler_handle()],
            cwd=home, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("12+34="), done.stderr[-2000:]


@probe("SamplingClient.on_queue_state_change")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.sampler, QueueState.ACTIVE, None)


@probe("SamplingClient.sample")
def _(sdk: Sdk, call: Call) -> None:
    response = call(sdk.sampler, sdk.prompt, 2, types.SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    assert len(response.sequences) == 2


@refusal("SamplingClient.sample")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.sampler, sdk.prompt, 1, types.SamplingParams(max_tokens=2), prompt_alt_tokens_k=2)


# --- RestClient and AdminClient -----------------------------------------------------------------


@probe("RestClient.assign_session_project")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest, sdk.session_id, "proj-table")
    runs = sdk.rest.list_training_runs(limit=1000, project_id="proj-table").result(timeout=30).training_runs
    assert sdk.training.model_id in {r.training_run_id for r in runs}


@probe("RestClient.copy_weights")
def _(sdk: Sdk, call: Call) -> None:
    source = sdk.state()
    copy = call(sdk.rest, source, "proj-copies")
    assert copy != source and copy.startswith("tinker://"), copy


@refusal("RestClient.copy_weights")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest, sdk.state(), "proj-copies", weights_access_token="token")


@probe("RestClient.delete_checkpoint")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(path)
    call(sdk.rest, parsed.training_run_id, parsed.checkpoint_id)
    assert sdk.checkpoint(path) is None


@probe("RestClient.delete_checkpoint_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    call(sdk.rest, path)
    assert sdk.checkpoint(path) is None


@probe("RestClient.export_session_trace")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest, sdk.session_id)


@probe("RestClient.get_external_weights_urls")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.training.save_weights_external(sdk.name("download")).result(timeout=120).path
    urls = call(sdk.rest, path).urls
    assert urls and all(url.startswith(sdk.base_url) for url in urls.values()), urls


@probe("RestClient.get_sampler")
def _(sdk: Sdk, call: Call) -> None:
    (sampler_id, *_) = sdk.rest.get_session(sdk.session_id).result(timeout=30).sampler_ids
    assert call(sdk.rest, sampler_id).base_model == SERVED_NAME


@probe("RestClient.get_server_capabilities")
def _(sdk: Sdk, call: Call) -> None:
    assert [m.model_name for m in call(sdk.rest).supported_models] == [SERVED_NAME]


@probe("RestClient.get_session")
def _(sdk: Sdk, call: Call) -> None:
    assert sdk.training.model_id in call(sdk.rest, sdk.session_id).training_run_ids


@probe("RestClient.get_telemetry")
def _(sdk: Sdk, call: Call) -> None:
    no_telemetry(call, sdk.rest)


@probe("RestClient.get_training_run")
def _(sdk: Sdk, call: Call) -> None:
    run = call(sdk.rest, sdk.training.model_id)
    assert run.lora_rank == RANK and run.base_model == SERVED_NAME, run


@probe("RestClient.get_training_run_by_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    assert call(sdk.rest, sdk.state()).training_run_id == sdk.training.model_id


@probe("RestClient.get_weights_info_by_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    info = call(sdk.rest, sdk.state())
    assert info.is_lora and info.lora_rank == RANK, info


@probe("RestClient.list_checkpoints")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    assert path in {c.tinker_path for c in call(sdk.rest, sdk.training.model_id).checkpoints}


@probe("RestClient.list_sessions")
def _(sdk: Sdk, call: Call) -> None:
    assert sdk.session_id in call(sdk.rest, limit=1000).sessions


@probe("RestClient.list_training_runs")
def _(sdk: Sdk, call: Call) -> None:
    assert sdk.training.model_id in {r.training_run_id for r in call(sdk.rest, limit=1000).training_runs}


@probe("RestClient.list_user_checkpoints")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    assert path in {c.tinker_path for c in call(sdk.rest, limit=1000).checkpoints}


@probe("RestClient.publish_checkpoint_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    call(sdk.rest, path)
    assert sdk.checkpoint(path).public is True


@refusal("RestClient.publish_checkpoint_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    sdk.rest.publish_checkpoint_from_tinker_path(path).result(timeout=30)
    call(sdk.rest, path)


@probe("RestClient.search_sessions")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest, types.SessionSearchRequest(display_name="x"))


@probe("RestClient.set_checkpoint_ttl_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    call(sdk.rest, path, 7200)
    assert sdk.checkpoint(path).expires_at is not None


@probe("RestClient.unpublish_checkpoint_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    path = sdk.state()
    sdk.rest.publish_checkpoint_from_tinker_path(path).result(timeout=30)
    call(sdk.rest, path)
    assert sdk.checkpoint(path).public is False


@refusal("RestClient.unpublish_checkpoint_from_tinker_path")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest, sdk.state())


@probe("RestClient.whoami")
def _(sdk: Sdk, call: Call) -> None:
    call(sdk.rest)


ORGANIZATION_REPORTS = {"get_audit_log": (), "get_billing_usage": BILLING_WINDOW, "get_current_checkpoint_storage_usage": ()}
"""AdminClient's methods, which RestClient still has (deprecated), with their arguments."""

for _owner, _client in (("RestClient", lambda sdk: sdk.rest), ("AdminClient", lambda sdk: sdk.admin)):
    for _name, _args in ORGANIZATION_REPORTS.items():
        PROBES[f"{_owner}.{_name}"] = lambda sdk, call, client=_client, args=_args: call(client(sdk), *args)


@probe("AdminClient.get_telemetry")
def _(sdk: Sdk, call: Call) -> None:
    no_telemetry(call, sdk.admin)


# --- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdk(base_url: str, service_client: tinker.ServiceClient) -> Iterator[Sdk]:
    archive = tinker.ServiceClient(base_url=base_url, project_id="proj-archive")
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=3).result(timeout=120)
    tokenizer = training.get_tokenizer()
    sampler_path = training.save_weights_for_sampler("table").result(timeout=120).path
    try:
        yield Sdk(
            base_url=base_url,
            service=service_client,
            archive=archive,
            training=training,
            sampler=service_client.create_sampling_client(model_path=sampler_path).result(timeout=60),
            rest=tinker.RestClient(base_url=base_url),
            admin=tinker.AdminClient(base_url=base_url),
            data=sft_data(tokenizer)[:2],
            prompt=types.ModelInput.from_ints(tokenizer.encode("12+34=")),
        )
    finally:
        archive.close("success").result(timeout=30)


def test_the_table_lists_every_public_sdk_method() -> None:
    rows = table_rows()
    listed = {row.method: row.has_async for row in rows}
    assert len(listed) == len(rows), "a method has two rows"
    assert listed == sdk_methods(), f"{TABLE.name} and the SDK's public methods (and their _async variants) differ"
    for row in rows:
        assert row.status in STATUSES, row
        assert row.status != "refused" or row.words, f"{row.method} is refused without the quoted words of the error"


def test_every_row_has_its_probe() -> None:
    rows = table_rows()
    assert set(PROBES) == {row.method for row in rows}
    assert set(REFUSALS) == {row.method for row in rows if row.status == "differs" and row.words}


def failure(row: Row, expect_words: bool, check: Probe, sdk: Sdk, call: Call) -> str | None:
    """What is wrong with ``row``'s claim for one call (``check`` of ``call``), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the SDK's deprecation and experimental warnings
            check(sdk, call)
    except Exception as exc:  # noqa: BLE001 - each is compared with the table
        if not expect_words:
            return f"raised {type(exc).__name__}: {exc}"
        if isinstance(exc, tinker.APIStatusError) and not 400 <= exc.status_code < 500:
            return f"answered {exc.status_code}, not a 4xx: {exc}"
        if row.words not in str(exc):
            return f"raised {type(exc).__name__} without {row.words!r}: {exc}"
        return None
    return "returned, where the table says it is refused" if expect_words else None


def test_each_row_of_the_table_holds(sdk: Sdk) -> None:
    problems = []
    for row in table_rows():
        name = row.method.split(".")[1]
        for variant in ("", "_async") if row.has_async else ("",):
            call = caller(name, variant)
            checks = [(row.status == "refused", PROBES[row.method])]
            if row.status == "differs" and row.words:
                checks.append((True, REFUSALS[row.method]))
            for expect_words, check in checks:
                problem = failure(row, expect_words, check, sdk, call)
                if problem:
                    problems.append(f"{row.method}{variant} ({row.status}): {problem}")
    assert not problems, f"{len(problems)} rows of {TABLE.name} do not hold:\n" + "\n".join(problems)
