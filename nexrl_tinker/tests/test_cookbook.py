"""The unmodified tinker-cookbook trainers run against TinkerCloud: the RL loop
(``tinker_cookbook.rl.train.main``) on a small addition environment of ours, three
steps, checkpoints; DPO (``tinker_cookbook.preference.train_dpo.main``), whose
``forward_backward_custom`` sends negative cross-entropy weights; off-policy
distillation (``tinker_cookbook.distillation.train_off_policy.main``), whose teacher
answers ``topk_prompt_logprobs``; and the decisions recipe's ``sample_decision``, which
scores its labels with a sparse ``target_prompt_logprobs``.

tinker-cookbook is not a declared dependency (its own requirement ``tml-renderers>=0.4.1``
is not installable from every index): install it with ``pip install --no-deps
tinker-cookbook==0.6.1`` plus its runtime dependencies to run this test.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

tinker_cookbook = pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (see module docstring)")

import chz
import torch
from tinker import types
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.distillation import train_off_policy
from tinker_cookbook.distillation.datasets import TeacherConfig
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.recipes.decisions.decision import DecisionRendering, sample_decision
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilder, ChatDatasetBuilderCommonConfig, SupervisedDataset

from nexrl_tinker.testing import BASE_MODEL, start_service

RENDERER = "qwen3_instruct"
"""ChatML with <|im_end|> as the stop token: exactly the tiny model's chat template."""


def _tiny_tokenizer():
    from nexrl_engine.loading import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(BASE_MODEL))


class AdditionEnv(ProblemEnv):
    def __init__(self, renderer: renderers.Renderer, a: int, b: int) -> None:
        super().__init__(renderer, format_coef=0.1)
        self.a, self.b = a, b

    def get_question(self) -> str:
        return f"{self.a}+{self.b}="

    def check_answer(self, sample_str: str) -> bool:
        return sample_str.strip() == str(self.a + self.b)

    def check_format(self, sample_str: str) -> bool:
        return sample_str.strip().isdigit()

    def get_reference_answer(self) -> str:
        return str(self.a + self.b)


class AdditionDataset(RLDataset):
    def __init__(self, batch_size: int, group_size: int, batches: int) -> None:
        self.batch_size, self.group_size, self.batches = batch_size, group_size, batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        renderer = renderers.get_renderer(RENDERER, tokenizer_utils.get_tokenizer(BASE_MODEL))
        pairs = [(7 * (index * self.batch_size + i) % 90 + 3, 11 * i % 50 + 2) for i in range(self.batch_size)]
        return [
            ProblemGroupBuilder(env_thunk=lambda a=a, b=b: AdditionEnv(renderer, a, b), num_envs=self.group_size, dataset_name="addition")
            for a, b in pairs
        ]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    batch_size: int = 2
    group_size: int = 4
    batches: int = 3

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return AdditionDataset(self.batch_size, self.group_size, self.batches), None


PREFERENCES = (("12+34=", "46", "71"), ("7+8=", "15", "3"), ("40+2=", "42", "24"))
"""(question, chosen answer, rejected answer)."""


class PreferenceDataset(SupervisedDataset):
    """Every batch is the same three pairs, each as chosen then rejected datum (the order
    train_dpo expects), the answer's tokens weighing 1."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        tokenizer = _tiny_tokenizer()
        self.data = []
        for question, *answers in PREFERENCES:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for answer in answers:
                tokens = prompt + tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
                weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
                self.data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
                    )
                )

    def get_batch(self, index: int) -> list[types.Datum]:
        return list(self.data)

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, seed: int = 0) -> None:
        """One fixed order: the test compares the same pairs across steps."""


@chz.chz
class PreferenceDatasetBuilder(ChatDatasetBuilder):
    batches: int = 2

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        return PreferenceDataset(self.batches), None


def rl_config(base_url: str, log_path: Path, **changes: Any) -> train.Config:
    """The cookbook's RL loop on the addition problems (LoRA rank 8, 2 steps), with ``changes``."""
    tokenizer_utils.register_tokenizer(BASE_MODEL, _tiny_tokenizer)
    settings: dict[str, Any] = {
        "learning_rate": 1e-4,
        "dataset_builder": AdditionDatasetBuilder(),
        "model_name": BASE_MODEL,
        "recipe_name": "nexrl_tinker_test",
        "renderer_name": RENDERER,
        "max_tokens": 8,
        "log_path": str(log_path),
        "eval_every": 0,
        "save_every": 0,
        "lora_rank": 8,
        "base_url": base_url,
        "max_steps": 2,
        "num_groups_to_log": 0,
    }
    return train.Config(**{**settings, **changes})


