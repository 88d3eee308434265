"""forward / forward_backward with every registered loss, gradient accumulation, AdamW."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nexrl_core.config.adamw import AdamWSettings
from nexrl_engine import Datum, Engine, SamplingParams
from nexrl_engine.loss_fns import build_loss_fn

RL_LOSSES = ["importance_sampling", "ppo", "cispo", "gspo", "dro"]


def _rl_datum(engine: Engine, rng: random.Random, length: int) -> Datum:
    tokens = [rng.randrange(3, engine.vocab_size) for _ in range(length + 1)]
    prompt = length // 2
    return Datum(
        input_tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            # The sampler's logprobs: 0 on the prompt, slightly off-policy on the response.
            "logprobs": [0.0] * prompt + [-6.5 - 0.1 * i for i in range(length - prompt)],
            "advantages": [0.0] * prompt + [1.0 if i % 2 else -0.5 for i in range(length - prompt)],
            **({"sequence_ratio_mask": [0.0] * prompt + [1.0] * (length - prompt)}),
        },
    )


def _sft_datum(tokens: list[int], prompt: int) -> Datum:
    return Datum(
        input_tokens=tokens[:-1],
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (prompt - 1) + [1.0] * (len(tokens) - prompt)},
    )


def _grads(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", *RL_LOSSES])
def test_each_loss(engine: Engine, loss_fn: str) -> None:
    rng = random.Random(0)
    datums = [_rl_datum(engine, rng, n) for n in (7, 12, 4)]
    if loss_fn == "cross_entropy":
        datums = [
            Datum(
                input_tokens=d.input_tokens,
                loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs["sequence_ratio_mask"]},
            )
            for d in datums
        ]
    plain = engine.compute_logprobs([list(d.input_tokens) + [d.loss_fn_inputs["target_tokens"][-1]] for d in datums])
    result = engine.forward_backward(datums, loss_fn)
    assert result.loss_fn == loss_fn
    assert math.isfinite(result.metrics["loss:sum"])
    assert result.metrics["num_sequences:sum"] == 3
    for datum, output, expected in zip(datums, result.outputs, plain):
        assert len(output.logprobs) == len(datum.input_tokens)
        assert output.logprobs == pytest.approx(expected[1:], abs=1e-5)
    grads = _grads(engine)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


@pytest.mark.parametrize("beta", [0.05, 0.7])
def test_dro_on_tinker_datums_is_its_published_objective(shared_engine: Engine, beta: float) -> None:
    """``dro`` on Tinker-shaped datums (no mask key: the response is where the advantage
    is non-zero) sums -(A * logp - beta / 2 * (logp - logq)^2) over the response, with
    ``beta`` from ``loss_fn_config``."""
    rng = random.Random(5)
    datums = [_rl_datum(shared_engine, rng, n) for n in (7, 12, 4)]
    datums = [
        Datum(input_tokens=d.input_tokens, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"})
        for d in datums
    ]
    result = shared_engine.forward(datums, "dro", {"beta": beta})
    expected = 0.0
    for datum, output in zip(datums, result.outputs):
        inputs = datum.loss_fn_inputs
        for lp, lq, a in zip(output.logprobs, inputs["logprobs"], inputs["advantages"]):
            if a != 0:
                expected -= lp * a - 0.5 * beta * (lp - lq) ** 2
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_stable_reinforce_is_refused_with_its_reason(shared_engine: Engine) -> None:
    datum = _rl_datum(shared_engine, random.Random(6), 5)
    with pytest.raises(ValueError, match="'stable_reinforce' is not served here: Tinker has not published"):
        shared_engine.forward([datum], "stable_reinforce")


def test_rl_mask_defaults_to_the_positions_with_an_advantage(shared_engine: Engine) -> None:
    """Without a mask key, RL losses weigh the positions whose advantage is non-zero: the
    Tinker sum over every position is the same (zero advantages add nothing), and the
    token counts and metrics cover the trained tokens only."""
    datum = _rl_datum(shared_engine, random.Random(8), 10)
    unmasked = Datum(
        input_tokens=datum.input_tokens,
        loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "sequence_ratio_mask"},
    )
    everywhere = Datum(input_tokens=datum.input_tokens, loss_fn_inputs={**unmasked.loss_fn_inputs, "mask": [1.0] * 10})
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        a = shared_engine.forward([datum], loss_fn).metrics
        b = shared_engine.forward([unmasked], loss_fn).metrics
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        assert a["num_tokens:sum"] == b["num_tokens:sum"] == 5
        if loss_fn != "gspo":  # gspo's sequence ratio changes with the mask
            c = shared_engine.forward([everywhere], loss_fn).metrics
            assert c["loss:sum"] == pytest.approx(b["loss:sum"], rel=1e-5, abs=1e-6)
            assert c["num_tokens:sum"] == 10


def test_on_policy_metrics_cover_the_response_only(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """A Tinker RL datum built from the sampler's own output (logprobs 0 on the prompt,
    advantages 0 there, no mask key) is on-policy: approx_kl ~0, ratios ~1, no clipping."""
    results = shared_engine.sample(chat_prompts[:4], SamplingParams(max_tokens=8, seed=11), num_samples=2)
    datums = []
    for prompt, result in zip(chat_prompts, results):
        for index, sequence in enumerate(result.sequences):
            tokens = prompt + sequence.tokens
            n_prompt = len(prompt) - 1
            datums.append(
                Datum(
                    input_tokens=tokens[:-1],
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + sequence.logprobs,
                        "advantages": [0.0] * n_prompt + [1.0 if index else -1.0] * len(sequence.tokens),
                    },
                )
            )
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        metrics = shared_engine.forward(datums, loss_fn).metrics
        assert abs(metrics["approx_kl:mean"]) < 1e-5, (loss_fn, metrics)
        assert metrics["ratio/mean:mean"] == pytest.approx(1.0, abs=1e-3)
        assert metrics["ratio/min:min"] > 0.99 and metrics["ratio/max:max"] < 1.01
        if "clip_frac:mean" in metrics:
            assert metrics["clip_frac:mean"] == 0.0
        assert metrics["num_tokens:sum"] == sum(len(s.tokens) for r in results for s in r.sequences)


def test_cross_entropy_is_a_weighted_sum(engine: Engine) -> None:
    tokens = [1, 40, 50, 60, 70, 80, 90]
    datum = Datum(input_tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0, 0.5, 1.0, 1.0, 2.0, 0.0]})
    result = engine.forward([datum], "cross_entropy")
    logprobs = result.outputs[0].logprobs
    expected = -sum(w * lp for w, lp in zip(datum.loss_fn_inputs["weights"], logprobs))
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert result.metrics["num_tokens:sum"] == pytest.approx(4.5)
    assert all(p.grad is None for p in engine.model.parameters())  # forward leaves gradients alone


def test_forward_equals_forward_backward_values(engine: Engine) -> None:
    datums = [_rl_datum(engine, random.Random(1), 9)]
    a = engine.forward(datums, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    b = engine.forward_backward(datums, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert a.metrics == pytest.approx(b.metrics)
    assert a.outputs == b.outputs


def test_tinker_config_mapping() -> None:
    fn = build_loss_fn("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.25})
    assert fn.config.clip_low == pytest.approx(0.3)
    assert fn.config.clip_high == pytest.approx(0.25)
    assert fn.config.agg_mode.value == "token-sum"
    defaults = build_loss_fn("cispo")
    assert (defaults.config.clip_low, defaults.config.clip_high) == pytest.approx((0.2, 0.2))
    override = build_loss_fn("cross_entropy", {"agg_mode": "token-mean"})
    assert override.config.agg_mode.value == "token-mean"


def test_gradient_accumulation_matches_one_call(shared_engine: Engine) -> None:
    rng = random.Random(2)
    first, second = _rl_datum(shared_engine, rng, 6), _rl_datum(shared_engine, rng, 11)
    one = Engine(model="nexrl-tiny")
    one.forward_backward([first, second], "ppo")
    together = _grads(one)
    two = Engine(model="nexrl-tiny")
    two.forward_backward([first], "ppo")
    two.forward_backward([second], "ppo")
    separate = _grads(two)
    assert together.keys() == separate.keys()
    for name in together:
        torch.testing.assert_close(together[name], separate[name], rtol=1e-3, atol=1e-5)


def test_microbatching_does_not_change_the_result(shared_engine: Engine) -> None:
    rng = random.Random(3)
    datums = [_rl_datum(shared_engine, rng, n) for n in (5, 9, 3, 8)]
    big = Engine(model="nexrl-tiny")
    small = Engine(model="nexrl-tiny", max_tokens_per_microbatch=10)
    a = big.forward_backward(datums, "cispo")
    b = small.forward_backward(datums, "cispo")
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    assert a.metrics["approx_kl:mean"] == pytest.approx(b.metrics["approx_kl:mean"], rel=1e-5)
    ga, gb = _grads(big), _grads(small)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-3, atol=1e-5)


def test_optim_step_changes_weights_and_clears_grads(engine: Engine) -> None:
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.forward_backward([_rl_datum(engine, random.Random(4), 8)], "importance_sampling")
    result = engine.optim_step(AdamWSettings(learning_rate=1e-3))
    assert not result.skipped and result.step == 1 == engine.step
    assert result.grad_norm > 0 and result.metrics["lr"] == 1e-3
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed
    assert all(p.grad is None for p in engine.model.parameters())
    engine.forward_backward([_rl_datum(engine, random.Random(5), 8)], "importance_sampling")
    second = engine.optim_step(learning_rate=5e-4)
    assert second.step == 2
    assert engine._optimizer.optimizer.param_groups[0]["lr"] == 5e-4


def test_weight_decay_is_decoupled(engine: Engine) -> None:
    """Zero gradients: Adam's update is 0, so only decay acts: w <- w * (1 - lr * wd)."""
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for parameter in engine.model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    engine.optim_step(learning_rate=0.01, weight_decay=0.1)
    for name, parameter in engine.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), before[name] * (1 - 0.01 * 0.1), rtol=0, atol=1e-7)


