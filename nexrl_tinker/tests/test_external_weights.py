"""The model as a download, through the SDK's own API: ``save_weights_external`` then
``RestClient.get_external_weights_urls``, signed per-file URLs served by the service;
encrypted to age recipients, and through tinker-cookbook's ``weights.download``.

The unmodified ``tinker`` SDK (and its ``tinker checkpoint download`` command) fetches
the files with plain GETs from 127.0.0.1; what comes back loads with plain transformers
and scores tokens as the service's own ``compute_logprobs`` does.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pyrage
import pytest
import tinker
from tinker import types

from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY

PROMPTS = ["12+7=", "40+2=", "the sum of 3 and 5 is"]


@pytest.fixture(scope="module")
def trained(service_client):
    """A LoRA model after one SFT step, and the sampling client of those weights."""
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result(timeout=120)
    tokenizer = training.get_tokenizer()
    tokens = tokenizer.encode("12+7=19<|im_end|>", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler_path = training.save_weights_for_sampler("after_step").result().path
    sampling = service_client.create_sampling_client(model_path=sampler_path).result()
    return training, tokenizer, sampling


@pytest.fixture(scope="module")
def export_path(trained) -> str:
    training, _, _ = trained
    return training.save_weights_external("final").result().path


@pytest.fixture(scope="module")
def rest(base_url: str):
    return tinker.RestClient(base_url=base_url, api_key=TEST_API_KEY)


def download(urls: dict[str, str], directory: Path) -> None:
    for name, url in urls.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=60) as response:  # as the SDK's CLI fetches them
            (directory / name).write_bytes(response.read())


def test_the_export_is_an_external_weights_checkpoint(trained, export_path: str, rest) -> None:
    training, _, _ = trained
    assert export_path == f"tinker://{training.model_id}/external_weights/final"
    listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed[export_path].checkpoint_type == "external" and listed[export_path].size_bytes > 0


def test_signed_urls_download_a_model_that_scores_like_the_service(trained, export_path: str, rest, base_url: str, tmp_path: Path) -> None:
    _, tokenizer, sampling = trained
    signed = rest.get_external_weights_urls(export_path).result()
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "chat_template.jinja"} <= set(signed.urls)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(signed.urls)
    assert all(url.startswith(base_url) for url in signed.urls.values())
    assert signed.expires > datetime.now(timezone.utc)
    download(signed.urls, tmp_path)
    model, loaded_tokenizer = load_exported(tmp_path)
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    for prompt in PROMPTS:
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
        service = sampling.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert sequence_logprobs(model, tokens) == pytest.approx(service[1:], abs=1e-4)


def test_the_adapter_in_peft_layout_gives_the_merged_model(trained, export_path: str, rest, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nexrl_engine.loading import resolve_model_dir

    _, tokenizer, _ = trained
    download(rest.get_external_weights_urls(export_path).result().urls, tmp_path)
    merged, _ = load_exported(tmp_path)
    base_dir = str(resolve_model_dir(BASE_MODEL))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(tmp_path / "adapter")).eval()
    tokens = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert sequence_logprobs(adapted, tokens) == pytest.approx(sequence_logprobs(merged, tokens), abs=1e-4)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert sequence_logprobs(base, tokens) != pytest.approx(sequence_logprobs(merged, tokens), abs=1e-4)


def test_the_sdks_download_command_fetches_it(export_path: str, base_url: str, tmp_path: Path) -> None:
    cli = shutil.which("tinker") or str(Path(sys.executable).parent / "tinker")
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": TEST_API_KEY}
    done = subprocess.run(
        [cli, "checkpoint", "download", export_path, "--output", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (target,) = tmp_path.iterdir()
    assert (target / "config.json").is_file() and (target / "adapter" / "adapter_model.safetensors").is_file()


def test_urls_are_refused_when_tampered_or_the_export_is_deleted(trained, base_url: str, rest) -> None:
    training, _, _ = trained
    path = training.save_weights_external("to_delete").result().path
    url = rest.get_external_weights_urls(path).result().urls["config.json"]
    assert httpx.get(url).status_code == 200
    tampered = httpx.get(url.replace("signature=", "signature=0"))
    assert tampered.status_code == 403 and "invalid download signature" in tampered.json()["detail"]
    rest.delete_checkpoint_from_tinker_path(path).result()
    gone = httpx.get(url)
    assert gone.status_code == 404 and "no file" in gone.json()["detail"]


def test_only_external_weights_of_ones_own_run_are_signed(trained, base_url: str, export_path: str) -> None:
    training, _, _ = trained
    run = training.model_id
    own = {"X-API-Key": TEST_API_KEY}
    sampler = httpx.get(f"{base_url}/api/v1/training_runs/{run}/checkpoints/sampler_weights/after_step/external_weights_urls", headers=own)
    assert sampler.status_code == 400 and "only external weights can be downloaded" in sampler.json()["detail"]
    missing = httpx.get(f"{base_url}/api/v1/training_runs/{run}/checkpoints/external_weights/nope/external_weights_urls", headers=own)
    assert missing.status_code == 404
    other = {"X-API-Key": "tml-someone-else"}
    stranger = httpx.get(f"{base_url}/api/v1/training_runs/{run}/checkpoints/external_weights/final/external_weights_urls", headers=other)
    assert stranger.status_code == 403


def test_an_age_encrypted_export_decrypts_to_the_plain_exports_files(trained, export_path: str, rest, tmp_path: Path) -> None:
    training, _, _ = trained
    identity = pyrage.x25519.Identity.generate()
    sealed_path = training.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result().path
    sealed = rest.get_external_weights_urls(sealed_path).result().urls
    plain = rest.get_external_weights_urls(export_path).result().urls
    assert set(sealed) == {f"{name}.age" for name in plain}
    download(sealed, tmp_path / "sealed")
    download(plain, tmp_path / "plain")
    for name in plain:
        ciphertext = (tmp_path / "sealed" / f"{name}.age").read_bytes()
        assert ciphertext.startswith(b"age-encryption.org/v1")
        assert pyrage.decrypt(ciphertext, [identity]) == (tmp_path / "plain" / name).read_bytes(), name
    rest.delete_checkpoint_from_tinker_path(sealed_path).result()


def test_the_cookbooks_download_of_a_training_checkpoint_gives_its_weights(
    trained, export_path: str, rest, base_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``weights.download`` exports to an age key it generates, renews the export's TTL,
    decrypts and deletes the export; what it writes is the model the service trained."""
    from tinker_cookbook import weights

    training, _, _ = trained
    state_path = training.save_state("for_download").result().path
    with caplog.at_level(logging.WARNING, logger="tinker_cookbook"):
        out = weights.download(tinker_path=state_path, output_dir=str(tmp_path / "out"), base_url=base_url)
    assert "Failed to renew the TTL" not in caplog.text and "Failed to delete" not in caplog.text
    download(rest.get_external_weights_urls(export_path).result().urls, tmp_path / "plain")
    written = sorted(p.relative_to(out).as_posix() for p in Path(out).rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(tmp_path / "plain").as_posix() for p in (tmp_path / "plain").rglob("*") if p.is_file())
    for name in written:
        assert (Path(out) / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    leftovers = [
        c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path.endswith("/external_weights/download")
    ]
    assert leftovers == []  # the temporary export was deleted


def test_bad_age_recipients_are_refused_naming_the_one(trained, base_url: str) -> None:
    training, _, _ = trained
    good = str(pyrage.x25519.Identity.generate().to_public())
    response = httpx.post(
        f"{base_url}/api/v1/save_weights_external",
        headers={"X-API-Key": TEST_API_KEY},
        json={"model_id": training.model_id, "path": "secret", "age_encryption_recipients": [good, "age1xyz"]},
    )
    assert response.status_code == 400
    assert "age_encryption_recipients[1] 'age1xyz' is not an age recipient" in response.json()["detail"]
    too_many = httpx.post(
        f"{base_url}/api/v1/save_weights_external",
        headers={"X-API-Key": TEST_API_KEY},
        json={"model_id": training.model_id, "path": "secret", "age_encryption_recipients": [good] * 11},
    )
    assert too_many.status_code == 400 and "at most 10" in too_many.json()["detail"]
