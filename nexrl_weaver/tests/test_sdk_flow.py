"""The unmodified nex-weaver SDK drives the whole flow against the local service,
once with JSON tensors and once with ``WEAVER_TENSOR_TRANSPORT=http-binary``."""

from __future__ import annotations

import pytest
import weaver
from weaver.operations import WeaverOperationError
from weaver.types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams

from nexrl_weaver.testing import sdk_client

TRANSPORTS = ["default", "http-binary"]


@pytest.fixture(params=TRANSPORTS)
def client(request: pytest.FixtureRequest, base_url: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WEAVER_TENSOR_TRANSPORT", request.param)
    client = sdk_client(base_url)
    client.connect()
    assert client.tensor_transport == request.param
    yield client
    client.close()


def _datum(tokens: list[int], **inputs: list[float]) -> Datum:
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def test_whole_flow(client) -> None:
    lora = client.create_model(base_model="nexrl-tiny", lora_config=LoraConfig(rank=4, seed=1))
    full = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
    assert client.get_model(full.model_id)["training_mode"] == "full_ft"
    assert client.get_model(lora.model_id)["lora_config"]["rank"] == 4
    tokenizer = lora.get_tokenizer()
    prompt = [
        int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True, return_dict=False)
    ]

    path = lora.save_weights_for_sampler(name="initial")
    assert path == f"weaver://{lora.model_id}/sampler_weights/initial"
    sampler = client.create_sampling_client(model_path=path, base_model="nexrl-tiny", model_id=lora.model_id)
    result = sampler.sample(prompt=ModelInput.from_ints(prompt), sampling_params=SamplingParams(max_tokens=6, seed=3), num_samples=3)
    assert len(result["sequences"]) == 3
    for sequence in result["sequences"]:
        assert 0 < len(sequence["tokens"]) <= 6 and len(sequence["logprobs"]) == len(sequence["tokens"])
        assert sequence["text"] == tokenizer.decode(sequence["tokens"], skip_special_tokens=False)
        scored = sampler.compute_logprobs(prompt=ModelInput.from_ints(prompt + sequence["tokens"]))
        assert scored[0] is None and len(scored) == len(prompt) + len(sequence["tokens"])
        assert scored[len(prompt) :] == pytest.approx(sequence["logprobs"], abs=1e-4)

    stopped = sampler.sample(
        prompt=ModelInput.from_ints(prompt),
        sampling_params=SamplingParams(max_tokens=8, temperature=0.0, stop=[tokenizer.eos_token_id or 2]),
    )["sequences"][0]
    assert stopped["stop_reason"] == "stop" and stopped["tokens"][-1] == (tokenizer.eos_token_id or 2)
    by_length = sampler.sample(prompt=ModelInput.from_ints(prompt), sampling_params=SamplingParams(max_tokens=2, stop=[]))
    assert by_length["sequences"][0]["stop_reason"] == "length"

    tokens = prompt + result["sequences"][0]["tokens"]
    n = len(tokens) - 1
    sampled = [0.0] * (len(prompt) - 1) + result["sequences"][0]["logprobs"]
    advantages = [0.0] * (len(prompt) - 1) + [1.0] * (n - len(prompt) + 1)
    for model in (lora, full):
        ce = model.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy")
        assert ce["loss_fn_outputs"] == ce["result"]["loss_fn_outputs"] and ce["metrics"]["loss:sum"] > 0
        assert len(ce["loss_fn_outputs"][0]["logprobs"]["data"]) == n
        rl = model.forward_backward(
            [_datum(tokens, logprobs=sampled, advantages=advantages)], "importance_sampling", loss_fn_config={"entropy_coeff": 0.0}
        )
        assert rl["metrics"]
        forward = model.forward([_datum(tokens)], "forward_logprob")
        assert forward["loss_fn_outputs"][0]["logprobs"]["data"] == pytest.approx(ce["loss_fn_outputs"][0]["logprobs"]["data"], abs=1e-5)
        steps = model.optim_step(AdamParams(learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.1, grad_clip_norm=0.5))
        assert steps["metrics"]["lr"] == pytest.approx(1e-3) and steps["metrics"]["step"] == 1.0

        def loss_fn(data, logprobs):
            return -sum(lp.sum() for lp in logprobs), {"custom": 1.0}

        custom = model.forward_backward_custom([_datum(tokens)], loss_fn)
        assert custom["metrics"] == {"custom": 1.0} and float(custom["loss"]) > 0
        handle = model.optim_step(AdamParams(learning_rate=1e-3), wait=False)
        assert handle.result()["metrics"]["step"] == 2.0

    checkpoint = lora.save_state(name="resume", checkpoint_type="weight_and_optimizer")
    assert checkpoint.path == f"weaver://{lora.model_id}/checkpoints/resume" and checkpoint.id
    assert checkpoint.path in [c.path for c in lora.list_checkpoints()]
    trained = lora.forward([_datum(tokens)], "forward_logprob")["loss_fn_outputs"][0]["logprobs"]["data"]
    lora.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy")
    lora.optim_step(AdamParams(learning_rate=1e-2))
    moved = lora.forward([_datum(tokens)], "forward_logprob")["loss_fn_outputs"][0]["logprobs"]["data"]
    assert moved != pytest.approx(trained, abs=1e-4)
    lora.load_state_with_optimizer(checkpoint)
    restored = lora.forward([_datum(tokens)], "forward_logprob")["loss_fn_outputs"][0]["logprobs"]["data"]
    assert restored == pytest.approx(trained, abs=1e-5)
    lora.load_state(checkpoint.path)

    fresh = lora.save_weights_and_get_sampling_client(name="after")
    assert fresh.sample(prompt=ModelInput.from_ints(prompt), sampling_params=SamplingParams(max_tokens=2, seed=1))["sequences"]

    with pytest.raises(weaver.WeaverAPIError, match=r"\[400\].*outside the vocabulary"):
        lora.forward_backward([_datum([0, 10**6, 1], weights=[1.0, 1.0])], "cross_entropy")
    with pytest.raises(weaver.WeaverAPIError, match="unknown loss_fn 'no-such-loss'"):
        lora.forward_backward([_datum(tokens)], "no-such-loss")
    with pytest.raises(WeaverOperationError, match="has LoRA settings") as failed:
        full.load_state(checkpoint.path)  # a LoRA checkpoint into a fully fine-tuned model fails as it runs
    assert failed.value.code == "invalid_request" and failed.value.operation_id
    lora.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy")  # requests after a refusal still run

    client.close()
    checker = sdk_client(client._config.base_url)
    checker.connect(ensure_session=False)
    try:
        assert checker.get_model(lora.model_id)["status"] == "terminated"
        assert checker.get_model(full.model_id)["status"] == "terminated"
    finally:
        checker.close()


