"""``coalesce_window_s`` of the Weaver holder: a group's concurrent requests reach the real
service as one multi-sample request, each run still gets exactly the sample it gets when
sent alone, and a window of 0 sends each request alone."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.testing import TEST_API_KEY

from nexrl_core.chat_model import SamplingOptions
from nexrl_core.config import ModelConfig
from nexrl_core.seeding import call_seed

GROUP = 6


def sample_group(holder: WeaverServiceHolder, messages: list[dict[str, str]]) -> tuple[list[Any], list[int]]:
    """The group's runs call at once, each with its own seed; returns their samples and
    the ``num_samples`` of every request the holder sent."""
    sent: list[int] = []
    send = holder._send_sample

    def counting_send(prompt: list[int], options: SamplingOptions, n: int) -> list[Any]:
        sent.append(n)
        return send(prompt, options, n)

    holder._coalescer._send = counting_send
    results: list[Any] = [None] * GROUP
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
    holders = [
        WeaverServiceHolder(
            WeaverHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=keyed_base_url, api_key=TEST_API_KEY, coalesce_window_s=window_s)
        )
        for window_s in (0.05, 0.0)
    ]  # fmt: skip
    try:
        (merged, merged_sent), (alone, alone_sent) = (sample_group(holder, messages) for holder in holders)
    finally:
        for holder in holders:
            holder.close()
    assert merged_sent == [GROUP] and alone_sent == [1] * GROUP
    for together, single in zip(merged, alone):
        assert (together.response_tokens, together.response_text, together.finish_reason) == (
            single.response_tokens, single.response_text, single.finish_reason,
        )  # fmt: skip
        assert together.response_logprobs == pytest.approx(single.response_logprobs, abs=1e-4)
    assert len({tuple(sample.response_tokens) for sample in merged}) > 1, "runs must sample differently"
