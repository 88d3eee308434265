"""The unmodified nex-weaver SDK exports HF weights (``export_weights``) and downloads
them (``download_weights``) from the local service over signed URLs; a tampered URL
is refused and requests the service cannot honour get a 4xx that says why."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest
import weaver
from weaver.types import AdamParams, Datum, LoraConfig, ModelInput

from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_weaver.testing import sdk_client

TOKENS = [1, 5, 9, 14, 20, 7, 3]


def _datum(tokens: list[int]) -> Datum:
    n = len(tokens) - 1
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


@pytest.fixture(scope="module")
def client(base_url: str):
    client = sdk_client(base_url)
    client.connect()
    yield client
    client.close()


@pytest.fixture(scope="module")
def trained_lora(client):
    """A LoRA model one step away from the base, so an export of the base would not pass."""
    model = client.create_model(base_model="nexrl-tiny", lora_config=LoraConfig(rank=4, seed=1))
    model.forward_backward([_datum(TOKENS)], "cross_entropy")
    model.optim_step(AdamParams(learning_rate=1e-2))
    return model


@pytest.fixture(scope="module")
def merged_artifact(trained_lora):
    return trained_lora.export_weights(merge_adapter=True)


def test_merged_lora_export_round_trips_through_the_sdk(client, trained_lora, merged_artifact, tmp_path: Path) -> None:
    artifact = merged_artifact
    assert artifact.kind == "hf_model" and artifact.status == "completed" and artifact.model_id == trained_lora.model_id
    names = {entry["name"] for entry in artifact.manifest["files"]}
    assert {"config.json", "tokenizer_config.json", "adapter/adapter_config.json"} <= names
    assert artifact.size_bytes == sum(entry["size"] for entry in artifact.manifest["files"])

    dest = client.download_weights(artifact, tmp_path / "merged")
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} == names
    model, _ = load_exported(dest)
    sampler = trained_lora.save_weights_and_get_sampling_client(name="after-step")
    served = sampler.compute_logprobs(prompt=ModelInput.from_ints(TOKENS))[1:]
    assert sequence_logprobs(model, TOKENS) == pytest.approx(served, abs=1e-4)


def test_unmerged_lora_export_is_the_peft_adapter(client, trained_lora, tmp_path: Path) -> None:
    artifact = trained_lora.export_weights()
    assert artifact.kind == "hf_adapter"
    dest = client.download_weights(artifact, tmp_path / "adapter")
    files = {p.name for p in dest.iterdir()}
    assert "adapter_config.json" in files and "config.json" not in files


def test_full_fine_tuning_export_and_its_refusals(client, tmp_path: Path) -> None:
    model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
    with pytest.raises(weaver.WeaverAPIError, match=r"\[400\].*merge_adapter is for LoRA models"):
        model.export_weights(merge_adapter=True)
    checkpoint = model.save_state(name="saved")
    with pytest.raises(weaver.WeaverAPIError, match=r"\[400\].*exports a model's current weights only"):
        model.export_weights(checkpoint=checkpoint)
    artifact = model.export_weights()
    assert artifact.kind == "hf_model"
    assert (client.download_weights(artifact, tmp_path / "full") / "config.json").is_file()
    assert checkpoint.path in [c.path for c in model.list_checkpoints()]
    assert not any("/exports/" in c.path for c in model.list_checkpoints()), "exports are artifacts, not checkpoints"


def _descriptor(base_url: str, artifact_id: str) -> dict:
    response = httpx.get(f"{base_url}/api/v1/artifacts/{artifact_id}/download", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(changes)
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_signed_urls_serve_the_manifest_and_refuse_tampering(base_url: str, merged_artifact) -> None:
    files = {entry["name"]: entry for entry in _descriptor(base_url, merged_artifact.id)["files"]}
    config = files["config.json"]
    good = httpx.get(config["url"], timeout=30)
    assert good.status_code == 200 and len(good.content) == config["size"]

    signature = dict(parse_qsl(urlsplit(config["url"]).query))["signature"]
    forged = _with_query(config["url"], signature=("0" if signature[0] != "0" else "1") + signature[1:])
    refused = httpx.get(forged, timeout=30)
    assert refused.status_code == 403 and "invalid download signature" in refused.json()["message"]

    other = files["adapter/adapter_config.json"]["url"]
    swapped = urlunsplit(urlsplit(other)._replace(query=urlsplit(config["url"]).query))
    assert httpx.get(swapped, timeout=30).status_code == 403, "one file's signature must not open another file"


def test_unknown_artifact_is_404(base_url: str) -> None:
    response = httpx.get(f"{base_url}/api/v1/artifacts/00000000-0000-4000-8000-000000000000/download", timeout=30)
    assert response.status_code == 404 and "unknown artifact" in response.json()["message"]
