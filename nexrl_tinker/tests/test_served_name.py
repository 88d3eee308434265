"""The served model's name is one tinker-cookbook resolves, and its tokenizer loads by name anywhere.

The shipped tiny model is served as ``Qwen/Qwen3-4B-Instruct-2507`` (the cookbook's name
whose renderer writes its chat template) with the tokenizer id ``nexrl/nexrl-tiny``;
``--model-name`` names a local directory. A client on another machine is played by a
subprocess whose Hugging Face cache is empty and which reaches no Hub but the service's
own (``HF_ENDPOINT=<service>/hf``): the unmodified SDK and cookbook functions load by
the served name there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from nexrl_core.cli import cli
from nexrl_engine.loading import SHIPPED_HUB_NAMES, load_tokenizer, resolve_model_dir
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

SERVED = SHIPPED_HUB_NAMES[BASE_MODEL]
TEXT = "12+34=46<|im_end|> tool <tool_call>{}</tool_call>"


def _model_tokens() -> list[int]:
    return list(load_tokenizer(resolve_model_dir(BASE_MODEL)).encode(TEXT, add_special_tokens=False))


def test_capabilities_and_get_info_name_the_served_model(base_url: str, service_client: object) -> None:
    """Capabilities and ``get_info`` give the cookbook's name and a tokenizer id that is a
    name, not a path of the server; a client here loads that tokenizer with the Hub out of
    reach (the conftest sets ``HF_HUB_OFFLINE``), and it is the model's."""
    models = httpx.get(f"{base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": TEST_API_KEY}).json()
    assert [m["model_name"] for m in models["supported_models"]] == ["Qwen/Qwen3-4B-Instruct-2507"]
    training = service_client.create_lora_training_client(BASE_MODEL, rank=4).result()  # the --model value names it too
    info = training.get_info()
    assert info.model_data.model_name == SERVED.model_name
    assert info.model_data.tokenizer_id == "nexrl/nexrl-tiny"
    assert not Path(info.model_data.tokenizer_id).exists()
    assert list(training.get_tokenizer().encode(TEXT, add_special_tokens=False)) == _model_tokens()
    sampler = service_client.create_sampling_client(base_model=SERVED.model_name).result()
    assert sampler.get_base_model() == SERVED.model_name


CLIENT = r"""
import json, sys
import tinker
from tinker_cookbook import hyperparam_utils, model_info, tokenizer_utils

base_url, name, text = sys.argv[1:]
service = tinker.ServiceClient(base_url=base_url)
training = service.create_lora_training_client(name, rank=4).result()
sampler = service.create_sampling_client(base_model=name).result()
encode = lambda tokenizer: list(tokenizer.encode(text, add_special_tokens=False))
print(json.dumps({
    "tokenizer_id": training.get_info().model_data.tokenizer_id,
    "training": encode(training.get_tokenizer()),
    "sampling": encode(sampler.get_tokenizer()),
    "cookbook": encode(tokenizer_utils.get_tokenizer(name)),
    "renderer": model_info.get_recommended_renderer_name(name),
    "lr": hyperparam_utils.get_lr(name),
}))
service.close("success").result(timeout=30)
"""


def test_a_client_on_another_machine_loads_everything_by_the_served_name(base_url: str, tmp_path: Path) -> None:
    """The SDK's ``TrainingClient.get_tokenizer()`` and ``SamplingClient.get_tokenizer()``
    and the cookbook's ``tokenizer_utils.get_tokenizer``, ``model_info`` and
    ``hyperparam_utils.get_lr``, unmodified, by the served name, from a process with an
    empty cache whose only Hub is the service: every tokenizer is the model's."""
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (see test_cookbook.py)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"{base_url}/hf", TINKER_API_KEY=TEST_API_KEY)
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, base_url, SERVED.model_name, TEXT],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = _model_tokens()
    assert answer["training"] == answer["sampling"] == answer["cookbook"] == tokens
    assert answer["renderer"] == "qwen3_instruct"
    assert answer["lr"] > 0
    assert (tmp_path / "hf" / "hub" / "models--nexrl--nexrl-tiny").is_dir()  # fetched from the service


