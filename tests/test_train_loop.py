"""`nexrl train` end to end against a small fake service holder whose "skill" training moves.

The fake answers ``a+b=`` prompts correctly with probability sigmoid(skill); ``train``
moves the skill along the advantage-weighted policy gradient, with weight decay and
gradient clipping, so GRPO on it really learns. Everything is seeded: two runs of one
recipe give the same metrics, and so does a run interrupted and resumed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.cli import cli
from nexrl_core.config import ConfigError, ModelConfig, TrainConfig, dump_config, load_config
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.http.serving import ServeOptions
from nexrl_core.plugins.loading import load_plugins
from nexrl_core.plugins.registry import KINDS, Registry, build_registry, get_registry, reset_registry
from nexrl_core.plugins.specs import BackendSpec, ComponentSpec, MetricsSinkSpec, ServiceHolderSpec, ServiceSpec, TaskSpec
from nexrl_core.run.checkpoints import CheckpointError
from nexrl_core.run.loop import TrainingInterrupted, run_training
from nexrl_core.run.metrics import WALL_CLOCK_PREFIXES
from nexrl_core.run.rollout import RolloutError
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_core.run.state import TrainingError, load_run_state
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holders import HolderTarget, TrainStepConfig
from nexrl_core.types import RemoteDatum, SampleResult
from nexrl_remote_api.remote_backend import RemoteApiBackendConfig

# --- the fake backend --------------------------------------------------------------------------------

PROMPT = re.compile(r"\[(-?\d+)\] (\d+)\+(\d+)=</user><assistant>(\d*)")
END = "</assistant>"


def sigmoid(value: float) -> float:
    return 1.0 / (1.0 + math.exp(-value))


def render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


INTERRUPT: dict[str, Any] = {"at_train_call": None}
"""Set to n to raise KeyboardInterrupt inside the n-th holder.train call (Ctrl-C)."""
EXPORT: dict[str, Any] = {"error": None}
"""Set to a message to make the holder's export_model raise it."""
HOLDERS: list[SkillHolder] = []
SERVICES: list[FakeService] = []


@attrs.frozen(kw_only=True)
class SkillHolderConfig(HolderTarget):
    checkpoint_dir: str = ""
    initial_skill: float = -1.0


class SkillHolder:
    """A ServiceHolder whose whole model is one number."""

    def __init__(self, config: SkillHolderConfig) -> None:
        self.config = config
        self.skill = config.initial_skill
        self.sampling_skill = config.initial_skill
        self.version = 0
        self.train_calls: list[tuple[list[RemoteDatum], TrainStepConfig]] = []
        self.samples: list[tuple[int, int]] = []
        """(stream position of the prompt, sampling weights version) per sample."""
        self.options_seen: list[tuple[int, SamplingOptions]] = []
        """(stream position of the prompt, the sampling options it came with) per sample;
        validation prompts have position -1."""
        self.closed = False
        self._lock = threading.Lock()
        HOLDERS.append(self)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False):  # noqa: ANN001
        text = render(messages, add_generation_prompt)
        return [ord(char) for char in text] if tokenize else text

    def sample_from_messages(self, messages, options: SamplingOptions, tools=None) -> SampleResult:  # noqa: ANN001
        return self.sample_from_prompt(self.apply_chat_template(messages, tokenize=True), options)

    def sample_from_prompt(self, prompt, options: SamplingOptions) -> SampleResult:  # noqa: ANN001
        prompt = list(prompt)
        match = PROMPT.findall("".join(map(chr, prompt)))[-1]
        position, a, b = int(match[0]), int(match[1]), int(match[2])
        with self._lock:
            p = sigmoid(self.sampling_skill)
            self.samples.append((position, self.version))
            self.options_seen.append((position, options))
        time.sleep(INTERRUPT["delay"])
        rng = random.Random(options.seed)
        correct = rng.random() < (p if options.temperature > 0 else float(p >= 0.5))
        answer = str(a + b if correct else a + b + 1)
        tokens = [ord(char) for char in answer + END][: options.max_tokens]
        first = math.log(p if correct else 1 - p)
        return SampleResult(
            prompt_tokens=prompt,
            response_tokens=tokens,
            response_logprobs=[first] + [-0.01] * (len(tokens) - 1),
            response_text=answer,
            finish_reason="stop" if len(tokens) == len(answer) + len(END) else "length",
        )

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        return {f"loss_fn_config.{key}": "the fake has no such option" for key in config.loss_fn_config if key == "refused_by_fake"}

    def run_info(self) -> dict[str, str]:
        return {"dtype": "one float"}

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """The reference policy answers correctly with probability sigmoid(initial skill)."""
        return [[0.0] + [-0.5] * (len(tokens) - 1) for tokens in sequences]

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        self.train_calls.append((list(datums), config))
        if INTERRUPT["at_train_call"] == len(self.train_calls):
            raise KeyboardInterrupt
        if INTERRUPT.get("sigterm_at_train_call") == len(self.train_calls):
            os.kill(os.getpid(), signal.SIGTERM)
        if INTERRUPT.get("sigterm_in_a_finalizer_at_train_call") == len(self.train_calls):
            SignalledWhileFinalized()
        p = sigmoid(self.skill)
        gradient, loss = 0.0, 0.0
        for datum in datums:
            text = "".join(chr(token) for token in datum.input_tokens + datum.target_tokens[-1:])
            _, a, b, answer = PROMPT.findall(text)[-1]
            correct = answer == str(int(a) + int(b))
            first = datum.loss_mask.index(1.0)
            advantage = datum.advantages[first]
            gradient += advantage * ((1 - p) if correct else -p)
            loss -= advantage * math.exp(datum.sampling_logprobs[first])
        gradient /= len(datums)
        adam = config.optimizer
        clipped = max(-adam.grad_clip_norm, min(adam.grad_clip_norm, gradient))
        old = self.skill
        self.skill = old + adam.learning_rate * clipped - adam.learning_rate * adam.weight_decay * old
        return {
            "loss": loss / len(datums),
            "approx_kl": (sigmoid(self.skill) - p) ** 2,
            "clip_fraction": float(clipped != gradient),
        }

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        with self._lock:
            self.sampling_skill = self.skill
            self.version += 1
            return f"fake://weights/{self.version}"

    def save_checkpoint(self, name: str) -> str:
        path = Path(self.config.checkpoint_dir) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"skill": self.skill, "version": self.version}))
        return str(path)

    def load_checkpoint(self, path: str) -> None:
        data = json.loads(Path(path).read_text())
        self.skill, self.version = data["skill"], data["version"]

    def export_model(self, directory: Path) -> Path:
        """The sampling skill as the "weights" of an HF-shaped directory."""
        if EXPORT["error"]:
            raise RuntimeError(EXPORT["error"])
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({"skill": self.sampling_skill, "version": self.version}))
        return directory

    def close(self) -> None:
        self.closed = True


