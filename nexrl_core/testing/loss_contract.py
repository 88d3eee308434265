"""Contract every policy loss must meet.

Subclass `PolicyLossContract` and override the ``policy_loss`` fixture to return a built
loss. The checks hold for any sound loss: a finite scalar, untrained tokens that neither
change the loss nor get a gradient, padding rows and row order that change nothing, a step
split into parts (micro-batches, ranks) that adds up to the whole step given its
`StepTotals`, and non-finite inputs rejected with a clear error.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from nexrl_core.training.algorithms import POLICY_LOSS_INPUTS, PolicyLoss, PolicyLossInputs, PolicyLossOutput, StepTotals


def make_loss_inputs(batch: int = 4, width: int = 6, seed: int = 0, dtype: torch.dtype = torch.float64) -> PolicyLossInputs:
    """Random inputs near on-policy, with a prompt (untrained) prefix and ragged responses."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=generator, dtype=dtype) * 2 - 0.1
    logprobs = (old + torch.randn(batch, width, generator=generator, dtype=dtype) * 0.05).requires_grad_(True)
    loss_mask = torch.zeros(batch, width, dtype=dtype)
    for row in range(batch):
        loss_mask[row, 2 : width - (row % 3)] = 1.0
    advantages = torch.randn(batch, 1, generator=generator, dtype=dtype).expand(batch, width) * loss_mask
    entropy = torch.rand(batch, width, generator=generator, dtype=dtype)
    return PolicyLossInputs(
        logprobs=logprobs,
        loss_mask=loss_mask,
        old_logprobs=old,
        advantages=advantages.contiguous(),
        entropy=entropy,
        ref_logprobs=old - 0.05,
    )


_TENSOR_FIELDS = ("logprobs", "loss_mask", "old_logprobs", "advantages", "entropy", "ref_logprobs")


def _replace(inputs: PolicyLossInputs, **changes: Any) -> PolicyLossInputs:
    return attrs.evolve(inputs, **changes)


def _set(tensor: torch.Tensor | None) -> torch.Tensor:
    """One of the optional tensors, which `make_loss_inputs` always sets."""
    assert tensor is not None, "make_loss_inputs sets every tensor"
    return tensor


def _part(inputs: PolicyLossInputs, rows: slice, totals: StepTotals) -> PolicyLossInputs:
    """Rows of ``inputs`` as one part of a step, cut to their own longest trained row (as a
    micro-batch is padded only to its own width)."""
    width = int(inputs.loss_mask[rows].nonzero()[:, 1].max()) + 1
    cut = {name: getattr(inputs, name)[rows, :width] for name in _TENSOR_FIELDS if getattr(inputs, name) is not None}
    return _replace(inputs, **cut, step_totals=totals)


