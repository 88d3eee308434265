"""WeaverServiceHolder settings that need no server: retries and their backoff, the
operation timeout, a local tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from nexrl_core.config import ModelConfig
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig

TINY = ModelConfig(name="nexrl-tiny")
NOWHERE = "http://127.0.0.1:9"
"""No service listens there: anything that would contact one fails."""


def test_transient_errors_are_retried_with_backoff_then_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=NOWHERE, max_retries=2, retry_backoff_s=0.25))
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("refused")
        return "ok"

    assert holder._retry("sample", flaky) == "ok"
    assert (len(calls), slept) == (3, [0.25, 0.5])

    def broken() -> str:
        raise httpx.ConnectError("refused")

    with pytest.raises(RuntimeError, match="failed to train after 3 attempts: ConnectError"):
        holder._retry("train", broken)


class _NeverDone:
    """An operation handle whose operation never finishes."""

    operation_id = "op-1"

    def done(self) -> bool:
        return False

    def refresh(self) -> None:
        return None


def test_an_operation_is_given_up_after_operation_timeout_s() -> None:
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=NOWHERE, operation_timeout_s=0.2, max_retries=0))
    with pytest.raises(TimeoutError, match=r"operation op-1 did not finish within 0.2 s"):
        holder._wait("train", lambda: _NeverDone())


def test_tokenizer_path_is_read_without_the_service() -> None:
    from nexrl_engine.loading import resolve_model_dir

    config = WeaverHolderConfig(model=TINY, base_url=NOWHERE, tokenizer_path=str(resolve_model_dir("nexrl-tiny")))
    prompt: Any = WeaverServiceHolder(config).apply_chat_template([{"role": "user", "content": "1+2="}])
    assert prompt == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