def test_grad_clip_by_global_norm(engine: Engine) -> None:
    """Hand-set gradients of known norm: the first moment after one step is (1 - beta1) x
    the clipped gradient, and the reported norm is the unclipped one."""
    params = list(engine.model.parameters())
    total = sum(p.numel() for p in params)
    for parameter in params:
        parameter.grad = torch.full_like(parameter, 2.0)
    norm = 2.0 * math.sqrt(total)
    result = engine.optim_step(learning_rate=1e-3, beta1=0.9, grad_clip_norm=1.0)
    assert result.clipped and result.grad_norm == pytest.approx(norm, rel=1e-5)
    state = engine._optimizer.optimizer.state[params[0]]
    torch.testing.assert_close(state["exp_avg"], torch.full_like(params[0], 0.1 * 2.0 / norm), rtol=1e-4, atol=0)


def test_no_clip_below_threshold(engine: Engine) -> None:
    params = list(engine.model.parameters())
    for parameter in params:
        parameter.grad = torch.full_like(parameter, 1e-4)
    result = engine.optim_step(learning_rate=1e-3, beta1=0.5, grad_clip_norm=1e6)
    assert not result.clipped
    torch.testing.assert_close(engine._optimizer.optimizer.state[params[0]]["exp_avg"], torch.full_like(params[0], 0.5e-4))


