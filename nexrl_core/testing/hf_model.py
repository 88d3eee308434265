"""Reading an exported model back with plain transformers, as a user would.

`Backend.export_model` promises a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load with nothing of NexRL's; these helpers load it that way and score
token sequences with it, so tests can compare its logprobs with the backend's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_exported(directory: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``directory`` through the transformers Auto classes, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def sequence_logprobs(model: Any, tokens: Sequence[int]) -> list[float]:
    """``log p(tokens[i] | tokens[:i])`` for i >= 1, from one forward pass of ``model``."""
    import torch

    ids = torch.tensor([list(tokens)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logprobs = torch.log_softmax(logits[0, :-1], dim=-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()