@pytest.fixture(scope="module")
def group_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A service that trains each model on a worker group of two ranks (``--workers 2``)."""
    service = start_service(tmp_path_factory.mktemp("tinkercloud-groups"), workers=2)
    try:
        yield service.base_url
    finally:
        service.stop()


@pytest.mark.slow
@pytest.mark.parametrize("served_on", ["engine", "worker group"])
def test_cookbook_rl_train_main_runs_three_steps(served_on: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The cookbook's RL loop (LoRA rank 8) on the in-process engine and on 2-rank groups."""
    base_url = request.getfixturevalue("base_url" if served_on == "engine" else "group_base_url")
    log_path = tmp_path / "run"
    asyncio.run(train.main(rl_config(base_url, log_path, save_every=2, max_steps=3)))

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted({m["step"] for m in metrics if "step" in m})
    assert steps[:3] == [0, 1, 2], steps
    first = next(m for m in metrics if m.get("step") == 0)
    # Sampler and trainer agree: the sample/train KL of an on-policy step is ~0.
    assert abs(first["optim/kl_sample_train_v1"]) < 1e-3
    assert all(key.count(":") == 1 for key in first if key.endswith((":mean", ":sum", ":max", ":min")))
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    assert any(c.get("name") == "final" for c in checkpoints), checkpoints
    final = next(c for c in checkpoints if c.get("name") == "final")
    assert final["state_path"].startswith("tinker://") and "/weights/" in final["state_path"]


@pytest.mark.slow
def test_cookbook_async_rl_trains_with_ppo_and_refuses_its_default_loss_in_words(base_url: str, tmp_path: Path) -> None:
    """The cookbook's async RL (sampling a step ahead of training) with ``loss_fn="ppo"``
    trains its steps; with ``AsyncConfig``'s default, ``stable_reinforce``, whose objective
    Tinker has not published, the first sample is refused with a 400 that says so."""
    ahead = train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2, loss_fn="ppo")
    asyncio.run(train.main(rl_config(base_url, tmp_path / "ppo", dataset_builder=AdditionDatasetBuilder(batches=4), async_config=ahead)))
    metrics = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted({m["step"] for m in metrics if "step" in m})[:2] == [0, 1], metrics

    default = train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)
    with pytest.raises(Exception, match="record_stability_info is for the 'stable_reinforce' loss"):
        config = rl_config(base_url, tmp_path / "default", dataset_builder=AdditionDatasetBuilder(batches=4), async_config=default)
        asyncio.run(asyncio.wait_for(train.main(config), timeout=300))


def test_cookbook_train_dpo_main_lowers_the_dpo_loss(base_url: str, tmp_path: Path) -> None:
    """``preference.train_dpo.main``, unmodified, two steps on the same pairs: the DPO loss
    starts at log 2 (the policy is its own reference) and falls after one update."""
    tokenizer_utils.register_tokenizer(BASE_MODEL, _tiny_tokenizer)
    log_path = tmp_path / "dpo"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=BASE_MODEL, renderer_name=RENDERER, max_length=None, batch_size=6)
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=BASE_MODEL,
        recipe_name="nexrl_tinker_test",
        dataset_builder=PreferenceDatasetBuilder(common_config=common),
        renderer_name=RENDERER,
        learning_rate=2e-3,
        lr_schedule="constant",
        lora_rank=8,
        base_url=base_url,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
        ttl_seconds=None,
        max_steps=2,
    )
    train_dpo.main(config)

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {m["step"]: m["dpo_loss"] for m in metrics if "dpo_loss" in m}
    assert sorted(losses) == [0, 1], metrics
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
    assert losses[1] < losses[0] - 1e-3, losses


