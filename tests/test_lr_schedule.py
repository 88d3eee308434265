"""`nexrl_core.config.lr_schedule`: the rate of each step against an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nexrl_core.config import ConfigError, load_config
from nexrl_core.config.lr_schedule import LearningRateSchedule, scheduled_learning_rate


def independent(schedule: str, warmup: int, total: int, base: float) -> list[float]:
    """The rates of steps 1..total, built as whole arrays: a ramp, then the decay curve
    sampled at the steps after warmup (``linspace`` from 0 to 1 over them)."""
    ramp = np.arange(1, warmup + 1) / warmup if warmup else np.array([])
    after = total - warmup
    progress = np.linspace(0.0, 1.0, after + 1)[1:] if after > 0 else np.array([])
    decay = {"constant": np.ones_like(progress), "linear": 1.0 - progress, "cosine": (1.0 + np.cos(np.pi * progress)) / 2}[schedule]
    return list(base * np.concatenate([ramp, decay]))[:total]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (1, 2), (5, 5), (0, 1)])
def test_the_rate_of_every_step_matches_an_independent_computation(schedule: str, warmup: int, total: int) -> None:
    got = [scheduled_learning_rate(3e-4, step, schedule=schedule, warmup_steps=warmup, total_steps=total) for step in range(1, total + 1)]
    assert got == pytest.approx(independent(schedule, warmup, total, 3e-4), abs=1e-15)


def test_landmarks() -> None:
    """Warmup ramps from 1/w; linear and cosine end at 0 on the last step; cosine is at
    half the rate halfway through the steps after warmup."""
    rate = lambda step, kind, warmup=4, total=12: scheduled_learning_rate(1.0, step, schedule=kind, warmup_steps=warmup, total_steps=total)  # noqa: E731
    assert [rate(s, "cosine") for s in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert rate(12, "linear") == 0.0 and rate(12, "cosine") == pytest.approx(0.0, abs=1e-16)
    assert rate(8, "cosine") == pytest.approx(0.5) and rate(8, "linear") == pytest.approx(0.5)
    assert all(rate(s, "constant", warmup=0) == 1.0 for s in range(1, 13))
    assert math.isclose(rate(5, "cosine"), 0.5 * (1 + math.cos(math.pi / 8)))


def test_the_recipe_keys_make_the_schedule_and_bad_values_are_refused_by_name(tmp_path) -> None:
    config = load_config(None, ["schedule.steps=7", "algorithm.lr_schedule=linear", "algorithm.warmup_steps=2"])
    assert LearningRateSchedule.from_recipe(config) == LearningRateSchedule(kind="linear", warmup_steps=2, total_steps=7)
    for override, key in (
        ("algorithm.lr_schedule=exponential", "algorithm.lr_schedule"),
        ("algorithm.warmup_steps=-1", "algorithm.warmup_steps"),
    ):
        with pytest.raises(ConfigError) as caught:
            load_config(None, [override])
        assert key in str(caught.value)
