"""``nexrl serve tinker --device``: where the service's engines live, and a device this
machine lacks refused at start in one line (exit 2, no traceback, nothing left running)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from nexrl_testing.devices import absent_device
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, sft_data, start_service

NEXRL = str(Path(sys.executable).with_name("nexrl"))


def test_device_cpu_given_explicitly_places_every_engine_there(tmp_path: Path) -> None:
    """The training model and every sampler the service builds are `Engine`s on the
    device, and the service says which device it uses."""
    import tinker
    from tinker import types

    service = start_service(tmp_path, device="cpu")
    client = tinker.ServiceClient(base_url=service.base_url)
    try:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result(timeout=120)
        training.forward_backward(sft_data(training.get_tokenizer()), "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
        sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
        prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("12+34="))
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result(timeout=120)
        base = client.create_sampling_client(base_model=BASE_MODEL).result(timeout=120)
        base.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result(timeout=120)

        engines = service.state.engines.loaded()
        assert len(engines) >= 3, engines  # the training model, its sampler and the base model's
        assert {engine.device for engine in engines} == {torch.device("cpu")}
        said = httpx.get(f"{service.base_url}/api/v1/nexrl_capabilities", headers={"X-API-Key": TEST_API_KEY}, timeout=30)
        assert said.json()["device"] == "cpu"
    finally:
        client.close("success").result(timeout=30)
        service.stop()


def test_a_device_this_machine_lacks_stops_the_start(tmp_path: Path) -> None:
    from nexrl_core.http.serving import ServeOptions, ServiceStartError
    from nexrl_tinker.server.service import TinkerService

    device = absent_device()
    service = TinkerService(ServeOptions(port=0, data_dir=str(tmp_path), device=device))
    with pytest.raises(ServiceStartError, match=f"--device: '{device}' asks for ") as refused:
        service.start()
    assert refused.value.option == "device" and "\n" not in str(refused.value)
    assert service.state is None and service.base_url is None, "nothing may be left running"


@pytest.mark.parametrize("how", ["absent", "misspelt"])
def test_nexrl_serve_refuses_a_device_it_cannot_use_in_one_line(tmp_path: Path, how: str) -> None:
    device = absent_device() if how == "absent" else "gpu0"
    done = subprocess.run(
        [NEXRL, "serve", "tinker", "--port", "0", "--data-dir", str(tmp_path / "data"), "--device", device],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if how == "absent":
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith(f"nexrl serve tinker: --device: '{device}' asks for "), done.stderr
        assert ("use cpu" in lines[-1]) if device == "cuda" else ("use one of those" in lines[-1])
    else:
        assert "Invalid value for '--device': 'gpu0' is not a device a service runs on; use cpu, cuda or cuda:N" in done.stderr