class SignalledWhileFinalized:
    """Sends this process SIGTERM from its finalizer: the handler's KeyboardInterrupt is
    raised there, and Python drops it ("Exception ignored in ..."), as it does for a
    signal that lands while any finalizer runs."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class FakeService:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.started = self.stopped = False
        SERVICES.append(self)

    def start(self) -> str:
        self.started = True
        return "http://127.0.0.1:9"

    def stop(self) -> None:
        self.stopped = True

    def failure(self) -> str | None:
        return None

    def serve_forever(self) -> None:
        raise NotImplementedError


# --- the fake task ----------------------------------------------------------------------------------


def addition_agent(item: Mapping[str, Any], llm: Any) -> dict[str, float]:
    if item["pos"] == INTERRUPT.get("at_position"):
        INTERRUPT["at_position"] = None
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while rollouts are in flight
        time.sleep(0.05)
    completion = llm.chat.completions.create(messages=[{"role": "user", "content": f"[{item['pos']}] {item['a']}+{item['b']}="}])
    answer = completion.choices[0].message.content
    return {"reward": float(answer == str(item["a"] + item["b"])), "answer_length": float(len(answer))}


FAIL_ON: dict[str, Any] = {"positions": set()}


def flaky_agent(item: Mapping[str, Any], llm: Any) -> dict[str, float]:
    if item["pos"] in FAIL_ON["positions"]:
        raise RuntimeError(f"agent bug on item {item['pos']}")
    return addition_agent(item, llm)


class FakeAdditionTask:
    def __init__(self, agent: Any = addition_agent) -> None:
        self.agent = agent

    def train_items(self, seed: int) -> Iterator[dict[str, int]]:
        rng = random.Random(seed)
        position = 0
        while True:
            yield {"a": rng.randrange(50), "b": rng.randrange(50), "pos": position}
            position += 1

    def val_items(self) -> list[dict[str, int]]:
        return [{"a": i, "b": 2 * i, "pos": -1} for i in range(6)]


def registry_with(*extra: ComponentSpec) -> Registry:
    base = build_registry(load_plugins())
    specs = {kind: dict(named) for kind, named in base.specs.items()}
    providers = dict(base.providers)
    for spec in extra:
        kind = next(kind for kind, spec_class in KINDS.items() if isinstance(spec, spec_class))
        specs[kind][spec.name] = spec
        providers[(kind, spec.name)] = "tests"
    return Registry(plugins=base.plugins, specs=specs, providers=providers, hook_errors=dict(base.hook_errors))


SINK_CALLS: list[tuple[Any, ...]] = []
"""What the recording sink was told, in order."""
SINK_FAILS: dict[str, Any] = {"at_open": None, "at_step": None}


class RecordingSink:
    """A metrics sink that notes every call; it can fail to start, or fail at a step."""

    def __init__(self, setup: SinkSetup) -> None:
        if SINK_FAILS["at_open"]:
            raise RuntimeError(SINK_FAILS["at_open"])
        SINK_CALLS.append(("open", setup.resumed_from, setup.config, setup.work_dir))

    def log(self, row: Mapping[str, Any]) -> None:
        if row["step"] == SINK_FAILS["at_step"]:
            raise ConnectionError("tracker went away")
        SINK_CALLS.append(("log", row["step"], row.get("reward/mean")))

    def log_final_model(self, path: Path) -> None:
        SINK_CALLS.append(("final_model", path))

    def close(self, outcome: RunOutcome) -> None:
        SINK_CALLS.append(("close", outcome))

    def location(self) -> str:
        return "in SINK_CALLS"


FAKE_SPECS = (
    TaskSpec(name="fake_addition", factory=lambda _: FakeAdditionTask()),
    TaskSpec(name="flaky_addition", factory=lambda _: FakeAdditionTask(flaky_agent)),
    ServiceHolderSpec(name="skill", factory=SkillHolder, config_class=SkillHolderConfig),
    ServiceSpec(name="skill", factory=FakeService, config_class=ServeOptions),
    MetricsSinkSpec(name="recorder", factory=RecordingSink),
)


@pytest.fixture(autouse=True)
def fake_backend() -> Iterator[None]:
    reset_registry(registry_with(*FAKE_SPECS))
    HOLDERS.clear()
    SERVICES.clear()
    INTERRUPT.update(at_train_call=None, at_position=None, delay=0.0, sigterm_at_train_call=None, sigterm_in_a_finalizer_at_train_call=None)
    EXPORT["error"] = None
    FAIL_ON["positions"] = set()
    SINK_CALLS.clear()
    SINK_FAILS.update(at_open=None, at_step=None)
    yield
    reset_registry()


def recipe(tmp_path: Path, *overrides: str, name: str = "run") -> TrainConfig:
    return load_config(
        None,
        [
            f"output.dir={tmp_path / name}",
            "task.name=fake_addition",
            "model.name=skill",
            "backend.name=remote_api",
            "backend.options.service_holder=skill",
            f"backend.options.holder={{checkpoint_dir: '{tmp_path / 'checkpoints' / name}'}}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.concurrency=4",
            "schedule.steps=6",
            "schedule.validate_every=3",
            "schedule.checkpoint_every=2",
            "algorithm.learning_rate=0.5",
            "algorithm.weight_decay=0.01",
            "seed=3",
            *overrides,
        ],
    )


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def timeless(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK_PREFIXES)} for row in rows]


# --- tests -----------------------------------------------------------------------------------------


def test_a_run_writes_metrics_curve_tensorboard_and_checkpoints(tmp_path: Path) -> None:
    summary = run_training(recipe(tmp_path, "backend.options.service=skill"), progress_bar=False)
    run_dir = tmp_path / "run"
    rows = read_rows(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert set(rows[0]) >= {"step", "val/reward/mean", "val/count"} and "reward/mean" not in rows[0]
    assert rows[0]["val/count"] == 6
    required = {
        "step", "reward/mean", "train/loss", "train/approx_kl", "train/clip_fraction", "perf/tokens_per_s",
        "time/step_s", "datums/skipped", "datums/trained", "rollout/agent_errors", "advantages/mean",
        "grpo/uniform_reward_fraction", "agent/answer_length",
    }  # fmt: skip
    for row in rows[1:]:
        assert required <= set(row), required - set(row)
    assert [row["step"] for row in rows if "val/reward/mean" in row] == [0, 3, 6]
    assert all(row["rollout/agent_errors"] == 0 for row in rows[1:])
    assert summary.steps == 6 and summary.metrics_path == run_dir / "metrics.jsonl"
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "sinks" / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "config.yaml").exists()
    state = load_run_state(run_dir)
    assert state is not None and state.step == 6 and Path(state.checkpoint_path).exists()
    assert timeless(state.metrics) == timeless(rows)
    # the embedded service was started for the holder and stopped at the end
    assert rows[0]["backend/dtype"] == "one float" and not any("backend/dtype" in row for row in rows[1:])
    (service,) = SERVICES
    assert service.started and service.stopped and service.options.port == 0
    assert service.options.data_dir == str(run_dir / "backend" / "service")
    (holder,) = HOLDERS
    assert holder.config.base_url == "http://127.0.0.1:9" and holder.closed


def test_grpo_learns_on_the_fake(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "schedule.steps=12", "schedule.checkpoint_every=0"), progress_bar=False)
    rows = read_rows(tmp_path / "run")
    (holder,) = HOLDERS
    assert holder.skill > -1.0 + 1.0, holder.skill
    assert rows[-1]["val/reward/mean"] > rows[0]["val/reward/mean"]


def test_train_step_config_carries_every_adam_parameter(tmp_path: Path) -> None:
    config = recipe(
        tmp_path,
        "schedule.steps=1",
        "algorithm.weight_decay=0.05",
        "algorithm.grad_clip_norm=0.7",
        "algorithm.beta1=0.8",
        "algorithm.beta2=0.99",
        "algorithm.eps=1e-6",
        "algorithm.loss.name=ppo",
        "algorithm.loss.options.clip_high=0.28",
    )
    run_training(config, progress_bar=False)
    (holder,) = HOLDERS
    (_, step_config), *_ = holder.train_calls
    assert step_config == TrainStepConfig(
        loss_fn="ppo",
        loss_fn_config={"clip_low": 0.2, "clip_high": 0.28, "agg_mode": "token-mean", "entropy_coeff": 0.0},
        optimizer=AdamWSettings(learning_rate=0.5, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.7),
    )


def test_sampling_settings_reach_every_sample(tmp_path: Path) -> None:
    """The recipe's rollout settings are what the backend's chat model is asked for:
    training samples at ``rollout.temperature``, validation at ``rollout.val_temperature``
    on ``task.val_size`` items; ``prompts_per_step`` x ``group_size`` runs a step."""
    settings = (
        "schedule.steps=1",
        "schedule.validate_every=1",
        "rollout.temperature=0.7",
        "rollout.val_temperature=0",
        "rollout.top_p=0.9",
        "rollout.max_tokens=5",
        "task.val_size=2",
        "rollout.prompts_per_step=3",
        "rollout.group_size=2",
    )
    run_training(recipe(tmp_path, *settings), progress_bar=False)
    (holder,) = HOLDERS
    training = [options for position, options in holder.options_seen if position >= 0]
    validation = [options for position, options in holder.options_seen if position < 0]
    assert len(training) == 3 * 2 and len(validation) == 2 * 2, "two validations (before step 1 and after it) of two items"
    assert {(o.temperature, o.top_p, o.max_tokens) for o in training} == {(0.7, 0.9, 5)}
    assert {(o.temperature, o.top_p, o.max_tokens) for o in validation} == {(0.0, 0.9, 5)}
    assert len({o.seed for o in training}) == 6, "each run of a group samples with its own seed"
    reseeded = recipe(tmp_path, *settings, "seed=4", name="reseeded")
    HOLDERS.clear()
    run_training(reseeded, progress_bar=False)
    assert {o.seed for _, o in HOLDERS[0].options_seen}.isdisjoint({o.seed for o in training}), "seed moves every sample's seed"


def test_api_key_env_is_the_key_the_holder_gets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXRL_TEST_SERVICE_KEY", "sk-from-the-environment")
    hosted = ("backend.options.base_url=http://127.0.0.1:9", "backend.options.api_key_env=NEXRL_TEST_SERVICE_KEY")
    run_training(recipe(tmp_path, "schedule.steps=1", "schedule.validate_every=0", *hosted), progress_bar=False)
    (holder,) = HOLDERS
    assert holder.config.api_key == "sk-from-the-environment"
    assert holder.config.base_url == "http://127.0.0.1:9" and SERVICES == [], "a base_url starts no embedded service"
    monkeypatch.delenv("NEXRL_TEST_SERVICE_KEY")
    with pytest.raises(ConfigError, match="api_key_env: the environment variable NEXRL_TEST_SERVICE_KEY is not set"):
        run_training(recipe(tmp_path, *hosted, name="nokey"), progress_bar=False)


def test_the_embedded_service_runs_on_backend_options_device(tmp_path: Path) -> None:
    """``backend.options.device`` is the embedded service's ``--device``; with a
    ``base_url`` (a service started elsewhere, on its own device) it is refused by key."""
    run_training(recipe(tmp_path, "schedule.steps=1", "schedule.validate_every=0", "backend.options.device=cuda:1"), progress_bar=False)
    (service,) = SERVICES
    assert service.options.device == "cuda:1" and service.stopped
    hosted = recipe(tmp_path, "backend.options.base_url=http://127.0.0.1:9", "backend.options.device=cuda", name="hosted")
    with pytest.raises(ConfigError, match="backend.options.device: cuda applies to the embedded service only"):
        run_training(hosted, progress_bar=False)
    with pytest.raises(ConfigError, match="backend.options.device: must be cpu, cuda or cuda:N, got 'gpu'"):
        run_training(recipe(tmp_path, "backend.options.device=gpu", name="misspelt"), progress_bar=False)


def test_the_embedded_service_packs_by_backend_options_max_tokens_per_microbatch(tmp_path: Path) -> None:
    """``backend.options.max_tokens_per_microbatch`` is the embedded service's
    ``--max-tokens-per-microbatch`` and null leaves the service's default; with a
    ``base_url`` (a service started elsewhere, packing as it was started) it is refused by
    key before step 1."""
    one_step = ("schedule.steps=1", "schedule.validate_every=0")
    run_training(recipe(tmp_path, *one_step, "backend.options.max_tokens_per_microbatch=24"), progress_bar=False)
    run_training(recipe(tmp_path, *one_step, name="default"), progress_bar=False)
    assert [service.options.max_tokens_per_microbatch for service in SERVICES] == [24, ServeOptions().max_tokens_per_microbatch]
    hosted = recipe(tmp_path, "backend.options.base_url=http://127.0.0.1:9", "backend.options.max_tokens_per_microbatch=24", name="hosted")
    with pytest.raises(
        ConfigError,
        match=r"backend.options.max_tokens_per_microbatch: 24 applies to the embedded service only; .*"
        r"nexrl serve NAME --max-tokens-per-microbatch 24",
    ):
        run_training(hosted, progress_bar=False)
    assert len(SERVICES) == 2 and not (tmp_path / "hosted" / "metrics.jsonl").exists(), "refused before anything ran"
    with pytest.raises(ConfigError, match="backend.options.max_tokens_per_microbatch: must be null or an integer > 0, got 0"):
        run_training(recipe(tmp_path, "backend.options.max_tokens_per_microbatch=0", name="zero"), progress_bar=False)


def test_nexrl_serve_max_tokens_per_microbatch_is_the_services_option() -> None:
    """``nexrl serve NAME --max-tokens-per-microbatch N`` builds the service with N, and
    without the flag with `ServeOptions`' default (the fake service cannot serve in the
    foreground, so the command ends once it is built)."""
    for flag, expected in ((["--max-tokens-per-microbatch", "24"], 24), ([], ServeOptions().max_tokens_per_microbatch)):
        SERVICES.clear()
        result = CliRunner().invoke(cli, ["serve", "skill", "--port", "0", *flag])
        assert isinstance(result.exception, NotImplementedError), result.output
        (service,) = SERVICES
        assert service.options.max_tokens_per_microbatch == expected


def test_datums_are_shifted_with_masked_advantages_and_uniform_groups_skipped(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "schedule.steps=2", "schedule.validate_every=0"), progress_bar=False)
    rows = read_rows(tmp_path / "run")
    (holder,) = HOLDERS
    for row, (datums, _) in zip(rows, holder.train_calls):
        assert row["datums/trained"] == len(datums)
        assert row["datums/trained"] + row["datums/skipped"] == 16
        assert row["datums/skipped"] == 4 * 4 * row["grpo/uniform_reward_fraction"]
        for datum in datums:
            assert not datum.all_advantages_zero
            assert len(datum.input_tokens) == len(datum.target_tokens)
            first = datum.loss_mask.index(1.0)
            # prompt positions carry nothing; the trained ones one advantage and the sampler's logprobs
            assert set(datum.advantages[:first]) == {0.0} and set(datum.sampling_logprobs[:first]) == {0.0}
            assert len(set(datum.advantages[first:])) == 1
            assert datum.sampling_logprobs[first] < 0


def test_per_token_advantages_train_through_the_trainer(tmp_path: Path) -> None:
    """A non-default estimator with per-token advantages (reinforce_plus_plus, gamma 0.5)
    reaches the holder token by token: a run's trained tokens carry different advantages,
    the last (nearest its reward) the largest for a rewarded run."""
    estimator = ("algorithm.advantage.name=reinforce_plus_plus", "algorithm.advantage.options.gamma=0.5")
    run_training(recipe(tmp_path, "schedule.steps=2", "schedule.validate_every=0", *estimator), progress_bar=False)
    rows = read_rows(tmp_path / "run")
    assert all(math.isfinite(row["train/loss"]) for row in rows)
    datums = [datum for datums, _ in HOLDERS[0].train_calls for datum in datums]
    rewarded = [d for d in datums if d.advantages[-1] == max(d.advantages) and d.advantages[-1] > 0]
    assert rewarded, "some run was rewarded"
    for datum in rewarded:
        trained = [a for a, m in zip(datum.advantages, datum.loss_mask) if m]
        assert len(set(trained)) == len(trained) and trained == sorted(trained), trained


def test_two_runs_of_one_recipe_agree(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, name="a"), progress_bar=False)
    run_training(recipe(tmp_path, name="b"), progress_bar=False)
    assert timeless(read_rows(tmp_path / "a")) == timeless(read_rows(tmp_path / "b"))


@pytest.mark.parametrize("staleness", [0, 1])
def test_interrupt_then_resume_matches_an_uninterrupted_run(tmp_path: Path, staleness: int) -> None:
    stale = f"rollout.max_staleness={staleness}"
    run_training(recipe(tmp_path, stale, name="straight"), progress_bar=False)
    expected = timeless(read_rows(tmp_path / "straight"))

    threads_before = set(threading.enumerate())
    INTERRUPT["at_train_call"] = 5  # Ctrl-C while step 5 trains; the last checkpoint is step 4
    with pytest.raises(TrainingInterrupted) as interrupted:
        run_training(recipe(tmp_path, stale, name="resumed"), progress_bar=False)
    assert isinstance(interrupted.value, KeyboardInterrupt) and interrupted.value.checkpoint_step == 4
    assert set(threading.enumerate()) == threads_before, "no worker thread may outlive the run"
    assert SERVICES[-1].stopped and HOLDERS[-1].closed
    state = load_run_state(tmp_path / "resumed")
    assert state is not None and state.step == 4 and len(state.pending) == staleness

    INTERRUPT["at_train_call"] = None
    run_training(recipe(tmp_path, stale, name="resumed"), resume=True, progress_bar=False)
    assert timeless(read_rows(tmp_path / "resumed")) == expected


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal, while the test runs: a shell starts
    a background job (a CI runner's, say) with SIGINT ignored, and Python keeps it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_rollouts_stops_workers_and_keeps_the_checkpoint(tmp_path: Path, ctrl_c_raises: None) -> None:
    run_training(recipe(tmp_path, name="straight"), progress_bar=False)
    expected = timeless(read_rows(tmp_path / "straight"))

    threads_before = set(threading.enumerate())
    INTERRUPT.update(at_position=4 * 4 + 1, delay=0.01)  # an item of step 5, after the step-4 checkpoint
    with pytest.raises(TrainingInterrupted) as interrupted:
        run_training(recipe(tmp_path, "rollout.concurrency=2", name="resumed"), progress_bar=False)
    assert interrupted.value.checkpoint_step == 4
    assert set(threading.enumerate()) == threads_before
    assert max(position for position, _ in HOLDERS[-1].samples) < 6 * 4, "no later step may start"

    INTERRUPT.update(delay=0.0)
    run_training(recipe(tmp_path, "rollout.concurrency=2", name="resumed"), resume=True, progress_bar=False)
    assert timeless(read_rows(tmp_path / "resumed")) == expected


def test_one_step_off_samples_step_k_with_the_weights_of_step_k_minus_2(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "rollout.max_staleness=1", "schedule.validate_every=0"), progress_bar=False)
    (holder,) = HOLDERS
    trained = [row["datums/trained"] > 0 for row in read_rows(tmp_path / "run")]
    assert all(trained)  # so weights version v is the one published after step v
    for position, version in holder.samples:
        step = position // 4 + 1
        assert version == max(step - 2, 0), (position, version)


def test_on_policy_samples_step_k_with_the_weights_of_step_k_minus_1(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "schedule.validate_every=0"), progress_bar=False)
    (holder,) = HOLDERS
    for position, version in holder.samples:
        assert version == position // 4, (position, version)


def test_single_run_groups_train_nothing_and_stay_finite(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "rollout.group_size=1", "schedule.steps=2"), progress_bar=False)
    rows = read_rows(tmp_path / "run")
    assert all(row["datums/trained"] == 0 and row["datums/skipped"] == 4 for row in rows[1:])
    assert all(row["grpo/single_run_groups"] == 4 for row in rows[1:])
    assert all(value is not None for row in rows for value in row.values())
    assert HOLDERS[0].train_calls == []


def test_agent_errors_are_counted_within_the_budget(tmp_path: Path) -> None:
    FAIL_ON["positions"] = {1, 6}
    run_training(recipe(tmp_path, "task.name=flaky_addition", "rollout.error_budget=0.5", "schedule.steps=2"), progress_bar=False)
    rows = read_rows(tmp_path / "run")
    assert [row["rollout/agent_errors"] for row in rows[1:]] == [4, 4]  # a failing item fails all its runs
    assert rows[-1]["rollout/agent_errors_total"] == 8


def test_agent_errors_beyond_the_budget_stop_the_run(tmp_path: Path) -> None:
    FAIL_ON["positions"] = {1}
    with pytest.raises(RolloutError, match=r"4 of 16 agent runs failed in step 1.*error_budget=0\.2.*agent bug on item 1"):
        run_training(recipe(tmp_path, "task.name=flaky_addition", "rollout.error_budget=0.2"), progress_bar=False)
    assert SERVICES[-1].stopped


def test_total_error_budget(tmp_path: Path) -> None:
    FAIL_ON["positions"] = {1, 6}
    config = recipe(tmp_path, "task.name=flaky_addition", "rollout.error_budget=1.0", "rollout.max_agent_errors=5")
    with pytest.raises(RolloutError, match=r"8 agent runs have failed so far.*max_agent_errors=5"):
        run_training(config, progress_bar=False)


def test_a_previous_run_is_not_overwritten_by_accident(tmp_path: Path) -> None:
    config = recipe(tmp_path, "schedule.steps=1")
    run_training(config, progress_bar=False)
    with pytest.raises(TrainingError, match="--resume.*--overwrite"):
        run_training(config, progress_bar=False)
    run_training(config, overwrite=True, progress_bar=False)
    assert [row["step"] for row in read_rows(tmp_path / "run")] == [0, 1]


def test_resume_needs_a_checkpoint_and_the_same_recipe(tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="nothing to resume"):
        run_training(recipe(tmp_path), resume=True, progress_bar=False)
    run_training(recipe(tmp_path, "schedule.steps=2"), progress_bar=False)
    with pytest.raises(TrainingError, match=r"rollout.group_size: 4 -> 2"):
        run_training(recipe(tmp_path, "schedule.steps=4", "rollout.group_size=2"), resume=True, progress_bar=False)
    # more steps is fine: the run continues
    run_training(recipe(tmp_path, "schedule.steps=4"), resume=True, progress_bar=False)
    assert [row["step"] for row in read_rows(tmp_path / "run")] == [0, 1, 2, 3, 4]


def test_jsonl_data_with_an_agent_module(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"a": i, "b": i % 7, "pos": i}) + "\n" for i in range(10)))
    (tmp_path / "val.jsonl").write_text(json.dumps({"a": 1, "b": 1, "pos": -1}) + "\n")
    (tmp_path / "my_agent_mod.py").write_text(
        "def run(item, llm):\n"
        "    content = f\"[{item['pos']}] {item['a']}+{item['b']}=\"\n"
        "    out = llm.chat.completions.create(messages=[{'role': 'user', 'content': content}])\n"
        "    return float(out.choices[0].message.content == str(item['a'] + item['b']))\n"
    )
    config = recipe(
        tmp_path,
        "task.name=my_jsonl_task",
        "task.data_path=train.jsonl",
        "task.val_data_path=val.jsonl",
        "task.agent=my_agent_mod:run",
        "schedule.steps=3",
    )
    run_training(config, recipe_dir=tmp_path, progress_bar=False)
    rows = read_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3] and rows[0]["val/count"] == 1
    positions = sorted({position for position, _ in HOLDERS[0].samples if position >= 0})
    assert positions == list(range(10))  # 3 steps x 4 prompts cover the 10 items, then a new epoch


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.name=nope"], "task.name: unknown task 'nope'"),
        (["backend.options.trainer=nope"], "backend.options.trainer: unknown trainer 'nope'"),
        (
            ["backend.options.service_holder=nope", "backend.options.service=skill"],
            "backend.options.service_holder: unknown service holder 'nope'",
        ),
        (["backend.options.holder={colour: red}"], "backend.options.holder.colour: unknown key"),
        (["backend.options.holder={seed: 3}"], "backend.options.holder.seed: set by the recipe"),
        (["backend.options={colour: red}"], "backend.options.colour: unknown key"),
        (["backend.name=nope"], "backend.name: unknown backend 'nope'"),
        (
            ["backend.name=null"],
            "backend.name: not set; choose one of the installed: inprocess (from engine), remote_api (from remote_api), self-hosted (from fsdp)",
        ),
        (["model.name=null"], "model.name: not set"),
        (
            ["algorithm.loss.options.agg_mode=seq-mean-token-sum", "backend.options.holder.initial_skill=-2"],
            None,
        ),
        (["task.data_path=missing.jsonl", "task.agent=x:y"], "task.data_path: cannot read"),
        (["task.data_path=missing.jsonl"], "task.data_path: cannot read"),
    ],
)
def test_bad_recipes_fail_with_the_key(tmp_path: Path, overrides: list[str], message: str | None) -> None:
    if message is None:  # the control row: these overrides are fine, so the fixture itself is sound
        run_training(recipe(tmp_path, *overrides, "schedule.steps=1"), progress_bar=False)
        return
    with pytest.raises(ConfigError) as caught:
        run_training(recipe(tmp_path, *overrides), progress_bar=False)
    assert message in str(caught.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_option_the_holder_refuses_stops_the_run_before_step_1(tmp_path: Path) -> None:
    from nexrl_core.training.holder_backend import HolderBackend

    holder = SkillHolder(SkillHolderConfig(model=ModelConfig(name="skill")))
    trainer = type("T", (), {"train_step": TrainStepConfig(loss_fn_config={"refused_by_fake": 1.0})})()
    with pytest.raises(ConfigError, match="algorithm.loss.options.refused_by_fake: backend 'x' cannot honour it"):
        HolderBackend(holder, trainer, name="x", work_dir=tmp_path)  # type: ignore[arg-type]


def skill_run_args(tmp_path: Path, *overrides: str) -> list[str]:
    """``nexrl train`` of the fake addition task on the skill holder, into ``tmp_path``, plus ``overrides``."""
    return [
        "train", "task.name=fake_addition", "model.name=skill", "backend.options.service_holder=skill",
        f"output.dir={tmp_path / 'out'}", f"backend.options.holder={{checkpoint_dir: '{tmp_path / 'ck'}'}}", *overrides,
    ]  # fmt: skip


def test_cli_train_runs_a_recipe_and_says_where_results_are(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "task:\n  name: fake_addition\nmodel:\n  name: skill\nbackend:\n  name: remote_api\n"
        "  options:\n    service_holder: skill\nschedule:\n  steps: 2\n"
    )
    result = CliRunner().invoke(
        cli,
        [
            "train",
            str(path),
            f"output.dir={tmp_path / 'out'}",
            f"backend.options.holder={{checkpoint_dir: '{tmp_path / 'ck'}'}}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "task.val_size=2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"metrics:      {tmp_path / 'out' / 'metrics.jsonl'}" in result.output
    assert f"reward curve: {tmp_path / 'out' / 'reward_curve.png'}" in result.output
    assert "step 2/2" in result.output  # one plain line per step when stdout is not a terminal


def test_cli_train_reports_a_bad_recipe_with_status_2(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("rollout:\n  group_size: 0\n  grup: 3\n")
    result = CliRunner().invoke(cli, ["train", str(path)])
    assert result.exit_code == 2
    assert "rollout.group_size: must be a finite number > 0" in result.output
    assert "rollout.grup: unknown key; valid keys: concurrency" in result.output


def test_cli_train_without_a_recipe_runs_the_quickstart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # The quickstart needs the addition task and the local Tinker service; without them it says so.
    result = CliRunner().invoke(
        cli,
        ["train", "task.name=fake_addition", "backend.options.service_holder=skill", "backend.options.service=nope"],
    )
    assert "running the built-in quickstart" in result.output
    assert result.exit_code == 2 and "backend.options.service: unknown service 'nope'" in result.output


def test_cli_ctrl_c_exits_130_with_the_resume_command(tmp_path: Path) -> None:
    INTERRUPT["at_train_call"] = 3
    args = skill_run_args(tmp_path, "schedule.checkpoint_every=2", "schedule.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130
    assert "the last checkpoint (step 2) is intact; continue with: nexrl train" in result.output
    assert "--resume" in result.output


def test_cli_sigterm_stops_like_ctrl_c(tmp_path: Path) -> None:
    INTERRUPT["sigterm_at_train_call"] = 2
    before = signal.getsignal(signal.SIGTERM)
    args = skill_run_args(tmp_path, "schedule.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.group_size=4")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    assert "the last checkpoint (step 1) is intact" in result.output
    assert signal.getsignal(signal.SIGTERM) == before
    assert SERVICES[-1].stopped


def test_a_sigterm_whose_interrupt_python_drops_still_ends_the_run_before_the_next_checkpoint(tmp_path: Path) -> None:
    INTERRUPT["sigterm_in_a_finalizer_at_train_call"] = 2
    args = skill_run_args(
        tmp_path,
        "schedule.checkpoint_every=1",
        "schedule.steps=4",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
    )
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    assert "the last checkpoint (step 1) is intact" in result.output
    assert len(HOLDERS[-1].train_calls) == 2
    assert SERVICES[-1].stopped


def test_the_live_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_training(recipe(tmp_path, "schedule.steps=2"), progress_bar=True)
    out = capsys.readouterr().out
    assert "step 2/2" in out and "reward" in out and "ETA" in out


# --- metrics sinks -----------------------------------------------------------------------------------


def test_sinks_get_every_row_the_recipe_the_final_model_and_how_the_run_ended(tmp_path: Path) -> None:
    config = recipe(tmp_path, "output.sinks=[recorder]")
    summary = run_training(config, progress_bar=False)
    rows = read_rows(tmp_path / "run")
    assert SINK_CALLS == [
        ("open", None, dump_config(config), tmp_path / "run" / "sinks" / "recorder"),
        *[("log", row["step"], row.get("reward/mean")) for row in rows],
        ("final_model", tmp_path / "run" / "final_model"),
        ("close", RunOutcome.FINISHED),
    ]
    assert summary.sinks == {"recorder": "in SINK_CALLS"}
    assert not (tmp_path / "run" / "sinks" / "tensorboard").exists(), "output.sinks replaces the default sinks"


def test_no_sinks_and_the_default_sinks(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "output.sinks=[]", name="none"), progress_bar=False)
    assert not (tmp_path / "none" / "sinks").exists() and SINK_CALLS == []
    summary = run_training(recipe(tmp_path, name="defaults"), progress_bar=False)  # output.sinks unset
    defaults = [name for name in get_registry().names("metrics_sinks") if get_registry().find_spec("metrics_sinks", name).default]
    assert list(summary.sinks) == defaults and defaults, "the installed sinks that say they are a default"


def test_a_sink_that_cannot_start_refuses_the_run_before_step_1(tmp_path: Path) -> None:
    SINK_FAILS["at_open"] = "set RECORDER_TOKEN"
    with pytest.raises(ConfigError) as refused:
        run_training(recipe(tmp_path, "output.sinks=[recorder]"), progress_bar=False)
    assert "output.sinks[0]: metrics sink 'recorder' could not start: set RECORDER_TOKEN" in str(refused.value)
    assert HOLDERS == [] and SERVICES == [], "nothing started"
    assert not (tmp_path / "run").exists()


def test_a_sink_raising_mid_run_is_reported_once_and_the_run_finishes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    SINK_FAILS["at_step"] = 3
    with caplog.at_level(logging.WARNING, logger="nexrl.train"):
        summary = run_training(recipe(tmp_path, "output.sinks=[recorder]"), progress_bar=False)
    assert summary.steps == 6 and summary.final_model is not None
    assert [record.getMessage() for record in caplog.records if "recorder" in record.getMessage()] == [
        "metrics sink 'recorder' failed at step 3 and is off for the rest of this run: ConnectionError: tracker went away"
    ]
    assert [call[1] for call in SINK_CALLS if call[0] == "log"] == [0, 1, 2]
    assert SINK_CALLS[-1][0] == "log", "a sink turned off gets neither the final model nor the close"
    assert summary.sinks == {"recorder": "turned off at step 3: ConnectionError: tracker went away"}


def test_resume_tells_the_sinks_where_the_run_goes_on_from(tmp_path: Path) -> None:
    INTERRUPT["at_train_call"] = 5  # Ctrl-C while step 5 trains; the last checkpoint is step 4
    with pytest.raises(TrainingInterrupted):
        run_training(recipe(tmp_path, "output.sinks=[recorder]"), progress_bar=False)
    assert SINK_CALLS[-1] == ("close", RunOutcome.INTERRUPTED)
    SINK_CALLS.clear()
    INTERRUPT["at_train_call"] = None
    run_training(recipe(tmp_path, "output.sinks=[recorder]"), resume=True, progress_bar=False)
    assert SINK_CALLS[0][:2] == ("open", 4)
    assert [call[1] for call in SINK_CALLS if call[0] == "log"] == [5, 6]
    assert SINK_CALLS[-1] == ("close", RunOutcome.FINISHED)


# --- checkpoints saved in the background -------------------------------------------------------------

BACKGROUND: dict[str, Any] = {"fail_step": None}
"""``fail_step``: the background save of that step fails."""


class BackgroundSavingBackend:
    """The fake's ``remote_api`` backend, whose checkpoints finish later, as the
    self-hosted workers' do: ``save_checkpoint`` returns a future; the save of step k
    completes when step k+2 starts training, the last one (and any pending at Ctrl-C)
    0.1 s later on a thread of its own. It notes which checkpoint the run state names
    whenever a step starts training."""

    def __init__(self, inner: Any, setup: BackendSetup) -> None:
        self.inner = inner
        self.out_dir = setup.work_dir.parent
        self.last_step = setup.recipe.schedule.steps
        self.saving: dict[int, tuple[Future[str], str]] = {}
        self.named_at_train: dict[int, int | None] = {}
        """Step → the checkpoint step the run state named when that step started training."""
        self.running_at_export: list[int] | None = None
        """Steps whose saves were still running when the final model was exported."""
        BACKENDS.append(self)

    def __getattr__(self, name: str) -> Any:  # chat_model, sync_weights, load_checkpoint, close
        return getattr(self.inner, name)

    def save_checkpoint(self, name: str) -> Future[str]:
        step = int(name.removeprefix("step_"))
        future: Future[str] = Future()
        self.saving[step] = (future, self.inner.save_checkpoint(name))
        if step == self.last_step:
            self._finish_later()
        return future

    def _finish(self, step: int) -> None:
        future, path = self.saving.pop(step)
        if step == BACKGROUND["fail_step"]:
            future.set_exception(OSError("disk full"))
        else:
            future.set_result(path)

    def _finish_later(self) -> None:
        steps = sorted(self.saving)
        threading.Timer(0.1, lambda: [self._finish(step) for step in steps]).start()

    def export_model(self, directory: Path) -> Path:
        self.running_at_export = sorted(self.saving)
        return self.inner.export_model(directory)

    def train(self, trajectories: Sequence[Any], step: int) -> dict[str, float]:
        state = load_run_state(self.out_dir)
        self.named_at_train[step] = state.step if state else None
        if step - 2 in self.saving:
            self._finish(step - 2)
        try:
            return self.inner.train(trajectories, step)
        except KeyboardInterrupt:
            self._finish_later()
            raise


BACKENDS: list[BackgroundSavingBackend] = []


def open_background_saving(setup: BackendSetup) -> BackgroundSavingBackend:
    from nexrl_core.plugins.registry import find_spec

    return BackgroundSavingBackend(find_spec("backends", "remote_api").open(setup), setup)


@pytest.fixture
def background_saves(fake_backend: None) -> None:
    """The fakes plus backend ``background_saves``."""
    spec = BackendSpec(name="background_saves", factory=open_background_saving, config_class=RemoteApiBackendConfig)
    reset_registry(registry_with(*FAKE_SPECS, spec))
    BACKENDS.clear()
    BACKGROUND["fail_step"] = None


def background_recipe(tmp_path: Path, *overrides: str, name: str = "run") -> TrainConfig:
    """`recipe` on the background-saving backend (naming a backend resets its options)."""
    return recipe(
        tmp_path,
        "backend.name=background_saves",
        "backend.options.service_holder=skill",
        f"backend.options.holder={{checkpoint_dir: '{tmp_path / 'checkpoints' / name}'}}",
        *overrides,
        name=name,
    )


@pytest.mark.usefixtures("background_saves")
def test_a_background_checkpoint_is_recorded_only_once_saved_and_in_step_order(tmp_path: Path) -> None:
    summary = run_training(background_recipe(tmp_path), progress_bar=False)
    (backend,) = BACKENDS
    # the save of step 2 finishes as step 4 starts; the run state names it from step 5 on
    assert backend.named_at_train == {1: None, 2: None, 3: None, 4: None, 5: 2, 6: 2}
    state = load_run_state(tmp_path / "run")
    assert state is not None and state.step == 6 and summary.checkpoint_step == 6, "the last save is awaited"
    assert list(state.checkpoint_paths()) == [2, 4, 6]
    assert summary.final_model is not None and backend.running_at_export == [], "saves end before the export"
    assert timeless(state.metrics) == timeless(read_rows(tmp_path / "run")), "the state of step 6 is step 6's"


@pytest.mark.usefixtures("background_saves")
def test_a_failed_background_checkpoint_is_reported_with_its_step_and_never_recorded(tmp_path: Path) -> None:
    BACKGROUND["fail_step"] = 4
    with pytest.raises(CheckpointError, match="the checkpoint of step 4 was not written: OSError: disk full"):
        run_training(background_recipe(tmp_path), progress_bar=False)
    (backend,) = BACKENDS
    assert set(backend.named_at_train.values()) == {None, 2}
    state = load_run_state(tmp_path / "run")
    # step 6's save had started and completes while the run ends: it is recorded, 4 never is
    assert state is not None and list(state.checkpoint_paths()) == [2, 6]
    assert HOLDERS[0].closed and SERVICES[0].stopped


@pytest.mark.usefixtures("background_saves")
def test_ctrl_c_waits_for_a_background_checkpoint_then_resume_continues_from_it(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, name="straight"), progress_bar=False)
    expected = timeless(read_rows(tmp_path / "straight"))

    INTERRUPT["at_train_call"] = 5  # the save of step 4 is still running
    with pytest.raises(TrainingInterrupted) as interrupted:
        run_training(background_recipe(tmp_path, name="resumed"), progress_bar=False)
    assert interrupted.value.checkpoint_step == 4
    assert load_run_state(tmp_path / "resumed").step == 4  # type: ignore[union-attr]

    INTERRUPT["at_train_call"] = None
    run_training(background_recipe(tmp_path, name="resumed"), resume=True, progress_bar=False)
    assert timeless(read_rows(tmp_path / "resumed")) == expected


@pytest.mark.usefixtures("background_saves")
def test_cli_reports_a_failed_background_checkpoint_with_its_step(tmp_path: Path) -> None:
    BACKGROUND["fail_step"] = 2
    args = [  # the backend is named before its options: naming it afterwards would start its options afresh
        "train",
        "task.name=fake_addition",
        "model.name=skill",
        "backend.name=background_saves",
        "backend.options.service_holder=skill",
        f"output.dir={tmp_path / 'out'}",
        f"backend.options.holder={{checkpoint_dir: '{tmp_path / 'ck'}'}}",
        "schedule.checkpoint_every=2",
        "schedule.steps=4",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "Error: the checkpoint of step 2 was not written: OSError: disk full" in result.output


# --- the trained model as an output ------------------------------------------------------------------


def exported(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def test_a_run_ends_with_the_final_model_of_the_last_sync(tmp_path: Path) -> None:
    summary = run_training(recipe(tmp_path, "schedule.steps=3"), progress_bar=False)
    (holder,) = HOLDERS
    final = tmp_path / "run" / "final_model"
    assert summary.final_model == final and summary.final_model_error is None
    assert exported(final) == {"skill": holder.sampling_skill, "version": 3}
    assert holder.sampling_skill == holder.skill != SkillHolderConfig.initial_skill
    assert sorted(path.name for path in (tmp_path / "run").iterdir() if "final_model" in path.name) == ["final_model"]
    state = load_run_state(tmp_path / "run")
    assert state is not None and list(state.checkpoint_paths()) == [2, 3]


def test_a_failed_export_is_reported_and_the_run_still_counts_as_done(tmp_path: Path) -> None:
    EXPORT["error"] = "disk full"
    summary = run_training(recipe(tmp_path, "schedule.steps=2"), progress_bar=False)
    assert summary.steps == 2 and summary.final_model is None
    assert summary.final_model_error == "backend 'remote_api' failed to export the model: RuntimeError: disk full"
    assert not list((tmp_path / "run").glob("final_model*"))
    assert load_run_state(tmp_path / "run").step == 2  # type: ignore[union-attr]
    assert HOLDERS[0].closed and SERVICES[0].stopped


def test_a_holder_without_export_is_named_in_the_error(tmp_path: Path) -> None:
    from nexrl_core.training.holder_backend import HolderBackend
    from nexrl_core.training.model_export import ModelExportError

    class Holder:
        def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
            return {}

    trainer = type("T", (), {"train_step": TrainStepConfig()})()
    backend = HolderBackend(Holder(), trainer, name="acme", work_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ModelExportError, match="backend 'acme' cannot export the model: its service holder Holder has no export_model"):
        backend.export_model(tmp_path / "out")


def test_overwrite_removes_the_previous_final_model(tmp_path: Path) -> None:
    config = recipe(tmp_path, "schedule.steps=1")
    run_training(config, progress_bar=False)
    EXPORT["error"] = "no export this time"
    run_training(config, overwrite=True, progress_bar=False)
    assert not (tmp_path / "run" / "final_model").exists()


def test_cli_train_prints_the_final_model_or_why_not(tmp_path: Path) -> None:
    args = skill_run_args(
        tmp_path,
        "schedule.steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "task.val_size=2",
    )
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert f"final model:  {tmp_path / 'out' / 'final_model'}  (a Hugging Face directory" in result.output
    EXPORT["error"] = "disk full"
    result = CliRunner().invoke(cli, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert "final model:  not written: backend 'remote_api' failed to export the model: RuntimeError: disk full" in result.output
    assert f"try: nexrl export {tmp_path / 'out'}" in result.output


def test_nexrl_export_writes_the_model_of_any_checkpoint(tmp_path: Path) -> None:
    run_training(recipe(tmp_path, "schedule.steps=4"), progress_bar=False)
    run_dir = tmp_path / "run"
    skills = {}
    for step, path in load_run_state(run_dir).checkpoint_paths().items():  # type: ignore[union-attr]
        skills[step] = json.loads(Path(path).read_text())["holder"]
    result = CliRunner().invoke(cli, ["export", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(run_dir / "export_step_4")
    assert exported(run_dir / "export_step_4")["skill"] == exported(run_dir / "final_model")["skill"]
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--step", "2", "--out", str(tmp_path / "two")])
    assert result.exit_code == 0, result.output
    assert exported(tmp_path / "two")["skill"] == json.loads(Path(skills[2]).read_text())["skill"]
    assert exported(tmp_path / "two")["skill"] != exported(run_dir / "final_model")["skill"]


@pytest.mark.parametrize(
    ("where", "args", "message"),
    [
        ("missing", [], "does not exist; pass the output.dir of a `nexrl train` run"),
        ("empty", [], "is not a run directory: it has no config.yaml"),
        ("no_checkpoint", [], "has no checkpoint (run_state.json is missing)"),
        ("run", ["--step", "3"], "has no checkpoint of step 3; steps with a checkpoint: 2, 4"),
    ],
)
def test_nexrl_export_says_what_is_missing(tmp_path: Path, where: str, args: list[str], message: str) -> None:
    run_training(recipe(tmp_path, "schedule.steps=4"), progress_bar=False)
    run_training(recipe(tmp_path, "schedule.steps=1", "schedule.checkpoint_every=0", name="no_checkpoint"), progress_bar=False)
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli, ["export", str(tmp_path / where), *args])
    assert result.exit_code == 1
    assert message in result.output


SCHEDULED = (
    "schedule.steps=4",
    "schedule.checkpoint_every=2",
    "schedule.validate_every=0",
    "algorithm.learning_rate=0.4",
    "algorithm.lr_schedule=cosine",
    "algorithm.warmup_steps=2",
)
SCHEDULED_RATES = {1: 0.2, 2: 0.4, 3: 0.2, 4: 0.0}
"""Warmup 1/2 and 2/2 of 0.4, then half a cosine over steps 3-4: cos(pi/2) and cos(pi) halves."""


def test_each_step_sends_its_scheduled_learning_rate_and_resume_sends_the_same(tmp_path: Path) -> None:
    """``algorithm.lr_schedule`` and ``warmup_steps`` set the learning rate of each step's
    optimizer call (`TrainStepConfig.optimizer`, what every remote-API holder sends its
    service), logged as ``optim/lr``; a run resumed from step 2 sends steps 3 and 4 the same."""
    run_training(recipe(tmp_path, *SCHEDULED, name="straight"), progress_bar=False)
    rows = [row for row in read_rows(tmp_path / "straight") if "optim/lr" in row]
    assert {row["step"]: row["optim/lr"] for row in rows} == pytest.approx(SCHEDULED_RATES)
    (holder,) = HOLDERS
    assert [config.optimizer.learning_rate for _, config in holder.train_calls] == pytest.approx([row["optim/lr"] for row in rows])

    HOLDERS.clear()
    INTERRUPT["at_train_call"] = 3  # Ctrl-C while step 3 trains; the last checkpoint is step 2
    with pytest.raises(TrainingInterrupted):
        run_training(recipe(tmp_path, *SCHEDULED, name="resumed"), progress_bar=False)
    INTERRUPT["at_train_call"] = None
    run_training(recipe(tmp_path, *SCHEDULED, name="resumed"), resume=True, progress_bar=False)
    resumed = HOLDERS[-1]
    assert [config.optimizer.learning_rate for _, config in resumed.train_calls] == pytest.approx([SCHEDULED_RATES[3], SCHEDULED_RATES[4]])
