"""Helpers for tests that run a real TinkerCloud (ours, and other distributions' e2e tests).

Nothing here mocks anything: `start_service` starts the real server on 127.0.0.1 and
`wait_healthy` polls its real health route.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["BASE_MODEL", "TEST_API_KEY", "free_port", "sft_data", "start_service", "wait_healthy"]

BASE_MODEL = "nexrl-tiny"
TEST_API_KEY = "tml-test"


def start_service(data_dir: str | Path, **options: Any) -> Any:
    """A started `TinkerService` on a free port (stop it with ``.stop()``); ``options`` are
    those of `nexrl_service.testing.start_local_service` (``api_key``, ``workers``, ...)."""
    from nexrl_service.testing import start_local_service
    from nexrl_tinker.server.service import TinkerService

    return start_local_service(TinkerService, data_dir, **options)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base_url: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll ``GET /api/v1/healthz`` until it answers; returns its JSON."""
    import httpx

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base_url}/api/v1/healthz", timeout=2.0)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become healthy within {timeout} s (last error: {last})")


def sft_data(tokenizer: Any) -> list[Any]:
    """Three chat-formatted additions as SFT `tinker.types.Datum` s: the answer's tokens
    weigh 1, the prompt's 0."""
    from tinker import types

    data = []
    for question, answer in (("12+34=", "46"), ("7+8=", "15"), ("40+2=", "42")):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        tokens = prompt + tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},  # type: ignore[dict-item]  # Tinker's Datum converts lists (__post_init__); its type says TensorData
            )
        )
    return data
