"""Choose what trains: LoRA adapters through peft, or every parameter.

Target modules are found by name suffix in the loaded model, so the same flags work
for any architecture whose projections use the usual names (Qwen, Llama, Mistral, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from nexrl_fsdp.config import LoraSettings

__all__ = ["ATTN_MODULES", "MLP_MODULES", "UNEMBED_MODULES", "apply_training_mode", "lora_target_modules"]

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "c_proj_attn")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "c_fc")
UNEMBED_MODULES = ("lm_head",)


def _linear_suffixes(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def lora_target_modules(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Module name suffixes to adapt, restricted to Linear layers the model really has."""
    present = _linear_suffixes(model)
    wanted: list[str] = []
    if settings.train_attn:
        wanted += ATTN_MODULES
    if settings.train_mlp:
        wanted += MLP_MODULES
    if settings.train_unembed:
        wanted += UNEMBED_MODULES
    targets = [name for name in wanted if name in present]
    if not targets:
        raise ValueError(
            f"none of the LoRA target modules {wanted} exist in {type(model).__name__}; "
            f"its Linear layers are named {sorted(present)}"
        )
    return targets


def apply_training_mode(model: torch.nn.Module, settings: LoraSettings, seed: int) -> tuple[torch.nn.Module, Any]:
    """Make the right parameters trainable and return ``(module to run, peft model or None)``.

    For full fine-tuning the module is the model itself. For LoRA it is the HF model with
    peft's layers injected (base weights frozen, adapters trainable): calling it runs
    the adapters and keeps the HF forward signature; the peft wrapper is returned too
    because merging for export needs it. Call this while the model is on the CPU: the
    adapters are initialised from the CPU RNG under ``seed`` (the global RNG is left as
    it was), so the same seed gives the same adapters on any device.
    """
    if not settings.is_lora:
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        return model, None

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=0.0,
        target_modules=lora_target_modules(model, settings),
        bias="none",
        init_lora_weights=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    inner = peft_model.get_base_model()
    inner.eval()
    return inner, peft_model
