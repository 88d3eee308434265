"""``/v1/chat/completions`` and ``/v1/completions`` for claimed episodes, on the backend's `ChatModel`.

Each episode has its own base URL (``/episodes/<id>/v1``) and a call is answered only
when the key claims that episode, and its samples (prompt and
response token ids, sampler logprobs) are recorded into that episode before the answer
leaves, so the client never sends tokens back: the run's trajectory is built from
exactly what the model sampled, multi-turn conversations merged as in the thread
runner (`nexrl_core.run.rollout.build_trajectories`).

Sampling follows the thread runner too: arguments left out take the run's
``rollout`` values (validation episodes carry the validation temperature), and call
``i`` of an episode is seeded ``call_seed(run seed, i, run id, user seed)``. Arguments
the model cannot honour are refused with a 400 naming them, never ignored. Every call's
prompt, rendered here with the model's chat template (or given as token ids), is
planned by the episode book within the recipe's ``rollout.max_prompt_tokens`` and
``rollout.max_response_tokens`` (`EpisodeBook.plan_call`), as the thread runner plans
its calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import attrs
from fastapi import FastAPI, Request

from nexrl_core.chat.model import ChatModel, SamplingOptions
from nexrl_core.run.completions import completion_from_sample
from nexrl_core.run.limits import spent_turn
from nexrl_core.run.seeding import call_seed
from nexrl_core.types import SampleResult
from nexrl_episodes.book import EpisodeBook, EpisodeError, LiveEpisode

CHAT_ARGUMENTS = frozenset(
    {
        "messages",
        "model",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "n",
        "seed",
        "stream",
        "logprobs",
        "top_logprobs",
        "user",
    }
)
COMPLETION_ARGUMENTS = frozenset(
    {"prompt", "model", "max_tokens", "temperature", "top_p", "stop", "n", "seed", "stream", "logprobs", "echo", "user"}
)
MAX_N = 16


def _check_arguments(body: dict[str, Any], allowed: frozenset[str], route: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise EpisodeError(400, f"{route} does not support {', '.join(unknown)}; supported: {', '.join(sorted(allowed))}")
    if body.get("stream"):
        raise EpisodeError(400, "stream=true is not supported: leave stream unset (responses come whole)")


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise EpisodeError(400, f"{name} must be a number, got {value!r}")
    number = float(value)  # JSON's int or float; `numbers.Real` declares no ``>``
    if number < low or number > high or (low_open and number == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise EpisodeError(400, f"{name} must be in {bound}, got {value!r}")
    return number


def _model_name(body: dict[str, Any], served: str) -> str:
    """The ``model`` a request names, echoed in its answer; the name ``served`` when it names none."""
    requested = body.get("model")
    return requested if isinstance(requested, str) else served


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise EpisodeError(400, f"{name} must be an integer {bounds}, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop) and 0 < len(stop) <= 4:
        return list(stop)
    raise EpisodeError(400, f"stop must be a string or a list of 1 to 4 strings, got {stop!r}")


def _objects(body: dict[str, Any], name: str, required: bool) -> list[dict[str, Any]] | None:
    value = body.get(name)
    if value is None:
        if required:
            raise EpisodeError(400, f"{name} (a list of objects) is required")
        return None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise EpisodeError(400, f"{name} must be a list of objects, got {type(value).__name__}")
    if required and not value:
        raise EpisodeError(400, f"{name} must not be empty")
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = _objects(body, "messages", required=True)
    assert messages is not None
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise EpisodeError(400, f"messages[{index}].role must be system, user, assistant or tool, got {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                message = {**message, "content": "".join(str(part.get("text", "")) for part in content)}
                messages[index] = message
            else:
                raise EpisodeError(400, f"messages[{index}].content must be a string or a list of text parts")
    return messages


def _token_logprobs(sample: SampleResult) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries; tokens are named ``token_id:<id>`` (as vLLM does)
    because the exact ids, not their text, are what training uses."""
    return [
        {"token": f"token_id:{token}", "logprob": float(logprob), "bytes": None, "top_logprobs": []}
        for token, logprob in zip(sample.response_tokens, sample.response_logprobs)
    ]


