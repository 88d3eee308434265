"""Tinker's loss names through the real tinker SDK.

``forward_backward_custom`` with a DPO loss: the SDK turns the loss into cross-entropy
weights equal to minus its gradient, so the rejected answers' tokens arrive with
negative weights, which the service must train on. ``dro`` is served; ``stable_reinforce``
and the sampling option that feeds it are refused with the reason; provenance spans
are checked and accepted."""

from __future__ import annotations

import pytest
import tinker
import torch
from tinker import types

from nexrl_tinker.testing import BASE_MODEL

BETA = 0.5
PAIRS = (("12+34=", "46", "71"), ("7+8=", "15", "3"), ("40+2=", "42", "24"))
"""(question, chosen answer, rejected answer)."""


def _answer_datum(tokenizer, question: str, answer: str) -> types.Datum:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    tokens = prompt + tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}
    )


def _answer_logprob(datum: types.Datum, logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs * datum.loss_fn_inputs["weights"].to_torch()).sum()


def test_dpo_through_forward_backward_custom_lowers_its_loss(service_client) -> None:
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result(timeout=120)
    tokenizer = client.get_tokenizer()
    data = [_answer_datum(tokenizer, q, answer) for q, chosen, rejected in PAIRS for answer in (chosen, rejected)]
    reference = [
        _answer_logprob(datum, out["logprobs"].to_torch())
        for datum, out in zip(data, client.forward(data, "cross_entropy").result(timeout=120).loss_fn_outputs)
    ]

    def dpo_loss(batch: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        policy = [_answer_logprob(datum, lp) for datum, lp in zip(batch, logprobs)]
        margins = [BETA * ((policy[i] - reference[i]) - (policy[i + 1] - reference[i + 1])) for i in range(0, len(policy), 2)]
        loss = -torch.nn.functional.logsigmoid(torch.stack(margins)).mean()
        return loss, {"dpo_loss": float(loss.detach())}

    losses = []
    for _ in range(3):
        result = client.forward_backward_custom(data, dpo_loss).result(timeout=120)
        losses.append(result.metrics["dpo_loss"])
        client.optim_step(types.AdamParams(learning_rate=2e-3)).result(timeout=120)
    assert losses[0] > losses[1] > losses[2], losses


@pytest.fixture(scope="module")
def rl_client(service_client):
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result(timeout=120)


def _rl_datum(rl_client) -> types.Datum:
    """A prompt of 3 tokens and a response of 4, with the sampler's logprobs 0 on the prompt."""
    tokens = [5, 17, 29, 41, 53, 65, 77, 89]
    logprobs = [0.0, 0.0, -3.1, -2.4, -4.0, -1.2, -2.2]
    advantages = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": advantages},
    )


def test_dro_is_served_with_its_beta(rl_client) -> None:
    datum = _rl_datum(rl_client)
    losses = {}
    for beta in (0.0, 2.0):
        result = rl_client.forward([datum], "dro", {"beta": beta}).result(timeout=120)
        logprobs = result.loss_fn_outputs[0]["logprobs"].tolist()
        inputs = {key: value.tolist() for key, value in datum.loss_fn_inputs.items()}
        expected = -sum(
            lp * a - 0.5 * beta * (lp - lq) ** 2 for lp, lq, a in zip(logprobs, inputs["logprobs"], inputs["advantages"]) if a != 0
        )
        losses[beta] = result.metrics["loss:sum"]
        assert losses[beta] == pytest.approx(expected, rel=1e-4)
    assert losses[2.0] > losses[0.0]


def test_stable_reinforce_is_refused_with_the_reason(rl_client) -> None:
    with pytest.raises(tinker.TinkerError, match="'stable_reinforce' is not served here: Tinker has not published"):
        rl_client.forward([_rl_datum(rl_client)], "stable_reinforce").result(timeout=120)


def test_record_stability_info_is_refused_not_ignored(service_client) -> None:
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL, record_stability_info=True).result(timeout=60)
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(tinker.TinkerError, match="record_stability_info is for the 'stable_reinforce' loss"):
        sampler.sample(types.ModelInput.from_ints([5, 17, 29]), 1, params).result(timeout=60)


def test_provenance_spans_are_checked_and_change_nothing(rl_client) -> None:
    datum = _rl_datum(rl_client)
    tiled = datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:0", length=4), types.SampledProvenanceSpan(sequence_id="s:0", length=3)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="s:0", offset=1, length=3),
            types.SampledProvenanceSpan(sequence_id="s:0", length=4),
        ],
    )
    plain = rl_client.forward([datum], "ppo").result(timeout=120).metrics["loss:sum"]
    assert rl_client.forward([tiled], "ppo").result(timeout=120).metrics["loss:sum"] == pytest.approx(plain, rel=1e-6)
    short = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs=datum.loss_fn_inputs,
        model_input_spans=[types.PromptProvenanceSpan(sequence_id="s:0", length=2)],
        loss_fn_input_spans=tiled.loss_fn_input_spans,
    )
    with pytest.raises(tinker.TinkerError, match="model_input_spans cover 2 positions but the field has 7"):
        rl_client.forward([short], "ppo").result(timeout=120)
