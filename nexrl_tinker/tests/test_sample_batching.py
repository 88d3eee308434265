"""Concurrent seeded ``asample`` requests share engine calls without changing any result.

The RL loops send one single-prompt request per agent run, each with its own seed. The
service batches pending requests whose sampling parameters differ only in the seed; a
request's tokens must be those it gets when sent alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from nexrl_fsdp.engine import Engine
from nexrl_tinker.testing import BASE_MODEL
from tinker import types


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Prompts per `Engine.sample` call; the first call is held back 0.5 s so that the
    requests sent meanwhile are pending together when the lane frees up."""
    calls: list[int] = []
    lock = threading.Lock()
    original = Engine.sample

    def spy(self, prompts, *args, **kwargs):
        with lock:
            first = not calls
            calls.append(len(prompts))
        if first:
            time.sleep(0.5)
        return original(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Engine, "sample", spy)
    return calls


def _requests() -> list[tuple[list[int], types.SamplingParams, int]]:
    """(prompt, params, num_samples): varied prompt lengths and seeds, a request for two
    samples (counts may differ within a batch), and one that must not join the batch
    (another temperature)."""
    out = []
    for index in range(12):
        prompt = [1] + [30 + (7 * index + k) % 200 for k in range(3 + index % 5)]
        out.append((prompt, types.SamplingParams(max_tokens=10, temperature=1.0, seed=100 + index), 1))
    out.append(([1, 40, 41, 42], types.SamplingParams(max_tokens=10, temperature=0.7, seed=5), 1))
    out.append(([1, 50, 51], types.SamplingParams(max_tokens=10, temperature=1.0, seed=6), 2))
    out.append(([1, 60], types.SamplingParams(max_tokens=10, temperature=1.0, seed=7), 1))
    return out


def _sequences(response: types.SampleResponse) -> list[tuple[list[int], list[float], str]]:
    return [(list(s.tokens), list(s.logprobs or []), str(s.stop_reason)) for s in response.sequences]


def test_concurrent_seeded_requests_are_batched_and_sample_as_if_alone(service_client, engine_calls: list[int]) -> None:
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=120)
    requests = _requests()

    alone = []
    for prompt, params, n in requests:
        alone.append(_sequences(sampler.sample(types.ModelInput.from_ints(prompt), n, params).result(timeout=120)))
    assert engine_calls == [1] * len(requests)

    engine_calls.clear()
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), n, params) for prompt, params, n in requests]
    together = [_sequences(future.result(timeout=120)) for future in futures]
    assert max(engine_calls) > 1, f"nothing was batched: {engine_calls}"
    assert sum(engine_calls) == len(requests)

    for got, expected in zip(together, alone):
        assert [(tokens, reason) for tokens, _, reason in got] == [(tokens, reason) for tokens, _, reason in expected]
        for (_, a, _), (_, b, _) in zip(got, expected):
            assert a == pytest.approx(b, abs=1e-4)
    assert len({tuple(seqs[0][0]) for seqs in together}) > len(together) // 2, "seeds must give different samples"


def test_a_batch_records_every_outcome(tmp_path: Path) -> None:
    """The outcomes of a batch are written in one transaction, failures included."""
    from nexrl_tinker.server.futures import FutureBook, Outcome
    from nexrl_tinker.server.store import Store

    book = FutureBook(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    rows = [book.create("owner", "weights:base", None, "Sample")[0] for _ in range(3)]
    outcomes = [Outcome("done", "application/x-protobuf", b"\x01\x02"), Outcome.failed("bad prompt", "user"), Outcome.json({"a": 1})]
    book.persist_many([(row.request_id, outcome) for row, outcome in zip(rows, outcomes)])
    stored = [book.store.get_future(row.request_id) for row in rows]
    assert [(r.status, r.content_type, r.result, r.error, r.category) for r in stored] == [
        ("done", "application/x-protobuf", b"\x01\x02", None, None),
        ("failed", None, None, "bad prompt", "user"),
        ("done", "application/json", b'{"a": 1}', None, None),
    ]
    assert all(r.finished_at is not None for r in stored)
    fresh = FutureBook(book.store)  # another process: outcomes come from the table
    assert [fresh.peek(row.request_id) for row in rows] == outcomes


@pytest.mark.parametrize(("linger", "expected"), [(0.05, [3]), (0.0, [1, 1, 1])])
def test_a_bursty_lane_lingers_for_the_rest_of_a_burst(tmp_path: Path, linger: float, expected: list[int]) -> None:
    """Once sampling has batched, the requests of a later burst that arrive a few ms apart
    run as one batch with a linger, also on a new lane (new weights); without a linger
    each runs as it arrives."""
    from nexrl_tinker.server.futures import FutureBook, Outcome
    from nexrl_tinker.server.scheduler import Job, Scheduler
    from nexrl_tinker.server.store import Store

    book = FutureBook(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    scheduler = Scheduler(book, threads=1, gap_timeout_s=60, linger_s=linger, linger_max_s=1.0)
    batches: list[int] = []
    release = threading.Event()
    lock = threading.Lock()

    def run_batch(jobs) -> list[Outcome]:
        release.wait(10)
        with lock:
            batches.append(len(jobs))
        return [Outcome.json({}) for _ in jobs]

    def submit(lane: str) -> None:
        row, _ = book.create("owner", lane, None, "Sample")
        job = Job(row.request_id, lambda: run_batch([None])[0], batch_key="k", run_batch=run_batch)
        scheduler.submit_fifo(lane, job)

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while sum(batches) < count and time.monotonic() < deadline:
            time.sleep(0.005)

    try:
        for _ in range(3):  # the first runs alone and holds the lane; two queue behind it
            submit("weights:a")
        release.set()
        wait_for(3)
        assert batches == [1, 2]
        batches.clear()
        for _ in range(3):  # a later burst for new weights, 10 ms apart
            submit("weights:b")
            time.sleep(0.01)
        wait_for(3)
    finally:
        scheduler.close()
    assert batches == expected
