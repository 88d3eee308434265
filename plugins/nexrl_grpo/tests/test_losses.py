"""Policy losses: hand-computed values, gradients, padding and input checks."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest
import torch

from nexrl_core.training.algorithms import PolicyLossInputs, StepTotals
from nexrl_grpo.config import (
    AggMode,
    CispoLossConfig,
    CrossEntropyLossConfig,
    DroLossConfig,
    GspoLossConfig,
    ImportanceSamplingLossConfig,
    PPOLossConfig,
)
from nexrl_grpo.losses import (
    CispoLoss,
    CrossEntropyLoss,
    DroLoss,
    GspoLoss,
    ImportanceSamplingLoss,
    PPOLoss,
)

LOSSES: dict[str, Callable[..., object]] = {
    "ppo": lambda **o: PPOLoss(PPOLossConfig(**o)),
    "importance_sampling": lambda **o: ImportanceSamplingLoss(ImportanceSamplingLossConfig(**o)),
    "cross_entropy": lambda **o: CrossEntropyLoss(CrossEntropyLossConfig(**o)),
    "cispo": lambda **o: CispoLoss(CispoLossConfig(**o)),
    "gspo": lambda **o: GspoLoss(GspoLossConfig(**o)),
    "dro": lambda **o: DroLoss(DroLossConfig(**o)),
}
WITH_ENTROPY = ["ppo", "importance_sampling", "cispo", "gspo"]


def ratio_inputs(
    ratios: list[list[float]],
    advantages: list[list[float]],
    mask: list[list[float]] | None = None,
    requires_grad: bool = True,
) -> PolicyLossInputs:
    """Inputs with old logprobs 0, so logprobs = log(ratio) and the ratio is exactly ``ratios``."""
    logprobs = torch.tensor(ratios, dtype=torch.float64).log().requires_grad_(requires_grad)
    return PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs, requires_grad=False),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        loss_mask=torch.ones_like(logprobs) if mask is None else torch.tensor(mask, dtype=torch.float64),
    )


def gradient(loss: torch.Tensor, inputs: PolicyLossInputs) -> list[list[float]]:
    loss.backward()
    assert inputs.logprobs.grad is not None
    return inputs.logprobs.grad.tolist()


def random_inputs(seed: int, batch: int = 3, width: int = 5, log_ratio_scale: float = 0.3) -> PolicyLossInputs:
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    logprobs = old + log_ratio_scale * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    return PolicyLossInputs(
        logprobs=logprobs.requires_grad_(True),
        old_logprobs=old,
        advantages=torch.randn(batch, width, generator=generator, dtype=torch.float64),
        entropy=torch.rand(batch, width, generator=generator, dtype=torch.float64),
        loss_mask=(torch.rand(batch, width, generator=generator, dtype=torch.float64) > 0.3).double(),
    )


# --- ppo ------------------------------------------------------------------------------------------------


def test_ppo_clips_on_both_sides() -> None:
    # clip range [0.8, 1.2]
    # token 0: A = 1,  r = 1.5: max(-1.5, -1.2) = -1.2 (clipped high)
    # token 1: A = -1, r = 0.5: max(0.5, 0.8) = 0.8   (clipped low)
    # token 2: A = -2, r = 1.1: max(2.2, 2.2) = 2.2   (inside)
    # token 3: A = 1,  r = 0.7: max(-0.7, -0.8) = -0.7 (below range, but A > 0: not clipped)
    inputs = ratio_inputs([[1.5, 0.5, 1.1, 0.7]], [[1.0, -1.0, -2.0, 1.0]])
    out = PPOLoss(PPOLossConfig())(inputs)
    # (-1.2 + 0.8 + 2.2 - 0.7) / 4 = 0.275
    assert out.loss.item() == pytest.approx(0.275)
    assert out.metrics["loss"] == pytest.approx(0.275)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert out.metrics["clip_frac/low"] == pytest.approx(0.25)
    assert out.metrics["clip_frac/high"] == pytest.approx(0.25)
    # (1.5 + 0.5 + 1.1 + 0.7) / 4
    assert out.metrics["ratio/mean"] == pytest.approx(0.95)
    assert out.metrics["ratio/min"] == pytest.approx(0.5)
    assert out.metrics["ratio/max"] == pytest.approx(1.5)
    # (r - 1) - ln r: 0.5 - 0.4054651 = 0.0945349, -0.5 + 0.6931472 = 0.1931472,
    # 0.1 - 0.0953102 = 0.0046898, -0.3 + 0.3566749 = 0.0566749; mean 0.3490468 / 4
    assert out.metrics["approx_kl"] == pytest.approx(0.0872617, abs=1e-7)
    assert "dual_clip_frac" not in out.metrics
    # d(-A r)/d logp = -A r on unclipped tokens, 0 on clipped ones, / 4 tokens:
    # token 2: 2 * 1.1 / 4 = 0.55; token 3: -0.7 / 4 = -0.175
    assert gradient(out.loss, inputs)[0] == pytest.approx([0.0, 0.0, 0.55, -0.175])


def test_ppo_asymmetric_clip() -> None:
    # clip range [0.8, 1.3]: token 0 (A = 1, r = 1.5) now gives max(-1.5, -1.3) = -1.3
    inputs = ratio_inputs([[1.5, 1.25]], [[1.0, 1.0]])
    out = PPOLoss(PPOLossConfig(clip_high=0.3))(inputs)
    # (-1.3 - 1.25) / 2
    assert out.loss.item() == pytest.approx(-1.275)
    assert out.metrics["clip_frac/high"] == pytest.approx(0.5)


def test_ppo_dual_clip() -> None:
    # c = 3, clip range [0.8, 1.2]
    # token 0: A = -1, r = 5: max(5, 1.2) = 5 -> capped at -A * c = 3 (dual clip)
    # token 1: A = -1, r = 2: max(2, 1.2) = 2 < 3 -> 2
    # token 2: A = 1,  r = 5: max(-5, -1.2) = -1.2 (no dual clip for A > 0)
    inputs = ratio_inputs([[5.0, 2.0, 5.0]], [[-1.0, -1.0, 1.0]])
    out = PPOLoss(PPOLossConfig(dual_clip_c=3.0))(inputs)
    # (3 + 2 - 1.2) / 3
    assert out.loss.item() == pytest.approx(3.8 / 3)
    assert out.metrics["dual_clip_frac"] == pytest.approx(1 / 3)
    # only token 1 passes a gradient: d(-A r)/d logp = r = 2, / 3 tokens
    assert gradient(out.loss, inputs)[0] == pytest.approx([0.0, 2 / 3, 0.0])


def test_entropy_bonus() -> None:
    inputs = ratio_inputs([[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]])
    inputs = attrs.evolve(inputs, entropy=torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
    out = PPOLoss(PPOLossConfig(entropy_coeff=0.1))(inputs)
    # pg loss: -A r = -1 per token; entropy token mean (1 + 2 + 3 + 4) / 4 = 2.5
    # loss = -1 - 0.1 * 2.5 = -1.25
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.metrics["loss"] == pytest.approx(-1.0)
    assert out.metrics["entropy"] == pytest.approx(2.5)


@pytest.mark.parametrize("name", WITH_ENTROPY)
def test_entropy_coeff_without_entropy_is_an_error(name: str) -> None:
    inputs = ratio_inputs([[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="entropy_coeff=0.01 but the batch carries no entropy"):
        LOSSES[name](entropy_coeff=0.01)(inputs)


# --- the other losses ------------------------------------------------------------------------------------


def test_importance_sampling() -> None:
    inputs = ratio_inputs([[1.5, 0.5]], [[1.0, -2.0]])
    out = ImportanceSamplingLoss(ImportanceSamplingLossConfig())(inputs)
    # (-1.5 * 1 + -0.5 * -2) / 2 = (-1.5 + 1) / 2 = -0.25
    assert out.loss.item() == pytest.approx(-0.25)
    # d(-r A)/d logp = -r A: [-1.5, 1.0] / 2
    assert gradient(out.loss, inputs)[0] == pytest.approx([-0.75, 0.5])


def test_cross_entropy() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    loss = CrossEntropyLoss(CrossEntropyLossConfig())
    out = loss(PolicyLossInputs(logprobs=logprobs, loss_mask=torch.tensor([[1.0, 1.0, 0.0]])))
    # (1 + 2) / 2
    assert out.loss.item() == pytest.approx(1.5)
    weighted = loss(PolicyLossInputs(logprobs=logprobs, loss_mask=torch.tensor([[0.5, 1.0, 0.0]])))
    # (0.5 * 1 + 1 * 2) / 1.5
    assert weighted.loss.item() == pytest.approx(2.5 / 1.5)
    summed = CrossEntropyLoss(CrossEntropyLossConfig(agg_mode="token-sum"))(
        PolicyLossInputs(logprobs=logprobs, loss_mask=torch.tensor([[0.5, 1.0, 0.0]]))
    )
    # 0.5 * 1 + 1 * 2
    assert summed.loss.item() == pytest.approx(2.5)


def signed_weights_case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [3, 6] and weights of both signs, with zeros (untrained) among them."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    weights = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    weights[weights.abs() < 0.3] = 0.0
    assert (weights < 0).any() and (weights > 0).any() and (weights == 0).any()
    return logprobs, weights


def test_cross_entropy_with_signed_weights_is_minus_sum_w_logp() -> None:
    logprobs, weights = signed_weights_case(seed=21)
    leaf = logprobs.clone().requires_grad_(True)
    out = CrossEntropyLoss(CrossEntropyLossConfig(agg_mode="token-sum"))(PolicyLossInputs(logprobs=leaf, loss_mask=weights))
    expected = -sum(w * lp for w_row, lp_row in zip(weights.tolist(), logprobs.tolist()) for w, lp in zip(w_row, lp_row))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    out.loss.backward()
    assert leaf.grad is not None
    assert torch.allclose(leaf.grad, -weights)


def test_signed_weights_weigh_metrics_by_magnitude() -> None:
    """A negative weight reverses a token's loss, not its share of a diagnostic: the
    ratio mean is weighted by |w|."""
    inputs = ratio_inputs([[1.5, 0.5, 2.0]], [[1.0, 1.0, 1.0]], mask=[[-1.0, 3.0, 0.0]])
    metrics = ImportanceSamplingLoss(ImportanceSamplingLossConfig())(inputs).metrics
    assert metrics["ratio/mean"] == pytest.approx((1 * 1.5 + 3 * 0.5) / 4)


@pytest.mark.parametrize("mode", [m.value for m in AggMode])
def test_signed_weights_do_not_depend_on_the_micro_batch_split(mode: str) -> None:
    logprobs, weights = signed_weights_case(seed=22)
    loss = CrossEntropyLoss(CrossEntropyLossConfig(agg_mode=mode))
    totals = StepTotals.of(weights)
    whole = loss(PolicyLossInputs(logprobs=logprobs, loss_mask=weights, step_totals=totals)).loss.item()
    parts = sum(
        loss(PolicyLossInputs(logprobs=logprobs[rows], loss_mask=weights[rows], step_totals=totals)).loss.item()
        for rows in (slice(0, 1), slice(1, 3))
    )
    assert parts == pytest.approx(whole, rel=1e-12)
    # Divisors count a weight by its magnitude: token-mean is sum(-w * logp) / sum(|w|).
    if mode == "token-mean":
        assert whole == pytest.approx(float((-weights * logprobs).sum() / weights.abs().sum()), rel=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.05, 1.3])
def test_dro_is_its_published_objective(beta: float) -> None:
    """Tinker's DRO: loss = -sum(logp * A - beta / 2 * (logp - logq)^2) over the trained
    tokens, written out here in plain Python; its gradient is -A + beta * (logp - logq)."""
    inputs = random_inputs(seed=31, log_ratio_scale=0.8)
    out = DroLoss(DroLossConfig(beta=beta, agg_mode="token-sum"))(inputs)
    rows = zip(inputs.logprobs.tolist(), inputs.old_logprobs.tolist(), inputs.advantages.tolist(), inputs.loss_mask.tolist())
    expected = -sum(m * (lp * a - 0.5 * beta * (lp - lq) ** 2) for lps, lqs, advs, ms in rows for lp, lq, a, m in zip(lps, lqs, advs, ms))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    out.loss.backward()
    expected_grad = inputs.loss_mask * (-inputs.advantages + beta * (inputs.logprobs.detach() - inputs.old_logprobs))
    assert torch.allclose(inputs.logprobs.grad, expected_grad)


def test_cispo() -> None:
    # clip range [0.8, 1.2]: weights sg(clip(r)) = [1.2, 0.8, 1.1]; logp = ln r
    inputs = ratio_inputs([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]])
    out = CispoLoss(CispoLossConfig())(inputs)
    # -1.2 * 1 * 0.4054651 = -0.4865581; -0.8 * -1 * -0.6931472 = -0.5545177;
    # -1.1 * 2 * 0.0953102 = -0.2096824; sum -1.2507582, / 3
    assert out.loss.item() == pytest.approx(-0.4169194, abs=1e-7)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 3)
    # gradient -w A / 3: [-1.2 / 3, 0.8 / 3, -2.2 / 3]; clipped tokens keep theirs
    assert gradient(out.loss, inputs)[0] == pytest.approx([-0.4, 0.8 / 3, -2.2 / 3])


def test_cispo_gradient_is_clipped_ratio_times_advantage() -> None:
    torch.manual_seed(0)
    inputs = random_inputs(seed=3, log_ratio_scale=0.5)
    config = CispoLossConfig(clip_low=0.1, clip_high=0.1)
    out = CispoLoss(config)(inputs)
    out.loss.backward()
    ratio = torch.exp(inputs.logprobs.detach() - inputs.old_logprobs)
    clipped = ratio.clamp(0.9, 1.1)
    weights = inputs.loss_mask
    expected = -clipped * inputs.advantages * weights / weights.sum()
    assert ((ratio < 0.9) | (ratio > 1.1))[weights > 0].any(), "the case must include clipped tokens"
    torch.testing.assert_close(inputs.logprobs.grad, expected)


def test_gspo() -> None:
    # clip range [0.8, 1.2]; old logprobs 0 so logp = log ratio
    # row 0: log ratios [0.1, 0.3], third token masked; s = e^0.2 = 1.2214 -> A = 1: max(-1.2214, -1.2) = -1.2
    # row 1: log ratios [-0.1, 0, 0.1]; s = e^0 = 1 -> A = -1: 1 per token
    logprobs = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 0.1]], dtype=torch.float64, requires_grad=True)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros(2, 3, dtype=torch.float64),
        advantages=torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64),
        loss_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64),
    )
    out = GspoLoss(GspoLossConfig(clip_low=0.2, clip_high=0.2))(inputs)
    # seq-mean-token-mean: (-1.2 + 1) / 2 = -0.1
    assert out.loss.item() == pytest.approx(-0.1)
    # 2 clipped tokens of 5
    assert out.metrics["clip_frac"] == pytest.approx(0.4)
    # ratio metrics are the sequence ratios on trained tokens: e^0.2 (x2), 1 (x3)
    assert out.metrics["ratio/max"] == pytest.approx(math.exp(0.2))
    assert out.metrics["ratio/mean"] == pytest.approx((2 * math.exp(0.2) + 3) / 5)
    # row 0 clipped: no gradient; row 1: -A * s = 1 per token, / 3 tokens / 2 rows
    assert gradient(out.loss, inputs) == [pytest.approx([0.0, 0.0, 0.0]), pytest.approx([1 / 6] * 3)]


def test_gspo_default_clip_is_tight() -> None:
    # s = e^0.0001 = 1.0001 lies inside [1 - 3e-4, 1 + 4e-4]; s = e^0.001 does not
    logprobs = torch.tensor([[1e-4, 1e-4], [1e-3, 1e-3]], dtype=torch.float64)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros(2, 2, dtype=torch.float64),
        advantages=torch.ones(2, 2, dtype=torch.float64),
        loss_mask=torch.ones(2, 2, dtype=torch.float64),
    )
    out = GspoLoss(GspoLossConfig())(inputs)
    # row 0: -e^0.0001 = -1.0001000; row 1: -(1 + 4e-4) = -1.0004; mean -1.0002500
    assert out.loss.item() == pytest.approx(-1.00025, abs=1e-7)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)


# --- aggregation modes through a loss ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # per-token loss -A r with r = 1: row 0 [-1, -2, -3] (3 tokens), row 1 [-4] (1 token)
        ("token-mean", -10 / 4),
        ("seq-mean-token-mean", (-6 / 3 - 4) / 2),
        ("seq-mean-token-sum", (-6 - 4) / 2),
        ("seq-mean-token-sum-norm", (-6 / 3 - 4 / 3) / 2),
        ("token-sum", -10.0),
    ],
)
def test_loss_uses_the_configured_aggregation(mode: str, expected: float) -> None:
    inputs = ratio_inputs([[1.0] * 3] * 2, [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], mask=[[1, 1, 1], [1, 0, 0]])
    assert PPOLoss(PPOLossConfig(agg_mode=mode))(inputs).loss.item() == pytest.approx(expected)


def test_norm_constant_reaches_the_aggregation() -> None:
    inputs = ratio_inputs([[1.0] * 3] * 2, [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], mask=[[1, 1, 1], [1, 0, 0]])
    config = ImportanceSamplingLossConfig(agg_mode="seq-mean-token-sum-norm", norm_constant=10.0)
    # (-6 / 10 - 4 / 10) / 2
    assert ImportanceSamplingLoss(config)(inputs).loss.item() == pytest.approx(-0.5)


# --- gradients -------------------------------------------------------------------------------------------


def gradcheck(loss: Callable[[PolicyLossInputs], object], inputs: PolicyLossInputs) -> None:
    def value(logprobs: torch.Tensor) -> torch.Tensor:
        return loss(attrs.evolve(inputs, logprobs=logprobs)).loss

    assert torch.autograd.gradcheck(value, (inputs.logprobs.detach().clone().requires_grad_(True),))


@pytest.mark.parametrize("mode", [m.value for m in AggMode])
def test_ppo_gradcheck(mode: str) -> None:
    torch.manual_seed(0)
    inputs = random_inputs(seed=13, log_ratio_scale=0.5)
    ratio = torch.exp(inputs.logprobs.detach() - inputs.old_logprobs)
    # gradcheck steps logp by 1e-6: keep every ratio well away from the clip boundaries
    assert all((ratio - boundary).abs().min() > 1e-3 for boundary in (0.8, 1.2, 1.5))
    loss = PPOLoss(PPOLossConfig(agg_mode=mode, dual_clip_c=1.5, entropy_coeff=0.01))
    metrics = loss(inputs).metrics
    # the case exercises both clip sides, the dual clip and unclipped tokens
    assert metrics["clip_frac/low"] > 0 and metrics["clip_frac/high"] > 0 and metrics["dual_clip_frac"] > 0
    assert metrics["clip_frac"] < 1
    gradcheck(loss, inputs)


@pytest.mark.parametrize("name", ["importance_sampling", "cross_entropy"])
def test_gradcheck(name: str) -> None:
    torch.manual_seed(0)
    gradcheck(LOSSES[name](agg_mode="seq-mean-token-mean"), random_inputs(seed=1))


def test_gspo_gradcheck() -> None:
    # With one advantage per sequence and the sequence-mean reduction, the token-form
    # gradient s * grad(logp) / |y| is the exact derivative of the sequence objective, so
    # gradcheck applies. A wide clip range keeps some sequences unclipped.
    torch.manual_seed(0)
    inputs = random_inputs(seed=2)
    assert inputs.advantages is not None
    per_sequence = attrs.evolve(inputs, advantages=inputs.advantages[:, :1].expand_as(inputs.advantages))
    loss = GspoLoss(GspoLossConfig(clip_low=0.2, clip_high=0.2))
    assert 0 < loss(per_sequence).metrics["clip_frac"] < 1
    gradcheck(loss, per_sequence)


def test_cispo_gradcheck() -> None:
    # CISPO's weight is a stop-gradient, so its value moves with logp while its gradient
    # does not. Moving old_logprobs with logprobs freezes the ratio, which makes the
    # stop-gradient exact and gradcheck applicable.
    torch.manual_seed(0)
    inputs = random_inputs(seed=4, log_ratio_scale=0.5)
    delta = inputs.logprobs.detach() - inputs.old_logprobs
    loss = CispoLoss(CispoLossConfig(entropy_coeff=0.01))

    def value(logprobs: torch.Tensor) -> torch.Tensor:
        return loss(attrs.evolve(inputs, logprobs=logprobs, old_logprobs=logprobs - delta)).loss

    assert torch.autograd.gradcheck(value, (inputs.logprobs.detach().clone().requires_grad_(True),))


# --- padding and empty batches ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", [m.value for m in AggMode])
def test_masked_rows_change_nothing_and_get_no_gradient(name: str, mode: str) -> None:
    inputs = random_inputs(seed=5)
    options = {"agg_mode": mode}
    if name in WITH_ENTROPY:
        options["entropy_coeff"] = 0.01
    loss = LOSSES[name](**options)
    plain = loss(inputs)

    def padded(field: torch.Tensor | None, fill: float) -> torch.Tensor:
        assert field is not None
        return torch.cat([field.detach(), torch.full((1, field.shape[1]), fill, dtype=field.dtype)])

    logprobs = padded(inputs.logprobs, math.nan).requires_grad_(True)
    padded_inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=padded(inputs.old_logprobs, math.inf),
        advantages=padded(inputs.advantages, math.nan),
        entropy=padded(inputs.entropy, -math.inf),
        loss_mask=padded(inputs.loss_mask, 0.0),
    )
    out = loss(padded_inputs)
    # seq-mean-token-sum-norm divides by T, unchanged by an extra row
    assert out.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert out.metrics == pytest.approx(plain.metrics, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad is not None
    assert torch.isfinite(logprobs.grad).all()
    assert torch.equal(logprobs.grad[-1], torch.zeros(logprobs.shape[1], dtype=logprobs.dtype))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", [m.value for m in AggMode])
def test_nothing_trained_gives_zero_loss(name: str, mode: str) -> None:
    inputs = random_inputs(seed=6)
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    empty = attrs.evolve(inputs, logprobs=logprobs, loss_mask=torch.zeros_like(logprobs))
    out = LOSSES[name](agg_mode=mode)(empty)
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))


@pytest.mark.parametrize("name", list(LOSSES))
def test_metrics_are_python_floats(name: str) -> None:
    out = LOSSES[name]()(random_inputs(seed=7))
    assert out.metrics and all(type(v) is float for v in out.metrics.values())


def test_low_precision_inputs_are_computed_in_float32() -> None:
    inputs = random_inputs(seed=8)
    half = PolicyLossInputs(
        logprobs=inputs.logprobs.detach().bfloat16().requires_grad_(True),
        old_logprobs=inputs.old_logprobs.bfloat16(),
        advantages=inputs.advantages.bfloat16(),
        loss_mask=inputs.loss_mask.bfloat16(),
    )
    out = PPOLoss(PPOLossConfig())(half)
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert half.logprobs.grad is not None and half.logprobs.grad.dtype == torch.bfloat16


def test_huge_log_ratios_stay_finite() -> None:
    inputs = ratio_inputs([[1.0, 1.0]], [[1.0, -1.0]])
    far = attrs.evolve(inputs, logprobs=torch.tensor([[500.0, -500.0]], dtype=torch.float64, requires_grad=True))
    for name in ["ppo", "importance_sampling", "cispo", "gspo"]:
        out = LOSSES[name]()(far)
        assert math.isfinite(out.loss.item()), name
        assert all(math.isfinite(v) for v in out.metrics.values()), name


# --- input checks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "importance_sampling", "cispo", "gspo"])
@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages"])
def test_non_finite_trained_values_are_rejected(name: str, field: str) -> None:
    inputs = random_inputs(seed=9)
    bad = getattr(inputs, field).detach().clone()
    trained = (inputs.loss_mask > 0).nonzero()
    bad[tuple(trained[0])] = math.nan
    bad[tuple(trained[1])] = math.inf
    with pytest.raises(ValueError, match=rf"policy loss '{name}': {field} has 2 NaN or inf entries where loss_mask != 0"):
        LOSSES[name]()(attrs.evolve(inputs, **{field: bad}))


def test_non_finite_entropy_is_rejected() -> None:
    inputs = random_inputs(seed=10)
    entropy = inputs.entropy.clone()
    entropy[tuple((inputs.loss_mask > 0).nonzero()[0])] = math.nan
    with pytest.raises(ValueError, match="entropy has 1 NaN or inf entries"):
        PPOLoss(PPOLossConfig(entropy_coeff=0.1))(attrs.evolve(inputs, entropy=entropy))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_bad_mask_is_rejected(bad: float) -> None:
    inputs = random_inputs(seed=11)
    mask = inputs.loss_mask.clone()
    mask[0, 0] = bad
    with pytest.raises(ValueError, match="loss_mask has 1 NaN or inf entries"):
        PPOLoss(PPOLossConfig())(attrs.evolve(inputs, loss_mask=mask))


@pytest.mark.parametrize("field", ["old_logprobs", "advantages", "loss_mask"])
def test_shape_mismatch_is_rejected(field: str) -> None:
    inputs = random_inputs(seed=12)
    wrong = getattr(inputs, field)[:, :-1]
    with pytest.raises(ValueError, match=rf"'ppo': {field} must have logprobs' shape \(3, 5\), got \(3, 4\)"):
        PPOLoss(PPOLossConfig())(attrs.evolve(inputs, **{field: wrong}))


def test_logprobs_must_be_two_dimensional() -> None:
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        CrossEntropyLoss(CrossEntropyLossConfig())(PolicyLossInputs(logprobs=torch.zeros(4), loss_mask=torch.ones(4)))


@pytest.mark.parametrize("name", ["ppo", "importance_sampling", "cispo", "gspo"])
def test_missing_advantages_are_named(name: str) -> None:
    inputs = random_inputs(seed=13)
    with pytest.raises(ValueError, match="needs advantages"):
        LOSSES[name]()(attrs.evolve(inputs, advantages=None))


def test_requires() -> None:
    assert LOSSES["cross_entropy"]().requires == frozenset()
    for name in ["ppo", "importance_sampling", "cispo", "gspo", "dro"]:
        assert LOSSES[name]().requires == frozenset({"old_logprobs", "advantages"})