def _usage(samples: Sequence[SampleResult]) -> dict[str, int]:
    prompt = len(samples[0].prompt_tokens)
    completion = sum(len(sample.response_tokens) for sample in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIEndpoints:
    """The OpenAI routes of one episode server, sampling on ``model`` from ``executor`` threads."""

    def __init__(self, book: EpisodeBook, model: ChatModel, executor: concurrent.futures.Executor) -> None:
        self.book = book
        self.model = model
        self.executor = executor

    def add_routes(self, app: FastAPI) -> None:
        from nexrl_core.http.openapi import OBJECT, json_body
        from nexrl_episodes.app import bearer, json_object

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.book.model, "object": "model", "owned_by": "nexrl"}]}

        chat_body = json_body(
            {
                "messages": {"type": "array", "items": OBJECT},
                "max_tokens": {"type": "integer"},
                "n": {"type": "integer"},
                "temperature": {"type": "number"},
                "top_p": {"type": "number"},
                "tools": {"type": "array"},
            },
            required=("messages",),
        )
        completion_body = json_body(
            {
                "prompt": {"type": "string"},
                "max_tokens": {"type": "integer"},
                "n": {"type": "integer"},
                "temperature": {"type": "number"},
                "top_p": {"type": "number"},
            },
            required=("prompt",),
        )

        @app.post("/episodes/{episode_id}/v1/chat/completions", openapi_extra=chat_body)
        async def chat_completions(episode_id: str, request: Request) -> dict[str, Any]:
            episode, attempt, first = self.book.start_call(bearer(request), episode_id)
            try:
                return await self.chat(episode, attempt, first, await json_object(request))
            finally:
                self.book.end_call(episode)

        @app.post("/episodes/{episode_id}/v1/completions", openapi_extra=completion_body)
        async def completions(episode_id: str, request: Request) -> dict[str, Any]:
            episode, attempt, first = self.book.start_call(bearer(request), episode_id)
            try:
                return await self.complete(episode, attempt, first, await json_object(request))
            finally:
                self.book.end_call(episode)

    def _options(self, episode: LiveEpisode, body: dict[str, Any]) -> tuple[SamplingOptions, int, int | None]:
        defaults = episode.sampling
        max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1) or defaults.max_tokens
        options = SamplingOptions(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
            top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
            stop=_stop(body),
        )
        n = _integer(body, "n", 1, MAX_N) or 1
        seed = _integer(body, "seed", -(2**63))
        return options, n, seed

    async def _sample(
        self,
        episode: LiveEpisode,
        attempt: int,
        first: int,
        n: int,
        seed: int | None,
        options: SamplingOptions,
        prompt: list[int],
    ) -> list[SampleResult]:
        """``n`` samples of ``prompt`` with the episode's call seeds, within the run's
        limits, recorded into the episode (a turn whose trajectory has no response
        tokens left is answered empty, with finish reason ``length``, and not recorded)."""
        plan = self.book.plan_call(episode, attempt, prompt, options, first)
        if plan.spent:
            return [spent_turn(plan.prompt)] * n
        indices = [first]
        if n > 1:
            start = self.book.reserve_calls(episode, attempt, n - 1)
            indices += list(range(start, start + n - 1))
        request = episode.request
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(
                self.executor,
                self.model.sample_from_prompt,
                plan.prompt,
                attrs.evolve(plan.options, seed=call_seed(request.seed, index, request.run_id, seed)),
            )
            for index in indices
        ]
        try:
            samples = list(await asyncio.gather(*jobs))
        except (ValueError, TypeError) as error:
            raise EpisodeError(400, f"the model refused the request: {error}") from None
        except Exception as error:  # noqa: BLE001 - the backend failed, not the request
            raise EpisodeError(502, f"the policy's model failed: {type(error).__name__}: {error}") from None
        self.book.record_calls(episode, attempt, samples)
        return samples

    async def chat(self, episode: LiveEpisode, attempt: int, first: int, body: dict[str, Any]) -> dict[str, Any]:
        _check_arguments(body, CHAT_ARGUMENTS, "/v1/chat/completions")
        messages = _messages(body)
        tools = _objects(body, "tools", required=False)
        if body.get("tool_choice") not in (None, "auto"):
            raise EpisodeError(400, f"tool_choice={body['tool_choice']!r} is not supported; leave it unset or 'auto'")
        want_logprobs = bool(body.get("logprobs"))
        if _integer(body, "top_logprobs", 0, 0):
            raise EpisodeError(400, "top_logprobs is not supported (only 0): the sampler returns the chosen token's logprob")
        options, n, seed = self._options(episode, body)
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: self.model.apply_chat_template(messages, tools or None, True, True)
            )
        except (ValueError, TypeError) as error:
            raise EpisodeError(400, f"the model refused the request: {error}") from None
        except Exception as error:  # noqa: BLE001 - the backend failed, not the request
            raise EpisodeError(502, f"the policy's model failed: {type(error).__name__}: {error}") from None
        if isinstance(prompt, str):
            raise EpisodeError(502, "the policy's model rendered text, not token ids (apply_chat_template(tokenize=True))")
        samples = await self._sample(episode, attempt, first, n, seed, options, list(prompt))
        model_name = _model_name(body, self.book.model)
        choices = []
        for index, sample in enumerate(samples):
            choice = completion_from_sample(sample, completion_id="", model=model_name).choices[0]
            choices.append(
                {
                    "index": index,
                    "message": choice.message.to_dict(),
                    "finish_reason": choice.finish_reason,
                    "logprobs": {"content": _token_logprobs(sample)} if want_logprobs else None,
                }
            )
        return {
            "id": f"chatcmpl-{episode.episode_id[:12]}-{first}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(samples),
        }

    def _prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._prompt_tokens(prompt[0])
        if isinstance(prompt, str) and prompt:
            tokenizer = getattr(self.model, "tokenizer", None)
            tokenizer = tokenizer() if callable(tokenizer) and not hasattr(tokenizer, "encode") else tokenizer
            if tokenizer is None or not hasattr(tokenizer, "encode"):
                raise EpisodeError(400, "this backend's model cannot tokenise raw text: send prompt as a list of token ids")
            return list(tokenizer.encode(prompt, add_special_tokens=False))
        raise EpisodeError(400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt per call)")

    async def complete(self, episode: LiveEpisode, attempt: int, first: int, body: dict[str, Any]) -> dict[str, Any]:
        _check_arguments(body, COMPLETION_ARGUMENTS, "/v1/completions")
        if body.get("echo"):
            raise EpisodeError(400, "echo=true is not supported: leave echo unset")
        want_logprobs = _integer(body, "logprobs", 0, 1)
        prompt = self._prompt_tokens(body.get("prompt"))
        options, n, seed = self._options(episode, body)
        samples = await self._sample(episode, attempt, first, n, seed, options, prompt)
        model_name = _model_name(body, self.book.model)
        choices = [
            {
                "index": index,
                "text": sample.response_text,
                "finish_reason": sample.finish_reason,
                "logprobs": (
                    {
                        "tokens": [f"token_id:{token}" for token in sample.response_tokens],
                        "token_logprobs": [float(value) for value in sample.response_logprobs],
                        "top_logprobs": None,
                        "text_offset": None,
                    }
                    if want_logprobs is not None
                    else None
                ),
            }
            for index, sample in enumerate(samples)
        ]
        return {
            "id": f"cmpl-{episode.episode_id[:12]}-{first}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(samples),
        }
