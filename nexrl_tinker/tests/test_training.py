"""Training through the SDK really trains, and samplers made afterwards see the new weights."""

from __future__ import annotations

import time

import pytest
from tinker import types

from nexrl_tinker.testing import BASE_MODEL

PROBLEMS = [(12, 34), (5, 77), (40, 41), (3, 9), (60, 25), (18, 18), (71, 2), (33, 50)]
SHIFT = 11
"""The fixed set teaches a wrong sum (a + b + 11): far from what the tiny model believes."""


def build_data(tokenizer) -> tuple[list[types.Datum], list[list[int]], list[str]]:
    data, prompts, answers = [], [], []
    for a, b in PROBLEMS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        answer = str(a + b + SHIFT)
        completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        tokens = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
        prompts.append(prompt)
        answers.append(answer)
    return data, prompts, answers


def target_logprob(sampling_client, datum: types.Datum) -> float:
    """Sum of the sampler's logprobs of the weighted (completion) tokens."""
    tokens = datum.model_input.to_ints() + [datum.loss_fn_inputs["target_tokens"].tolist()[-1]]
    scored = sampling_client.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=120)
    weights = datum.loss_fn_inputs["weights"].tolist()
    return sum(lp for lp, w in zip(scored[1:], weights) if w > 0)


@pytest.mark.slow
def test_sft_halves_the_loss_and_new_sampler_sees_it(service_client) -> None:
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=1).result(timeout=120)
    tokenizer = training.get_tokenizer()
    data, prompts, answers = build_data(tokenizer)
    before_sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    before = [target_logprob(before_sampler, d) for d in data]

    losses = []
    for _ in range(24):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=2e-3))
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        opt.result(timeout=120)
    assert losses[-1] < 0.5 * losses[0], losses

    after_sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    after = [target_logprob(after_sampler, d) for d in data]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert sum(after) > sum(before) + 10

    # The old sampler kept its snapshot: its logprobs did not move.
    assert target_logprob(before_sampler, data[0]) == pytest.approx(before[0], abs=1e-4)

    # Greedy decoding now gives the taught (shifted) answers.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    correct = 0
    for prompt, answer in zip(prompts, answers):
        result = after_sampler.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[im_end])
        ).result(timeout=120)
        text = tokenizer.decode(result.sequences[0].tokens).replace("<|im_end|>", "").strip()
        correct += text == answer
    assert correct >= len(PROBLEMS) - 2


def _train(training, data: list[types.Datum], steps: int) -> None:
    for _ in range(steps):
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-3)).result(timeout=120)


def test_inflight_samplers_take_each_later_inflight_save_and_snapshots_keep_theirs(service_client) -> None:
    """Tinker's inflight contract: every inflight sampling client of a training model
    samples from its newest inflight save, clients made before it included; a snapshot
    client, and a later snapshot save, move nothing else."""
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=2).result(timeout=120)
    data, _, _ = build_data(training.get_tokenizer())
    first = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    snapshot = training.save_weights_and_get_sampling_client().result(timeout=120)
    before = target_logprob(first, data[0])
    _train(training, data, 3)
    second = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
    moved = target_logprob(second, data[0])
    assert moved > before + 1, "three steps toward the taught answer raise its logprob"
    assert target_logprob(first, data[0]) == pytest.approx(moved, abs=1e-4), "the first inflight client took the second save"
    assert target_logprob(snapshot, data[0]) == pytest.approx(before, abs=1e-4), "a snapshot keeps its weights"
    _train(training, data, 1)
    later = training.save_weights_and_get_sampling_client().result(timeout=120)
    assert target_logprob(later, data[0]) > moved
    assert [target_logprob(client, data[0]) for client in (first, second)] == pytest.approx([moved, moved], abs=1e-4), (
        "a snapshot save moves no inflight client"
    )


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _refusals() -> dict[str, object]:
    """A request of each kind the service refuses before queueing it, by what it refuses."""
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
        loss_fn_inputs={"target_tokens": [5], "weights": [1.0]},
    )
    return {
        "an image chunk (the codec)": lambda client, _: client.forward_backward([image], "cross_entropy").result(timeout=60),
        "sampler weights to load_state": lambda client, sampler_path: client.load_state(sampler_path).result(timeout=60),
    }


@pytest.mark.parametrize("refusal", sorted(_refusals()))
def test_a_request_refused_before_it_is_queued_does_not_stall_the_next_one(service_client, refusal: str) -> None:
    """The SDK numbers every request of a training client; a request the service refuses
    before queueing it (its body, its checkpoint's kind) has used its number all the same,
    so the client's next request runs at once instead of waiting out the service's gap
    timeout for a number that never comes (120 s by default)."""

    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4)
    sampler_path = client.save_weights_for_sampler("refusals").result(timeout=60).path
    with pytest.raises(Exception, match="400|image|training-state path"):
        _refusals()[refusal](client, sampler_path)
    started = time.monotonic()
    # A stall would wait out the gap timeout (120 s); the call takes well under a second.
    result = client.forward_backward([_datum([19, 20, 13, 21, 22, 31])], "cross_entropy").result(timeout=15)
    assert time.monotonic() - started < 15 and result.metrics["loss:sum"] > 0