def test_non_finite_gradient_skips_the_step(engine: Engine) -> None:
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for parameter in engine.model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    next(engine.model.parameters()).grad[0, 0] = float("inf")
    result = engine.optim_step(learning_rate=1e-3, grad_clip_norm=1.0)
    assert result.skipped and result.step == 0 and not math.isfinite(result.grad_norm)
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert all(p.grad is None for p in engine.model.parameters())


def test_sft_halves_the_loss(engine: Engine) -> None:
    rng = random.Random(6)
    data = [_sft_datum([1] + [rng.randrange(3, 1000) for _ in range(10)], prompt=3) for _ in range(8)]
    first = engine.forward(data, "cross_entropy").metrics["loss:sum"]
    for _ in range(30):
        engine.forward_backward(data, "cross_entropy")
        engine.optim_step(learning_rate=3e-3, beta2=0.99, eps=1e-8)
    last = engine.forward(data, "cross_entropy").metrics["loss:sum"]
    assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize(
    ("loss_fn", "config", "datum_inputs", "message"),
    [
        ("no_such_loss", None, None, "unknown loss_fn 'no_such_loss'"),
        ("ppo", {"clip_lo": 0.2}, None, r"loss_fn_config keys \['clip_lo'\] are not options of loss_fn 'ppo'"),
        ("importance_sampling", {"clip_low_threshold": 0.8}, None, "has no clipping, so 'clip_low_threshold' does not apply"),
        ("ppo", {"clip_low_threshold": 1.5}, None, "bad loss_fn_config"),
        ("cross_entropy", None, {"target_tokens": [2, 3], "weights": [1.0, 1.0]}, r"'target_tokens'\] has 2 values but input_tokens has 3"),
        ("cross_entropy", None, {"weights": [1.0, 1.0, 1.0]}, r"needs loss_fn_inputs \['target_tokens'\]"),
        ("ppo", None, {"target_tokens": [2, 3, 4], "logprobs": [0.0] * 3}, r"needs loss_fn_inputs \['advantages'\]"),
        ("cross_entropy", None, {"target_tokens": [2, 3, 4], "weight": [1.0] * 3}, r"unknown loss_fn_inputs keys \['weight'\]"),
        ("cross_entropy", None, {"target_tokens": [2, 3, 4000]}, "outside the vocabulary"),
    ],
)
def test_bad_training_input(shared_engine: Engine, loss_fn, config, datum_inputs, message) -> None:
    inputs = datum_inputs or {"target_tokens": [2, 3, 4], "weights": [1.0] * 3, "logprobs": [0.0] * 3, "advantages": [1.0] * 3}
    datum = Datum(input_tokens=[1, 2, 3], loss_fn_inputs=inputs)
    with pytest.raises(ValueError, match=message):
        shared_engine.forward([datum], loss_fn, config)


def test_empty_datums_and_inputs(shared_engine: Engine) -> None:
    with pytest.raises(ValueError, match="non-empty list of Datum"):
        shared_engine.forward([], "cross_entropy")
    with pytest.raises(ValueError, match="datum 0: input_tokens is empty"):
        shared_engine.forward([Datum(input_tokens=[], loss_fn_inputs={"target_tokens": []})], "cross_entropy")


def test_bad_adam_params(engine: Engine) -> None:
    with pytest.raises(ValueError, match="unknown AdamW fields"):
        engine.optim_step(lr=1e-3)
    with pytest.raises(ValueError, match="beta2 must be in"):
        engine.optim_step(beta2=1.0)
