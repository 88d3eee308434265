"""Contract: every option of every loss reaches the gradient through a service holder,
or the holder refuses it before step 1 where it declares that its service lacks it.

Subclass `LossOptionContract` and override two fixtures: ``holder`` (a connected holder
whose policy is still at the base weights: the probe's importance ratios are set
against `ServiceHolder.reference_logprobs`) and ``option_cases`` (a loss plugin's table
of `LossOptionCase`, e.g. ``nexrl_grpo.option_cases.LOSS_OPTION_CASES``). Each case
trains the same datums with an optimizer that cannot move the weights, once with each
of two values, and compares the gradient norms the holder reports.

Which options a holder refuses is part of its contract, not its choice at run time: a
holder that can compute everything (the in-process engine, NexRL's own services)
refuses nothing, and one for a service that cannot (hosted Tinker or Weaver) overrides
``refusals`` with exactly what that service lacks. A refusal outside that list fails,
so a holder that stops honouring an option its service computes does not pass.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs
import pytest

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.plugins.registry import find_spec
from nexrl_core.training.holders import ServiceHolder, TrainStepConfig
from nexrl_core.types import RemoteDatum

FROZEN = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0)
"""Computes gradients without moving the weights, so every step sees the same model."""
PROBE_MESSAGES = [{"role": "user", "content": "12+7="}]
RATIO_SHIFTS = (0.5, -0.5, 2.0, -0.1, 0.3, -2.0, 0.05, 1.0)
"""Log importance ratios of the probe's response tokens: inside and outside every clip
range, with a huge ratio on a negative advantage (dual clip)."""
ADVANTAGES = (1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0)


@attrs.frozen
class LossOptionCase:
    """Two values of one loss option that must give different gradients."""

    loss: str
    option: str
    value: Any
    other: Any
    fixed: Mapping[str, Any] = attrs.field(factory=dict)
    """Other options held fixed so that this one applies (``norm_constant`` needs its
    aggregation mode)."""

    def step(self, value: Any) -> TrainStepConfig:
        return TrainStepConfig(loss_fn=self.loss, loss_fn_config={**self.fixed, self.option: value}, optimizer=FROZEN)


def gradient_norm(metrics: Mapping[str, float]) -> float:
    """The global gradient norm among a holder's train metrics: ``grad_norm``, maybe under
    a prefix (``optim/grad_norm``) or with a reduction (``grad_norm:mean``, Tinker-style)."""
    for key, value in metrics.items():
        if key.partition(":")[0].rpartition("/")[2] == "grad_norm":
            return value
    pytest.fail(f"holder.train reported no grad_norm metric (got {sorted(metrics)})")


class LossOptionContract:
    """Every option of every loss in ``option_cases`` changes the gradient, or is refused
    if and only if ``refusals`` lists it."""

    @pytest.fixture
    def holder(self) -> ServiceHolder:
        raise NotImplementedError("override the 'holder' fixture to return a holder at the base weights")

    @pytest.fixture
    def option_cases(self) -> Sequence[LossOptionCase]:
        raise NotImplementedError("override the 'option_cases' fixture, e.g. with nexrl_grpo.option_cases.LOSS_OPTION_CASES")

    @pytest.fixture
    def refusals(self) -> Mapping[str, Collection[str]]:
        """Loss → the options this holder refuses (every option of a loss it refuses
        whole); empty when it honours every option of every loss, as by default."""
        return {}

    def test_cases_cover_every_option(self, option_cases: Sequence[LossOptionCase]) -> None:
        for loss in {case.loss for case in option_cases}:
            registered = {field.name for field in attrs.fields(find_spec("policy_losses", loss).config_class)}
            assert {case.option for case in option_cases if case.loss == loss} == registered, loss

    def test_each_option_is_refused_as_declared_or_changes_the_gradient(
        self, holder: ServiceHolder, option_cases: Sequence[LossOptionCase], refusals: Mapping[str, Collection[str]]
    ) -> None:
        datums = probe_datums(holder)
        ignored: list[str] = []
        refused: set[str] = set()
        for case in option_cases:
            reasons = {**holder.refused_options(case.step(case.value)), **holder.refused_options(case.step(case.other))}
            if reasons:
                assert all(reason.strip() for reason in reasons.values()), reasons
                assert {"loss_fn", f"loss_fn_config.{case.option}"} & set(reasons), (
                    f"{case.loss}.{case.option}: refused under other keys {sorted(reasons)}"
                )
                refused.add(f"{case.loss}.{case.option}")
                continue
            first = gradient_norm(holder.train(datums, case.step(case.value)))
            again = gradient_norm(holder.train(datums, case.step(case.value)))
            changed = gradient_norm(holder.train(datums, case.step(case.other)))
            assert again == pytest.approx(first, rel=1e-6), f"{case.loss}: the same step must give the same gradient"
            if not math.isfinite(changed) or math.isclose(changed, first, rel_tol=1e-4):
                ignored.append(f"{case.loss}.{case.option}: {case.value!r} -> {case.other!r} left the gradient norm at {first}")
        declared = {f"{case.loss}.{case.option}" for case in option_cases if case.option in refusals.get(case.loss, ())}
        assert not refused - declared, f"refused, though this holder's service honours them: {sorted(refused - declared)}"
        assert not declared - refused, f"listed in 'refusals', yet accepted: {sorted(declared - refused)}"
        assert not ignored, "options accepted and ignored:\n" + "\n".join(ignored)


def probe_datums(holder: ServiceHolder) -> list[RemoteDatum]:
    """Two datums whose sampler logprobs sit `RATIO_SHIFTS` below (and half of them
    above) the base model's, so their sequence ratios fall on both sides of 1; the halving
    keeps a term linear in the log ratio (DRO's penalty) from cancelling between the two
    datums, which share their tokens. The response is the prompt's tokens backwards:
    unlikely tokens, whose gradients are far from saturated (a token the model is sure of
    has almost none, and would hide a clip)."""
    prompt = holder.apply_chat_template(PROBE_MESSAGES, tokenize=True)
    assert isinstance(prompt, list) and len(prompt) >= len(RATIO_SHIFTS)
    tokens = list(prompt) + list(reversed(prompt))[: len(RATIO_SHIFTS)]
    (base,) = holder.reference_logprobs([tokens])
    pad = [0.0] * (len(prompt) - 1)

    def datum(scale: float) -> RemoteDatum:
        response = base[len(prompt) :]
        return RemoteDatum(
            input_tokens=tokens[:-1],
            target_tokens=tokens[1:],
            sampling_logprobs=pad + [value - scale * shift for value, shift in zip(response, RATIO_SHIFTS)],
            advantages=pad + list(ADVANTAGES),
            loss_mask=pad + [1.0] * len(RATIO_SHIFTS),
        )

    return [datum(1.0), datum(-0.5)]