def test_model_name_serves_a_local_directory_under_that_name(tmp_path: Path) -> None:
    """``--model-name`` on a directory: the name in capabilities, ``get_info`` and the
    service's Hub; requests may give the name or the path; with an API key the Hub
    routes want it as a bearer token (``HF_TOKEN``)."""
    import tinker

    directory = str(resolve_model_dir(BASE_MODEL))
    service = start_service(tmp_path / "served", api_key=TEST_API_KEY, model=directory, model_name="myorg/tiny-copy")
    client = tinker.ServiceClient(base_url=service.base_url, api_key=TEST_API_KEY)
    try:
        info = client.create_lora_training_client("myorg/tiny-copy", rank=4).result().get_info()
        assert (info.model_data.model_name, info.model_data.tokenizer_id) == ("myorg/tiny-copy", "myorg/tiny-copy")
        client.create_sampling_client(base_model=directory).result()  # the path still names it
        hub = f"{service.base_url}/hf/api/models/myorg/tiny-copy"
        assert httpx.get(hub).status_code == 401
        repo = httpx.get(hub, headers={"Authorization": f"Bearer {TEST_API_KEY}"}).json()
        assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {s["rfilename"] for s in repo["siblings"]}
        assert "model.safetensors" not in {s["rfilename"] for s in repo["siblings"]}
        other = httpx.get(f"{service.base_url}/hf/api/models/Qwen/Qwen3-8B", headers={"Authorization": f"Bearer {TEST_API_KEY}"})
        assert other.status_code == 404 and "myorg/tiny-copy" in other.json()["error"]
    finally:
        client.close("success").result(timeout=30)
        service.stop()


@pytest.mark.parametrize("name", ["tiny", "/models/tiny", "org/name/extra", "org--x/name"])
def test_a_model_name_that_is_not_org_slash_name_is_refused_before_start(name: str, tmp_path: Path) -> None:
    """A name the cookbook's lookups cannot take stops ``nexrl serve`` at once, naming the
    option, what is wrong and a name that would do."""
    result = CliRunner().invoke(cli, ["serve", "tinker", "--port", "0", "--data-dir", str(tmp_path), "--model-name", name])
    assert result.exit_code == 2, result.output
    assert f"--model-name {name!r} is not a Hugging Face-style name Org/Name" in result.output
    assert "myorg/" in result.output


HOLDER = r"""
import json, os, sys, time
import transformers  # imported before the clock starts: 4-15 s on a loaded machine
from nexrl_remote_api.testing import TINY
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig

base_url, api_key, text = sys.argv[1:]
holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=base_url, api_key=api_key))
holder._training_client()  # the model's creation on the service is not what is timed
began = time.monotonic()
tokens = list(holder._service_tokenizer().encode(text, add_special_tokens=False))
print(json.dumps({"seconds": time.monotonic() - began, "tokens": tokens}))
holder.close()
sys.stdout.flush()
os._exit(0)  # past the interpreter's teardown, where the SDK's native threads once aborted the process (SIGABRT) after it had answered
"""


def test_the_holder_loads_the_served_tokenizer_from_this_machines_cache_without_asking_a_hub(base_url: str) -> None:
    """``nexrl train`` on the local service: the holder takes the tokenizer the service
    seeded into this machine's cache, asking no Hub. The SDK's own load asks the Hub for
    the name first; here every Hub request is refused at once (``HF_ENDPOINT`` is a closed
    port, offline mode off), which its retries turn into 20 s or more."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", HOLDER, base_url, TEST_API_KEY, TEXT], env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("loading the tokenizer did not end within 120 s: it asked a Hub")
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded["tokens"] == _model_tokens()
    assert loaded["seconds"] < 10, f"loading the tokenizer took {loaded['seconds']:.1f} s: it asked a Hub\n{done.stderr[-2000:]}"
