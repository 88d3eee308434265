"""Choose what trains: LoRA adapters through peft, or every parameter.

Target modules are found by name suffix in the loaded model, so the same flags work
for any architecture whose projections use the usual names (Qwen, Llama, Mistral, ...).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from nexrl_core.config.lora import LoraSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_MODULES",
    "MLP_MODULES",
    "UNEMBED_MODULES",
    "adapters_disabled",
    "apply_training_mode",
    "load_in_place",
    "lora_target_modules",
    "merged_copy",
    "output_embeddings_tied",
    "save_adapter",
    "untie_output_embeddings",
]

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
            f"none of the LoRA target modules {wanted} exist in {type(model).__name__}; its Linear layers are named {sorted(present)}"
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
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates it int; it only divides it by the rank, so a float scales as given
        lora_dropout=0.0,
        target_modules=lora_target_modules(model, settings),
        bias="none",
        init_lora_weights=True,
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # A tied lm_head gets its own adapter; `merged_copy` unties it before merging.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    inner = peft_model.get_base_model()
    inner.eval()
    return inner, peft_model


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` (with peft's LoRA layers injected) as its base model for the duration:
    a LoRA run's KL reference is its own frozen base, so no second copy is loaded."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """``layer.weight`` (an embedding's or a projection's), which torch types as any attribute
    of a module: a tensor or a submodule."""
    return cast(torch.Tensor, layer.weight)


def output_embeddings_tied(model: PreTrainedModel, head: torch.nn.Module) -> bool:
    """Whether ``head`` (the output projection, or its LoRA base layer) shares its weight
    with the input embeddings."""
    embeddings = model.get_input_embeddings()
    return embeddings is not None and _weight(head).data_ptr() == _weight(embeddings).data_ptr()


def untie_output_embeddings(model: PreTrainedModel, head: torch.nn.Module) -> None:
    """Give ``head`` a weight of its own and mark ``model``'s config untied, so that a
    changed output projection (a merged ``lm_head`` adapter) leaves the input embeddings
    as they are, and a save writes both."""
    weight = _weight(head)
    head.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", None)
    if callable(text_config):
        text_config().tie_word_embeddings = False


def merged_copy(peft_model: Any) -> torch.nn.Module:
    """A plain HF model with the adapters folded in; the training model is untouched.

    With tied embeddings an adapter on ``lm_head`` must not be merged into the shared
    matrix (that would change the input embeddings too), so the copy's output
    projection is first given its own weight and the config marked untied.
    """
    clone = copy.deepcopy(peft_model)
    inner = clone.get_base_model()
    head = inner.get_output_embeddings()
    head_base = getattr(head, "base_layer", head)
    if head_base is not head and output_embeddings_tied(inner, head_base):
        untie_output_embeddings(inner, head_base)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        return clone.merge_and_unload()


def save_adapter(peft_model: Any, directory: Path) -> None:
    """Write the adapters in PEFT layout (``PeftModel.from_pretrained(base, directory)``).

    Only the adapters: the base weights, tied embeddings included, stay the base
    model's. peft writes ``target_modules`` from a set, in an order that changes from
    process to process; it is sorted here so that the same weights give the same files.
    """
    peft_model.save_pretrained(str(directory), save_embedding_layers=False)
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def load_in_place(model: PreTrainedModel, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (every parameter, by name) into ``model``'s parameters.

    A LoRA run that adapts ``lm_head`` of a model with tied embeddings sends the output
    projection merged, as a weight of its own: the model's head is then untied first
    (as `nexrl_engine.lora.merged_copy` unties it), so the input embeddings keep theirs.

    :raises ValueError: naming missing or unexpected parameters, before anything is copied.
    """
    head = model.get_output_embeddings()
    head_name = next((f"{name}.weight" for name, module in model.named_modules() if module is head), None)
    if head_name in weights and head_name not in dict(model.named_parameters()) and output_embeddings_tied(model, head):
        untie_output_embeddings(model, head)
    parameters = dict(model.named_parameters())
    if set(parameters) != set(weights):
        missing, extra = sorted(set(parameters) - set(weights)), sorted(set(weights) - set(parameters))
        raise ValueError(f"the weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(weights[name])
