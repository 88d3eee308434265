"""A group's concurrent requests reach the real service as one multi-sample request, and
every run still gets exactly the sample it gets when sent alone."""

from __future__ import annotations

import threading

import pytest
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY

from nexrl_core.chat_model import SamplingOptions
from nexrl_core.seeding import call_seed

from nexrl_core.config import ModelConfig

TINY = ModelConfig(name="nexrl-tiny")

GROUP = 6


def make_holder(keyed_base_url: str, window_s: float) -> TinkerServiceHolder:
    return TinkerServiceHolder(
        TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY, coalesce_window_s=window_s)
    )


def sample_group(holder: TinkerServiceHolder, messages: list[dict[str, str]]) -> tuple[list[object], list[int]]:
    """The group's runs call at once, each with its own seed; returns their samples and
    the ``num_samples`` of every request the holder sent."""
    sent: list[int] = []
    send = holder._send_sample

    def counting_send(prompt: list[int], options: SamplingOptions, n: int) -> list[object]:
        sent.append(n)
        return send(prompt, options, n)

    holder._coalescer._send = counting_send
    results: list[object] = [None] * GROUP
    barrier = threading.Barrier(GROUP)

    def run(run_id: int) -> None:
        options = SamplingOptions(max_tokens=8, temperature=1.0, seed=call_seed(1234, 0, run_id))
        barrier.wait()
        results[run_id] = holder.sample_from_messages(messages, options)

    threads = [threading.Thread(target=run, args=(run_id,)) for run_id in range(GROUP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results, sent


def test_a_group_is_one_request_with_the_same_samples_as_alone(keyed_base_url: str) -> None:
    messages = [{"role": "user", "content": "What is 23 + 45?"}]
    merged_holder, alone_holder = make_holder(keyed_base_url, 0.05), make_holder(keyed_base_url, 0.0)
    try:
        merged, merged_sent = sample_group(merged_holder, messages)
        alone, alone_sent = sample_group(alone_holder, messages)
    finally:
        merged_holder.close()
        alone_holder.close()
    assert merged_sent == [GROUP] and alone_sent == [1] * GROUP
    for together, single in zip(merged, alone):
        assert together.response_tokens == single.response_tokens
        assert together.response_text == single.response_text
        assert together.finish_reason == single.finish_reason
        assert together.response_logprobs == pytest.approx(single.response_logprobs, abs=1e-4)
    assert len({tuple(sample.response_tokens) for sample in merged}) > 1, "runs must sample differently"
