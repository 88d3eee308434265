"""Bad input to `nexrl train` is refused before anything runs: exit status 2, a message
that names the key as the user wrote it, no traceback, nothing left running and no run
directory left behind that would block the corrected command. (`nexrl serve`'s rows are in
nexrl_tinker/tests/test_serve_command.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nexrl_testing.processes import processes_with

NEXRL = str(Path(sys.executable).with_name("nexrl"))

CASES: list[tuple[str, list[str], str]] = [
    # (id, overrides, what the message must contain)
    ("unknown-key", ["rollout.groupsize=4"], "rollout.groupsize: unknown key; did you mean 'group_size'?"),
    ("unknown-section", ["rollouts.group_size=4"], "rollouts"),
    ("wrong-type", ["rollout.group_size=many"], "rollout.group_size"),
    ("negative-count", ["rollout.group_size=-1"], "rollout.group_size: must be"),
    ("zero-steps", ["schedule.steps=0"], "schedule.steps"),
    ("bad-fraction", ["rollout.error_budget=1.5"], "rollout.error_budget"),
    ("bad-beta", ["algorithm.beta2=1.0"], "algorithm.beta2: must be in [0, 1)"),
    ("negative-lr", ["algorithm.learning_rate=-1"], "algorithm.learning_rate"),
    ("bad-enum", ["model.dtype=fp8"], "model.dtype"),
    ("bad-kl-controller", ["algorithm.kl.controller=pid"], "algorithm.kl.controller"),
    ("unknown-loss", ["algorithm.loss.name=nosuch"], "algorithm.loss.name: unknown policy loss 'nosuch'"),
    ("unknown-loss-option", ["algorithm.loss.options.clip_lo=0.1"], "algorithm.loss.options.clip_lo"),
    ("unknown-estimator", ["algorithm.advantage.name=nosuch"], "algorithm.advantage.name"),
    ("unknown-backend", ["backend.name=nosuch"], "backend.name: unknown backend 'nosuch'"),
    ("uninstalled-holder", ["backend.options.service_holder=nosuch"], "backend.options.service_holder: unknown service holder"),
    ("unknown-backend-option", ["backend.options.base_ur=x"], "backend.options.base_ur"),
    ("bad-url", ["backend.options.base_url=not-a-url"], "backend.options.base_url"),
    ("unknown-rollout-source", ["rollout.source.name=nosuch"], "rollout.source.name"),
    ("unknown-task", ["task.name=nosuch"], "task.name"),
    ("missing-data", ["task.data_path=missing.jsonl", "task.agent=os:getcwd"], "task.data_path: cannot read 'missing.jsonl'"),
    ("missing-agent-module", ["task.agent=no_such_module:f"], "task.agent: cannot import module 'no_such_module'"),
    ("agent-not-callable", ["task.agent=os:sep"], "task.agent"),
    ("missing-model-embedded-service", ["model.name=/nonexistent"], "unknown model '/nonexistent'"),
    ("missing-model-inprocess", ["backend.name=inprocess", "model.name=/nonexistent"], "model.name: unknown model '/nonexistent'"),
    ("lora-alpha-on-tinker", ["model.lora.rank=4", "model.lora.alpha=8"], "model.lora.alpha"),
    ("resume-without-run", ["--resume"], "nothing to resume"),
    ("no-chat-template-inprocess", ["backend.name=inprocess", "model.name={untemplated}"], "model.name: the tokenizer in"),
    ("no-chat-template-embedded-service", ["model.name={untemplated}"], "has no chat template"),
    ("no-chat-template-self-hosted", ["backend.name=self-hosted", "model.name={untemplated}"], "has no chat template"),
    ("concurrency-with-episodes", ["rollout.source.name=episodes", "rollout.concurrency=4"], "rollout.concurrency: 4 has no effect"),
    (
        "missing-episodes-worker-script",
        [
            "rollout.source.name=episodes",
            "rollout.source.options.local_workers={{processes: 2, script: missing_worker.py, concurrency: 3}}",
        ],
        "rollout.source.options.local_workers.script: 'missing_worker.py' does not exist",
    ),
    ("max-tokens-past-context", ["backend.name=inprocess", "rollout.max_tokens=100000"], "rollout.max_tokens: 100000 does not fit"),
    ("max-tokens-past-context-embedded-service", ["rollout.max_tokens=4096"], "rollout.max_tokens: 4096 does not fit the context"),
    ("max-tokens-past-context-self-hosted", ["backend.name=self-hosted", "rollout.max_tokens=4096"], "rollout.max_tokens: 4096"),
    (
        "prompt-and-response-past-context",
        ["backend.name=inprocess", "rollout.max_prompt_tokens=2041"],
        "rollout.max_prompt_tokens: 2041 prompt tokens and rollout.max_tokens: 8 response tokens do not fit the context of model 'nexrl-tiny' (2048 tokens, in its config.json)",
    ),
    (
        "prompt-and-response-past-context-embedded-service",
        ["rollout.max_prompt_tokens=2041"],
        "rollout.max_prompt_tokens: 2041 prompt tokens and rollout.max_tokens: 8 response tokens do not fit the context of model 'nexrl-tiny' (2048 tokens, as the backend reports)",
    ),
    (
        "prompt-and-response-past-context-self-hosted",
        ["backend.name=self-hosted", "rollout.max_prompt_tokens=2041"],
        "rollout.max_prompt_tokens: 2041 prompt tokens and rollout.max_tokens: 8 response tokens do not fit",
    ),
    (
        "prompt-overflow-without-a-limit",
        ["rollout.prompt_overflow=skip"],
        "prompt_overflow: skip has no effect while max_prompt_tokens is null",
    ),
]
"""``{untemplated}`` stands for a copy of the shipped model whose tokenizer has no chat template
(so the braces of a YAML mapping are doubled)."""


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped tiny model with its chat template removed."""
    from nexrl_engine.loading import resolve_model_dir

    directory = tmp_path_factory.mktemp("untemplated") / "model"
    shutil.copytree(resolve_model_dir("nexrl-tiny"), directory)
    (directory / "chat_template.jinja").unlink()
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_refused_cleanly(tmp_path: Path, untemplated: Path, overrides: list[str], message: str) -> None:
    out_dir = tmp_path / "run"
    overrides = [override.format(untemplated=untemplated) for override in overrides]
    marker = uuid.uuid4().hex
    done = subprocess.run(
        [NEXRL, "train", f"output.dir={out_dir}", "schedule.steps=1", *overrides],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, MARKER: marker},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert message in output, output
    assert "Traceback" not in output, output
    assert not out_dir.exists() or not any(out_dir.iterdir()), f"left behind: {sorted(p.name for p in out_dir.iterdir())}"
    assert processes_with(marker) == [], "a service, worker or client outlived the refused run"


MARKER = "NEXRL_BAD_INPUT_TEST_RUN"
"""Set to a fresh value for each row's run: every process it starts inherits it."""
