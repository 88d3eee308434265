"""Mixed precision (``model.mixed_precision``): fp32 master weights under bfloat16 compute.

Pure bfloat16 training adds each AdamW update to a bfloat16 weight, which keeps 8
significant bits: an update smaller than half a step of the weight (0.2 to 0.4 % of its
size) rounds away, every step, so a small learning rate stops moving the model. With
mixed precision the optimizer steps fp32 masters (its moments fp32 too), which keep
those updates, and the model computes with the bfloat16 weights the masters round to.

How the engine does it (`MasterWeights`): the model is loaded in fp32, so the masters
are the checkpoint's own values; every parameter of the model is then cast to bfloat16
and stays the compute copy. After each backward pass `MasterWeights.collect_grads`
adds the bfloat16 gradients into fp32 gradients on the masters (so gradients accumulate
over micro-batches and calls in fp32) and frees the bfloat16 ones; after each optimizer
step `MasterWeights.publish` rounds the masters into the compute copy.

Why a bfloat16 copy rather than ``torch.autocast`` over fp32 weights:

* speed on a GPU: autocast casts each weight again in every forward pass (every
  micro-batch of every training pass, every scoring pass); the copy is cast once per
  optimizer step, and a pass runs bfloat16 matmuls on weights already in bfloat16;
* the same numbers everywhere: autocast decides per op what runs in fp32 (its op lists
  differ between CPU and CUDA), so a training pass would not compute what the bfloat16
  sampler computes. With the copy, training, scoring and sampling run the same
  bfloat16 weights through the same ops, and a fresh step's ratios start at 1;
* the self-hosted workers do the same thing: FSDP2's ``MixedPrecisionPolicy(param_dtype=
  bfloat16, reduce_dtype=float32)`` gathers fp32 shards as bfloat16 for compute and
  reduces gradients in fp32 onto them, so the two backends take the same step.

With LoRA only the adapters have masters; the frozen base is bfloat16 alone, and the
adapters compute in bfloat16 from their masters as FSDP2's policy has them compute (a
pure bfloat16 LoRA run keeps peft's fp32 adapters and runs them on an fp32 copy of each
layer's input instead).

Memory per trained parameter: 4 bytes of master, 2 of compute copy, 4 of fp32 gradient
(the bfloat16 gradient lives only until it is collected) and 8 of AdamW moments, against
2 + 2 + 4 in pure bfloat16; frozen weights (a LoRA run's base) are bfloat16 only.
"""

from __future__ import annotations

import torch

__all__ = ["COMPUTE_DTYPE", "MASTER_DTYPE", "MasterWeights", "cast_parameters"]

MASTER_DTYPE = torch.float32
"""What the optimizer steps and checkpoints hold."""
COMPUTE_DTYPE = torch.bfloat16
"""What the model computes, samples and exports in (``model.dtype: bf16``)."""


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype, frozen_only: bool = False) -> None:
    """Cast ``module``'s parameters (only those without gradients with ``frozen_only``) to
    ``dtype`` in place, keeping the parameter objects (tied weights stay tied). Buffers are
    left as they are: a bfloat16 model loaded by transformers keeps its rotary frequencies
    in fp32 too."""
    for parameter in module.parameters():
        if not (frozen_only and parameter.requires_grad):
            parameter.data = parameter.data.to(dtype)


class MasterWeights:
    """fp32 masters of a model's trainable parameters, the model itself cast to bfloat16.

    Built on a model loaded in fp32, before it moves to ``device``; the masters are made
    on ``device`` directly.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
        self.pairs = [
            (name, torch.nn.Parameter(parameter.detach().to(device=device, dtype=MASTER_DTYPE, copy=True)), parameter)
            for name, parameter in trainable
        ]
        """(name, fp32 master, the model's bfloat16 parameter) for each trainable parameter."""
        cast_parameters(model, COMPUTE_DTYPE)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The masters by the model's parameter names: what the optimizer steps and
        checkpoints hold."""
        return [(name, master) for name, master, _ in self.pairs]

    def collect_grads(self) -> None:
        """Add the compute copy's gradients into the masters' fp32 gradients and free them."""
        with torch.no_grad():
            for _, master, compute in self.pairs:
                if compute.grad is None:
                    continue
                if master.grad is None:
                    master.grad = compute.grad.to(MASTER_DTYPE)
                else:
                    master.grad.add_(compute.grad)
                compute.grad = None

    def publish(self) -> None:
        """Round the masters into the compute copy (after a step or a load)."""
        with torch.no_grad():
            for _, master, compute in self.pairs:
                compute.copy_(master)

    def zero_grad(self) -> None:
        """Drop the masters' gradients and any the compute copy holds (a failed pass's)."""
        for _, master, compute in self.pairs:
            master.grad = None
            compute.grad = None
