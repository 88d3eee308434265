"""Shared fixtures: engines on the shipped tiny model and chat-formatted prompts; and
the helpers several test modules build on (the in-process backend opened from the
quickstart recipe, a group of training datums), which they import with
``from tests.conftest import ...`` as the suite runs from this distribution's folder."""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

import pytest
import torch

from nexrl_core.config import TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.plugins.registry import find_spec
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holder_backend import HolderBackend
from nexrl_engine import Datum, Engine
from nexrl_engine.tiny.addition import heldout_problems


def quickstart(tmp_path: Path, *overrides: str, name: str = "run") -> TrainConfig:
    """The built-in quickstart recipe on the ``inprocess`` backend, writing under
    ``tmp_path / name``; ``overrides`` as on the command line."""
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(path, [f"output.dir={tmp_path / name}", "backend.name=inprocess", "backend.options={}", *overrides])


def open_backend(config: TrainConfig, work_dir: Path) -> HolderBackend:
    """The recipe's backend opened as a run opens it (its options resolved from the recipe)."""
    options = resolve_options("backends", config.backend, "backend")
    return find_spec("backends", "inprocess").open(BackendSetup(recipe=config, options=options, work_dir=work_dir))


def group_datums() -> list[Datum]:
    """Four runs sharing a 10-token prompt (so a plain engine shares the prefix), with
    advantages of both signs; the same datums on every call."""
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 1000, (10,), generator=generator).tolist()
    datums = []
    for index, advantage in enumerate((0.9, -0.4, 1.3, -1.1)):
        response = torch.randint(1, 1000, (3 + index,), generator=generator).tolist()
        tokens = prompt + response
        mask = [0.0] * (len(prompt) - 1) + [1.0] * len(response)
        datums.append(
            Datum(
                input_tokens=tokens[:-1],
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [-1.0] * len(mask),
                    "advantages": [advantage * m for m in mask],
                    "mask": mask,
                },
            )
        )
    return datums


@pytest.fixture(scope="session")
def shared_engine() -> Engine:
    """A full fine-tuning engine that tests must not train or reload (sampling, scoring)."""
    return Engine(model="nexrl-tiny", seed=0)


@pytest.fixture
def engine() -> Engine:
    """A fresh full fine-tuning engine a test may train."""
    return Engine(model="nexrl-tiny", seed=0)


@pytest.fixture(scope="session")
def chat_prompts(shared_engine: Engine) -> list[list[int]]:
    """Held-out addition prompts, chat formatted; their lengths differ (1- and 2-digit operands)."""
    tokenizer = shared_engine.tokenizer
    prompts = []
    for problem in heldout_problems(12):
        prompts.append(
            list(tokenizer.apply_chat_template(problem.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
        )
    assert len({len(p) for p in prompts}) > 1, "want prompts of different lengths"
    return prompts
