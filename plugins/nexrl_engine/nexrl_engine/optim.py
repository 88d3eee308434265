"""AdamW over the trainable parameters, with per-step hyper-parameters.

A service sends AdamW settings with every ``optim_step`` (Tinker does), so learning rate,
betas, eps and weight decay are written into the param group on each call (a schedule lives in the
caller). The optimizer state is keyed by parameter *name* when saved, so a checkpoint
does not depend on parameter order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nexrl_core.config.adamw import AdamWSettings
from nexrl_engine.types import OptimStepResult

__all__ = ["AdamW"]

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class AdamW:
    """torch AdamW (decoupled weight decay) plus global-norm clipping and a skip on
    non-finite gradients."""

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self.names = [name for name, _ in named_parameters]
        self.parameters = [parameter for _, parameter in named_parameters]
        if not self.parameters:
            raise ValueError("nothing to optimise: the model has no trainable parameters")
        # foreach=False: one deterministic code path for every parameter on any device.
        self.optimizer = torch.optim.AdamW(self.parameters, lr=0.0, foreach=False)
        self.steps = 0

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def grad_norm(self) -> float:
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        # FSDP2 shards gradients as DTensors: their norm is a DTensor to reduce across ranks.
        return float(total.full_tensor() if hasattr(total, "full_tensor") else total)

    def step(self, params: AdamWSettings) -> OptimStepResult:
        """Clip, step and zero the gradients; skip (and zero them) if the norm is not finite."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return OptimStepResult(norm, params.learning_rate, self.steps, skipped=True, clipped=False)
        clipped = False
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            # torch's clip_grads_with_norm_ arithmetic, with the coefficient as a Python
            # number so sharded (DTensor) gradients scale without a plain-tensor operand.
            coefficient = float(torch.clamp(params.grad_clip_norm / (torch.tensor(norm) + 1e-6), max=1.0))
            for parameter in self.parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(coefficient)
            clipped = True
        for group in self.optimizer.param_groups:
            group["lr"] = params.learning_rate
            group["betas"] = (params.beta1, params.beta2)
            group["eps"] = params.eps
            group["weight_decay"] = params.weight_decay
        self.optimizer.step()
        self.zero_grad()
        self.steps += 1
        return OptimStepResult(norm, params.learning_rate, self.steps, skipped=False, clipped=clipped)

    # --- checkpoint support -------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"<param name>::<key>": tensor}`` of the moment estimates and step counts."""
        tensors = {}
        for name, parameter in zip(self.names, self.parameters):
            state = self.optimizer.state.get(parameter, {})
            for key in _STATE_KEYS:
                if key in state:
                    value = state[key]
                    value = value if torch.is_tensor(value) else torch.tensor(float(value))
                    tensors[f"{name}::{key}"] = value.detach().to("cpu").contiguous().clone()
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], steps: int) -> None:
        """Restore what `state_tensors` saved; every name must match a parameter."""
        by_name = dict(zip(self.names, self.parameters))
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for flat, value in tensors.items():
            name, _, key = flat.rpartition("::")
            if name not in by_name or key not in _STATE_KEYS:
                raise ValueError(f"optimizer state entry {flat!r} does not match any trainable parameter")
            grouped.setdefault(name, {})[key] = value
        self.optimizer.state.clear()
        for name, state in grouped.items():
            parameter = by_name[name]
            missing = [key for key in _STATE_KEYS if key not in state]
            if missing:
                raise ValueError(f"optimizer state of {name!r} lacks {missing}")
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(state[key].shape) != tuple(parameter.shape):
                    raise ValueError(
                        f"optimizer state {name}::{key} has shape {tuple(state[key].shape)}, parameter has {tuple(parameter.shape)}"
                    )
            self.optimizer.state[parameter] = {
                "step": state["step"].to(torch.float32).reshape(()),
                "exp_avg": state["exp_avg"].to(device=parameter.device, dtype=parameter.dtype).clone(),
                "exp_avg_sq": state["exp_avg_sq"].to(device=parameter.device, dtype=parameter.dtype).clone(),
            }
        self.steps = steps
