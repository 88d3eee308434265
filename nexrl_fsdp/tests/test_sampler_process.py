"""The self-hosted run's sampler process on its own (no workers): it samples what the engine
samples for many threads at once, loads weights in place, exports them, and never hangs or
outlives its driver."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nexrl_core.chat.model import SamplingOptions
from nexrl_engine.batching import BatchedSamplingOptions
from nexrl_engine.config import EngineConfig
from nexrl_engine.engine import Engine
from nexrl_engine.loading import load_tokenizer, resolve_model_dir
from nexrl_engine.types import SamplingParams
from nexrl_fsdp.direct_zmq.group_key import new_group_key
from nexrl_fsdp.selfhosted.sampler_chat import SamplerChat
from nexrl_fsdp.selfhosted.sampler_process import SamplerError, SamplerProcess
from nexrl_fsdp.selfhosted.sampler_server import SamplerSettings

SETTINGS = SamplerSettings(
    engine=EngineConfig(model="nexrl-tiny", seed=3), batching=BatchedSamplingOptions(sample_linger_s=0.002, max_batch_rows=16)
)
MESSAGES = [{"role": "user", "content": "12+30="}]


def start(log: Path, settings: SamplerSettings = SETTINGS) -> SamplerChat:
    process = SamplerProcess(settings, log, key=new_group_key())
    try:
        process.wait_ready()
    except BaseException:
        process.stop()
        raise
    return SamplerChat(process, load_tokenizer(resolve_model_dir(settings.engine.model)))


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SamplerChat]:
    sampler = start(tmp_path_factory.mktemp("sampler") / "sampler.log")
    try:
        yield sampler
    finally:
        sampler.process.stop()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(SETTINGS.engine)


def test_it_runs_in_its_own_process_and_stop_ends_it(tmp_path: Path) -> None:
    sampler = start(tmp_path / "sampler.log")
    process = sampler.process
    assert process.pid != os.getpid() and process.alive()
    assert process.request({"kind": "info"}).header["pid"] == process.pid, "the answers come from that process"
    process.stop()
    assert not process.alive()
    with pytest.raises(SamplerError, match="stopped"):
        sampler.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=4))


def test_concurrent_samples_are_what_the_engine_draws_alone(chat: SamplerChat, engine: Engine) -> None:
    options = [SamplingOptions(max_tokens=6, seed=seed) for seed in range(24)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda option: chat.sample_from_messages(MESSAGES, option), options))
    prompt = results[0].prompt_tokens
    stop = chat._chat.default_stop()
    for option, result in zip(options, results):
        alone = engine.sample([prompt], SamplingParams(max_tokens=6, stop=stop, seed=option.seed))[0].sequences[0]
        assert result.response_tokens == alone.tokens
        assert result.response_logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_bad_values_are_refused_and_the_process_keeps_serving(chat: SamplerChat) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chat.sample_from_prompt([10**6], SamplingOptions(max_tokens=2))
    with pytest.raises(ValueError, match="the weights do not match the model: missing .*unexpected \\['no.such.weight'\\]"):
        chat.process.request({"kind": "load_weights"}, {"no.such.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unknown request kind"):
        chat.process.request({"kind": "train"})
    assert chat.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=2)).response_tokens


def test_loaded_weights_are_sampled_and_exported(chat: SamplerChat, engine: Engine, tmp_path: Path) -> None:
    option = SamplingOptions(max_tokens=6, seed=5)
    before = chat.sample_from_messages(MESSAGES, option)
    weights = {name: parameter.detach() * 1.05 for name, parameter in engine.model.named_parameters()}
    chat.process.request({"kind": "load_weights"}, weights)
    after = chat.sample_from_messages(MESSAGES, option)
    assert after.response_logprobs != before.response_logprobs, "a sample asked for after the load uses the new weights"
    exported = Engine(EngineConfig(model=str(chat.process.request({"kind": "export", "path": str(tmp_path / "hf")}).header["path"])))
    scaled = dict(exported.model.named_parameters())
    assert all(torch.equal(scaled[name], tensor) for name, tensor in weights.items())
    original = {name: parameter.detach() for name, parameter in engine.model.named_parameters()}
    chat.process.request({"kind": "load_weights"}, original)
    assert chat.sample_from_messages(MESSAGES, option).response_logprobs == before.response_logprobs


def test_a_killed_sampler_is_a_clear_error_within_seconds(tmp_path: Path) -> None:
    sampler = start(tmp_path / "sampler.log")
    try:
        os.kill(sampler.process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(SamplerError, match=r"sampler process \(pid \d+\) is dead") as error:
            sampler.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=4))
        assert time.monotonic() - started < 5
        assert "serving nexrl-tiny" in str(error.value), "the error carries the end of its log"
    finally:
        sampler.process.stop()


def test_a_model_it_cannot_load_fails_the_start_with_its_output(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    settings = SamplerSettings(engine=EngineConfig(model=str(tmp_path / "model")), batching=BatchedSamplingOptions())
    with pytest.raises(SamplerError, match="failed to start: it exited with status 1 while loading") as error:
        start(tmp_path / "sampler.log", settings)
    assert "Traceback" in str(error.value)


def test_it_exits_when_its_driver_dies(tmp_path: Path) -> None:
    driver = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from nexrl_fsdp.selfhosted.sampler_process import SamplerProcess
        from nexrl_fsdp.direct_zmq.group_key import new_group_key
        from nexrl_fsdp.selfhosted.sampler_server import SamplerSettings
        process = SamplerProcess(SamplerSettings.from_json({SETTINGS.to_json()!r}), Path({str(tmp_path / "sampler.log")!r}), key=new_group_key())
        process.wait_ready()
        print(process.pid, flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    if outlived:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind, even when failing
    assert not outlived, "the sampler outlived its driver"
