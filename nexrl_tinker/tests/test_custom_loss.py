"""``forward_backward_custom`` with a DPO loss through the real tinker SDK: the SDK turns
the loss into cross-entropy weights equal to minus its gradient, so the rejected
answers' tokens arrive with negative weights, which the service must train on."""

from __future__ import annotations

import torch
from nexrl_tinker.testing import BASE_MODEL
from tinker import types

BETA = 0.5
PAIRS = (("12+34=", "46", "71"), ("7+8=", "15", "3"), ("40+2=", "42", "24"))
"""(question, chosen answer, rejected answer)."""


def _answer_datum(tokenizer, question: str, answer: str) -> types.Datum:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    tokens = prompt + tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


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
        margins = [
            BETA * ((policy[i] - reference[i]) - (policy[i + 1] - reference[i + 1])) for i in range(0, len(policy), 2)
        ]
        loss = -torch.nn.functional.logsigmoid(torch.stack(margins)).mean()
        return loss, {"dpo_loss": float(loss.detach())}

    losses = []
    for _ in range(3):
        result = client.forward_backward_custom(data, dpo_loss).result(timeout=120)
        losses.append(result.metrics["dpo_loss"])
        client.optim_step(types.AdamParams(learning_rate=2e-3)).result(timeout=120)
    assert losses[0] > losses[1] > losses[2], losses