def _reference_log_softmax() -> Any:
    """Row j: log p(· | tokens[: j + 1]) under the tiny model, loaded here from its files."""
    from transformers import AutoModelForCausalLM

    from nexrl_engine.loading import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(BASE_MODEL)), torch_dtype=torch.float32).eval()

    def of(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return of


def test_cookbook_off_policy_distillation_trains_on_the_teachers_top_k(base_url: str, tmp_path: Path) -> None:
    """``distillation.train_off_policy.main``, unmodified, two steps: the teacher (the base
    model) answers ``topk_prompt_logprobs=4`` for every datum and the student trains with
    cross-entropy on those [N, 4] soft targets. The student starts as the base model
    (LoRA's B is 0), so the first step's loss is, per answer position, the cross-entropy
    of the base model's own renormalised top 4 against itself, computed here."""
    tokenizer_utils.register_tokenizer(BASE_MODEL, _tiny_tokenizer)
    log_path = tmp_path / "off-policy"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=BASE_MODEL, renderer_name=RENDERER, max_length=None, batch_size=6)
    config = train_off_policy.Config(
        learning_rate=2e-3,
        dataset_configs=[
            train_off_policy.DatasetWithTeacher(
                dataset_builder=PreferenceDatasetBuilder(common_config=common), teacher_config=TeacherConfig(base_model=BASE_MODEL)
            )
        ],
        model_name=BASE_MODEL,
        recipe_name="nexrl_tinker_test",
        renderer_name=RENDERER,
        lora_rank=8,
        n_teacher_targets=4,
        batch_size=6,
        save_every=0,
        eval_every=0,
        max_steps=2,
        log_path=str(log_path),
        base_url=base_url,
        ttl_seconds=None,
    )
    asyncio.run(train_off_policy.main(config))

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {m["step"]: m["train/loss:sum"] for m in metrics if "train/loss:sum" in m}
    assert sorted(losses) == [0, 1] and all(math.isfinite(loss) for loss in losses.values()), metrics
    log_softmax = _reference_log_softmax()
    expected = 0.0
    for datum in PreferenceDataset(1).get_batch(0):
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        reference = log_softmax([*datum.model_input.to_ints(), targets[-1]])
        for position, weight in enumerate(datum.loss_fn_inputs["weights"].tolist()):
            if weight > 0:
                top = reference[position].topk(4).values
                expected -= float((torch.softmax(top, dim=0) * top).sum())
    assert losses[0] == pytest.approx(expected, rel=1e-4)


def test_cookbook_sample_decision_scores_its_labels(base_url: str, service_client) -> None:
    """The decisions recipe's ``sample_decision``, unmodified: one request with a sparse
    ``target_prompt_logprobs`` naming three labels at the answer position; its
    probabilities are the softmax of the model's logprobs of those labels there."""
    tokenizer = _tiny_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    labels = {label: tokenizer.convert_tokens_to_ids(label) for label in ("7", "8", "1")}
    rendering = DecisionRendering(tokens=[*prompt, labels["7"]], choice_pos=len(prompt), label_tokens=labels)
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
    probabilities = asyncio.run(sample_decision(sampler, rendering))

    scores = _reference_log_softmax()(prompt)[-1, list(labels.values())]
    expected = torch.softmax(scores, dim=0).tolist()
    assert list(probabilities) == list(labels)
    assert list(probabilities.values()) == pytest.approx(expected, abs=1e-4)
