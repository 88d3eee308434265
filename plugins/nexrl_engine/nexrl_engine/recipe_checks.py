"""Checks a recipe passes before a backend on the engine loads anything: the model exists,
has a tokenizer with a chat template and room for ``rollout.max_tokens`` (and
``rollout.max_prompt_tokens`` with it), the device is there. Each failure is a `ConfigError` naming the recipe key."""

from __future__ import annotations

import torch

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.run.limits import context_problems
from nexrl_engine.loading import check_chat_model_dir, context_length, resolve_model_dir

__all__ = ["check_device", "check_model_name", "device_problem", "teacher_tokenizer_problem"]


def check_model_name(recipe: TrainConfig) -> str:
    """``model.name``, once it names a shipped model or a local Hugging Face directory
    whose tokenizer has a chat template and whose context holds a turn of
    ``rollout.max_tokens`` after a prompt of ``rollout.max_prompt_tokens``
    (`nexrl_core.run.limits.context_problems`)."""
    name = recipe.model.name
    if name is None:
        raise ConfigError(["model.name: not set; name the model to train (nexrl-tiny, or a local Hugging Face directory)"])
    try:
        directory = resolve_model_dir(name)
        check_chat_model_dir(directory)
    except ValueError as error:
        raise ConfigError([f"model.name: {error}"]) from None
    context = context_length(directory)
    if context is not None:
        problems = context_problems(recipe.rollout, name, context, "in its config.json")
        if problems:
            raise ConfigError(problems)
    return name


def device_problem(device: str) -> str | None:
    """Why ``device`` is not a torch device this machine has (a CUDA device without CUDA,
    a GPU index past the last one), in words that follow the device's name; None when
    it is one."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        return f"{device!r} is not a torch device: {error}"
    if parsed.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return (
            f"{device!r} asks for CUDA, which this machine does not have (torch {torch.__version__} sees no GPU); "
            "use cpu, or run on a machine with a GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        return f"{device!r} asks for GPU {parsed.index}, but this machine has {count} (cuda:0 to cuda:{count - 1}); use one of those"
    return None


def check_device(device: str, key: str) -> None:
    """``device`` parses as a torch device this machine has."""
    problem = device_problem(device)
    if problem is not None:
        raise ConfigError([f"{key}: {problem}"])


def teacher_tokenizer_problem(teacher: str, student: str) -> str:
    """The refusal of a ``teacher.model`` whose tokenizer is not ``model.name``'s: it would
    score token ids that mean other text."""
    return (
        f"teacher.model: {teacher!r} has another tokenizer than model.name {student!r}; the "
        "teacher scores the student's token ids, so distil from a teacher of the same tokenizer"
    )