def test_surrogate_applies_exactly_the_gradient_it_carries(base_url: str) -> None:
    """``surrogate`` with weights -1 is cross-entropy with weights 1: same loss, same step."""
    client = sdk_client(base_url)
    client.connect()
    try:
        tokens = [1, 5, 9, 14, 20, 7, 3]
        n = len(tokens) - 1
        reference = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        surrogate = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        ce = reference.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy")
        linear = surrogate.forward_backward([_datum(tokens, surrogate_weights=[-1.0] * n)], "surrogate")
        assert linear["metrics"]["loss:sum"] == pytest.approx(ce["metrics"]["loss:sum"], rel=1e-5)
        for model in (reference, surrogate):
            model.optim_step(AdamParams(learning_rate=1e-3))
        after = [
            model.forward([_datum(tokens)], "forward_logprob")["loss_fn_outputs"][0]["logprobs"]["data"] for model in (reference, surrogate)
        ]
        assert after[1] == pytest.approx(after[0], abs=1e-5)
        assert after[0] != pytest.approx(ce["loss_fn_outputs"][0]["logprobs"]["data"], abs=1e-4)
    finally:
        client.close()


def test_async_client_trains_and_samples(base_url: str) -> None:
    import asyncio

    async def flow() -> None:
        async with weaver.AsyncServiceClient(base_url=base_url) as client:
            model = await client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
            path = await model.save_weights_for_sampler(name="async")
            sampler = await client.create_sampling_client(model_path=path, base_model="nexrl-tiny", model_id=model.model_id)
            result = await sampler.sample(prompt=ModelInput.from_ints([1, 5, 6]), sampling_params=SamplingParams(max_tokens=2, seed=1))
            assert result["sequences"][0]["tokens"]
            handle = await model.forward_backward([_datum([1, 5, 6, 7], weights=[1.0] * 3)], "cross_entropy", wait=False)
            assert (await handle.result())["metrics"]
            assert (await model.optim_step(AdamParams(learning_rate=1e-3)))["metrics"]["step"] == 1.0

    asyncio.run(flow())
