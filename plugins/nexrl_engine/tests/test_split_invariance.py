"""One step's gradient, loss and metrics do not depend on how the engine splits it into
micro-batches, for every registered loss under every aggregation mode.

The table comes from the registry (`loss_aggregation_cases`), so a new loss or mode is
covered without adding anything here. The reference is an independent formula: the
whole step in one pass, and for the loss value the mode's definition written out below.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from nexrl_core.testing.aggregation_cases import loss_aggregation_cases, with_entropy_bonus
from nexrl_engine import Datum, Engine

CASES = loss_aggregation_cases()
ONE_PASS = 16384
"""A micro-batch limit the whole step fits in."""
MANY_PASSES = 40
"""A limit that puts one or two datums in each micro-batch."""


@pytest.fixture(scope="module")
def engines() -> dict[int, Engine]:
    return {
        limit: Engine(model="nexrl-tiny", seed=0, share_prefixes=False, max_tokens_per_microbatch=limit)
        for limit in (ONE_PASS, MANY_PASSES)
    }


def _step(engine: Engine) -> list[Datum]:
    """24 datums of different lengths: a prompt, then a response whose sampler logprobs
    are the model's own shifted a little (so ratios straddle the clip bounds) and whose
    advantage is the same on every response token."""
    rng = random.Random(7)
    shapes = [(rng.randrange(2, 6), rng.randrange(1, 12)) for _ in range(24)]
    sequences = [[rng.randrange(3, engine.vocab_size) for _ in range(prompt + response)] for prompt, response in shapes]
    current = engine.compute_logprobs(sequences)
    datums = []
    for (prompt, response), tokens, logprobs in zip(shapes, sequences, current):
        shifts = [0.0] * (prompt - 1) + [rng.choice((-0.3, -0.05, 0.05, 0.3)) for _ in range(response)]
        advantage = rng.choice((-1.5, -0.4, 0.6, 1.2))
        mask = [0.0] * (prompt - 1) + [1.0] * response
        datums.append(
            Datum(
                input_tokens=tokens[:-1],
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [float(lp) + shift for lp, shift in zip(logprobs[1:], shifts)],
                    "advantages": [advantage * m for m in mask],
                    "mask": mask,
                },
            )
        )
    return datums


def _gradients(engine: Engine) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    engine.zero_grad()
    return grads


@pytest.mark.parametrize(("loss", "options"), CASES, ids=[f"{loss}-{options.get('agg_mode', 'none')}" for loss, options in CASES])
def test_micro_batches_do_not_change_the_step(engines: dict[int, Engine], loss: str, options: dict[str, Any]) -> None:
    options = with_entropy_bonus(loss, options)
    datums = _step(engines[ONE_PASS])
    results, grads = {}, {}
    for limit, engine in engines.items():
        results[limit] = engine.forward_backward(datums, loss, options)
        grads[limit] = _gradients(engine)
    whole, split = results[ONE_PASS], results[MANY_PASSES]
    assert set(split.metrics) == set(whole.metrics)
    for key, value in whole.metrics.items():
        assert split.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"metric {key} changes with the split"
    assert grads[ONE_PASS].keys() == grads[MANY_PASSES].keys()
    whole_grad = torch.cat([grad.flatten() for grad in grads[ONE_PASS].values()])
    split_grad = torch.cat([grads[MANY_PASSES][name].flatten() for name in grads[ONE_PASS]])
    error = float((split_grad - whole_grad).norm() / whole_grad.norm())
    assert error < 1e-5, (
        f"the gradient changes with the split: relative error {error:.3g} (norms {float(split_grad.norm()):.4g} vs {float(whole_grad.norm()):.4g})"
    )


def _per_token_nll(engine: Engine, datums: list[Datum]) -> list[list[float]]:
    return [[-lp for lp in output.logprobs] for output in engine.forward(datums, "cross_entropy").outputs]


@pytest.mark.parametrize("mode", ["token-sum", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_split_step_loss_is_the_modes_formula(engines: dict[int, Engine], mode: str) -> None:
    """Cross-entropy under each mode, split into many micro-batches, equals the mode's
    definition computed here from per-token losses."""
    engine = engines[MANY_PASSES]
    datums = _step(engine)
    nll = _per_token_nll(engines[ONE_PASS], datums)
    masks = [d.loss_fn_inputs["mask"] for d in datums]
    row_sums = [sum(value * m for value, m in zip(row, mask)) for row, mask in zip(nll, masks)]
    row_weights = [sum(mask) for mask in masks]
    rows = sum(1 for w in row_weights if w > 0)
    longest = max(len(d.input_tokens) for d in datums)
    expected = {
        "token-sum": sum(row_sums),
        "token-mean": sum(row_sums) / sum(row_weights),
        "seq-mean-token-mean": sum(s / w for s, w in zip(row_sums, row_weights) if w > 0) / rows,
        "seq-mean-token-sum": sum(row_sums) / rows,
        "seq-mean-token-sum-norm": sum(row_sums) / longest / rows,
    }[mode]
    metrics = engine.forward(datums, "cross_entropy", {"agg_mode": mode}).metrics
    reported = metrics["loss:sum" if mode == "token-sum" else "loss:mean"]
    assert reported == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_separate_calls_are_separate_steps_whose_gradients_add(engines: dict[int, Engine], mode: str) -> None:
    """What docs/aggregation.md promises for a step sent in several ``forward_backward``
    calls (as Tinker's SDK does with a large one): each call is aggregated over its own
    datums, and the gradients of the calls add up until ``optim_step``."""
    engine = engines[ONE_PASS]
    datums = _step(engine)
    halves = (datums[:10], datums[10:])
    separately = []
    for half in halves:
        engine.forward_backward(half, "cross_entropy", {"agg_mode": mode})
        separately.append(_gradients(engine))
    for half in halves:
        engine.forward_backward(half, "cross_entropy", {"agg_mode": mode})
    together = _gradients(engine)
    for name, grad in together.items():
        torch.testing.assert_close(grad, separately[0][name] + separately[1][name], rtol=1e-5, atol=1e-7)
    engine.forward_backward(datums, "cross_entropy", {"agg_mode": mode})
    one_call = torch.cat([grad.flatten() for grad in _gradients(engine).values()])
    two_calls = torch.cat([grad.flatten() for grad in together.values()])
    assert float(two_calls.norm()) > 1.5 * float(one_call.norm()), "two calls of a mean are two means, not one"


def test_signed_weights_cross_entropy_is_minus_sum_w_logp_whatever_the_split(engines: dict[int, Engine]) -> None:
    """Tinker's cross-entropy with signed weights (what ``forward_backward_custom`` sends
    for a loss that pushes some logprobs down): the step's loss is ``-sum w * logp``
    computed here from the model's logprobs, and neither it nor the gradient changes
    when the engine splits the step into micro-batches; NaN weights are still refused."""
    rng = random.Random(11)
    datums = [
        Datum(
            input_tokens=d.input_tokens,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": [m * rng.choice((-1.5, -0.5, 0.7, 2.0)) for m in d.loss_fn_inputs["mask"]],
            },
        )
        for d in _step(engines[ONE_PASS])
    ]
    assert any(w < 0 for d in datums for w in d.loss_fn_inputs["weights"])
    logprobs = [output.logprobs for output in engines[ONE_PASS].forward(datums, "cross_entropy").outputs]
    expected = -sum(w * lp for d, row in zip(datums, logprobs) for w, lp in zip(d.loss_fn_inputs["weights"], row))
    magnitude = sum(abs(w) for d in datums for w in d.loss_fn_inputs["weights"])
    results, grads = {}, {}
    for limit, engine in engines.items():
        results[limit] = engine.forward_backward(datums, "cross_entropy")
        grads[limit] = _gradients(engine)
        # Under a mean, a weight counts by its magnitude: sum(-w * logp) / sum(|w|).
        mean = engine.forward(datums, "cross_entropy", {"agg_mode": "token-mean"}).metrics["loss:mean"]
        assert mean == pytest.approx(expected / magnitude, rel=1e-5)
    for result in results.values():
        assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert result.metrics["num_tokens:sum"] == pytest.approx(magnitude)
    whole_grad = torch.cat([grad.flatten() for grad in grads[ONE_PASS].values()])
    split_grad = torch.cat([grads[MANY_PASSES][name].flatten() for name in grads[ONE_PASS]])
    assert float((split_grad - whole_grad).norm() / whole_grad.norm()) < 1e-5
    bad = Datum(input_tokens=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, float("nan"), -1.0]})
    with pytest.raises(ValueError, match="loss_mask has 1 NaN or inf entries"):
        engines[ONE_PASS].forward([bad], "cross_entropy")
