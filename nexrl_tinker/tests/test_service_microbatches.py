"""``nexrl serve tinker --max-tokens-per-microbatch N``: every engine the service builds
packs its forward and forward/backward passes by N padded tokens, and the loss the SDK
gets does not depend on how a call was packed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH, ServeOptions
from nexrl_tinker.testing import BASE_MODEL, sft_data

BUDGET = 24
"""Below two of `sft_data`'s rows (checked in the test): each of its three datums gets a
pass of its own, where the default budget runs them in one."""


def _first_loss(client: Any) -> tuple[float, Any]:
    """The loss of one forward_backward of `sft_data` on a fresh seeded LoRA model, and
    its training client."""
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result(timeout=300)
    data = sft_data(training.get_tokenizer())
    assert min(len(datum.model_input.to_ints()) for datum in data) * 2 > BUDGET, "two rows must not fit one pass"
    return training.forward_backward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"], training


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["in-process", "worker-group"])
def test_every_engine_packs_by_the_service_budget_and_the_loss_is_the_same(
    workers: int, service: Any, service_client: Any, tmp_path: Path
) -> None:
    """The training model (on the service's own engine, or on a worker group whose ranks
    are sent the budget with each forward) and every sampler (the trained model's current
    weights, its exported weights, the base model's) are built with the budget; the same
    first step on the module's service, at the default budget, gives the same loss."""
    from nexrl_tinker.server.service import TinkerService

    packed = TinkerService(ServeOptions(port=0, data_dir=str(tmp_path), workers=workers, max_tokens_per_microbatch=BUDGET))
    client = tinker.ServiceClient(base_url=packed.start())
    try:
        loss, training = _first_loss(client)
        default_loss, _ = _first_loss(service_client)
        assert loss == pytest.approx(default_loss, rel=1e-5, abs=1e-5)

        exported = training.save_weights_for_sampler("packed").result(timeout=300).path
        samplers = [
            training.save_weights_and_get_sampling_client().result(timeout=300),
            client.create_sampling_client(model_path=exported).result(timeout=300),
            client.create_sampling_client(base_model=BASE_MODEL).result(timeout=300),
        ]
        prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("12+34="))
        for sampler in samplers:
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result(timeout=300)

        engines = packed.state.engines.loaded()
        assert len(engines) >= 4, engines  # the training model, its two samplers and the base model's
        assert {engine.config.max_tokens_per_microbatch for engine in engines} == {BUDGET}, engines
        defaults = service.state.engines.loaded()
        assert {engine.config.max_tokens_per_microbatch for engine in defaults} == {DEFAULT_MAX_TOKENS_PER_MICROBATCH}
    finally:
        client.close("success").result(timeout=60)
        packed.stop()