def _loss_and_grad(policy_loss: PolicyLoss, inputs: PolicyLossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = inputs.logprobs.detach().clone().requires_grad_(True)
    output = policy_loss(_replace(inputs, logprobs=leaf))
    assert isinstance(output, PolicyLossOutput), f"loss returned {type(output).__name__}, not PolicyLossOutput"
    output.loss.backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return output.loss.detach(), grad


class PolicyLossContract:
    """Checks any policy loss; override the ``policy_loss`` fixture."""

    @pytest.fixture
    def policy_loss(self) -> PolicyLoss:
        raise NotImplementedError("override the 'policy_loss' fixture to return a built policy loss")

    def test_declares_its_inputs(self, policy_loss: PolicyLoss) -> None:
        assert isinstance(policy_loss.requires, frozenset)
        assert policy_loss.requires <= POLICY_LOSS_INPUTS, f"unknown inputs {set(policy_loss.requires) - POLICY_LOSS_INPUTS}"

    def test_scalar_finite_loss_and_float_metrics(self, policy_loss: PolicyLoss) -> None:
        output = policy_loss(make_loss_inputs())
        assert output.loss.dim() == 0
        assert torch.isfinite(output.loss)
        assert output.loss.requires_grad, "the loss must be connected to the logprobs"
        assert all(isinstance(value, float) for value in output.metrics.values())

    def test_untrained_tokens_do_not_matter(self, policy_loss: PolicyLoss) -> None:
        inputs = make_loss_inputs()
        untrained = inputs.loss_mask == 0
        noise = torch.randn(inputs.loss_mask.shape, generator=torch.Generator().manual_seed(3), dtype=inputs.loss_mask.dtype)
        changed = _replace(
            inputs,
            logprobs=torch.where(untrained, inputs.logprobs.detach() + noise, inputs.logprobs.detach()),
            old_logprobs=torch.where(untrained, _set(inputs.old_logprobs) - noise.abs(), _set(inputs.old_logprobs)),
            advantages=torch.where(untrained, noise * 10, _set(inputs.advantages)),
        )
        loss, grad = _loss_and_grad(policy_loss, inputs)
        changed_loss, changed_grad = _loss_and_grad(policy_loss, changed)
        torch.testing.assert_close(changed_loss, loss)
        torch.testing.assert_close(changed_grad, grad)
        assert torch.all(grad[untrained] == 0), "untrained tokens must get no gradient"

    def test_padding_rows_change_nothing(self, policy_loss: PolicyLoss) -> None:
        inputs = make_loss_inputs()
        extra = 3
        width = inputs.loss_mask.shape[1]
        padded = _replace(
            inputs,
            logprobs=torch.cat([inputs.logprobs.detach(), torch.full((extra, width), -1.0, dtype=torch.float64)]),
            loss_mask=torch.cat([inputs.loss_mask, torch.zeros(extra, width, dtype=torch.float64)]),
            old_logprobs=torch.cat([_set(inputs.old_logprobs), torch.full((extra, width), -3.0, dtype=torch.float64)]),
            advantages=torch.cat([_set(inputs.advantages), torch.zeros(extra, width, dtype=torch.float64)]),
            entropy=torch.cat([_set(inputs.entropy), torch.ones(extra, width, dtype=torch.float64)]),
            ref_logprobs=torch.cat([_set(inputs.ref_logprobs), torch.zeros(extra, width, dtype=torch.float64)]),
        )
        loss, grad = _loss_and_grad(policy_loss, inputs)
        padded_loss, padded_grad = _loss_and_grad(policy_loss, padded)
        torch.testing.assert_close(padded_loss, loss)
        torch.testing.assert_close(padded_grad[: grad.shape[0]], grad)
        assert torch.all(padded_grad[grad.shape[0] :] == 0)

    def test_row_order_does_not_matter(self, policy_loss: PolicyLoss) -> None:
        inputs = make_loss_inputs(batch=5)
        order = torch.tensor([3, 0, 4, 1, 2])
        permuted = _replace(
            inputs,
            logprobs=inputs.logprobs.detach()[order],
            loss_mask=inputs.loss_mask[order],
            old_logprobs=_set(inputs.old_logprobs)[order],
            advantages=_set(inputs.advantages)[order],
            entropy=_set(inputs.entropy)[order],
            ref_logprobs=_set(inputs.ref_logprobs)[order],
        )
        loss, grad = _loss_and_grad(policy_loss, inputs)
        permuted_loss, permuted_grad = _loss_and_grad(policy_loss, permuted)
        torch.testing.assert_close(permuted_loss, loss)
        torch.testing.assert_close(permuted_grad, grad[order])

    def test_parts_of_a_step_add_up_to_the_whole_step(self, policy_loss: PolicyLoss) -> None:
        """Given the whole step's `StepTotals`, the losses of its parts (micro-batches,
        ranks) sum to the loss of the whole and their gradients are the whole's: the
        step's gradient does not depend on how it is split."""
        inputs = make_loss_inputs(batch=7, width=9, seed=5)
        whole_loss, whole_grad = _loss_and_grad(policy_loss, inputs)
        totals = StepTotals.of(inputs.loss_mask)
        for cuts in ([0, 1, 7], [0, 3, 5, 7], [0, 2, 3, 4, 6, 7]):
            parts_loss = torch.zeros((), dtype=whole_loss.dtype)
            for first, last in zip(cuts, cuts[1:]):
                part = _part(inputs, slice(first, last), totals)
                loss, grad = _loss_and_grad(policy_loss, part)
                parts_loss = parts_loss + loss
                torch.testing.assert_close(
                    grad, whole_grad[first:last, : grad.shape[1]], msg=f"split {cuts}: gradient of rows {first}:{last}"
                )
            torch.testing.assert_close(parts_loss, whole_loss, msg=f"split {cuts}: the parts' losses do not add up to the step's")

    def test_nothing_trained_gives_zero_not_nan(self, policy_loss: PolicyLoss) -> None:
        inputs = make_loss_inputs()
        loss, grad = _loss_and_grad(policy_loss, _replace(inputs, loss_mask=torch.zeros_like(inputs.loss_mask)))
        assert loss.item() == 0.0
        assert torch.all(grad == 0)

    @pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages"])
    def test_rejects_non_finite_inputs(self, policy_loss: PolicyLoss, field: str) -> None:
        if field != "logprobs" and field not in policy_loss.requires:
            pytest.skip(f"this loss does not read {field}")
        inputs = make_loss_inputs()
        bad = getattr(inputs, field).detach().clone()
        bad[0, 3] = float("nan")
        with pytest.raises(ValueError, match=field):
            policy_loss(_replace(inputs, **{field: bad}))
