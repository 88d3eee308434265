"""The learning rate of each training step: ``algorithm.lr_schedule`` with ``algorithm.warmup_steps``.

Written once here; every trainer asks `LearningRateSchedule.rate` for the step it is about
to send and puts that rate in the step's `AdamWSettings`, so each backend's optimizer
gets it the way it gets ``algorithm.learning_rate`` (and a resumed run, which starts at
the next step number, gets the same rates as an uninterrupted one).
"""

from __future__ import annotations

import enum
import math

import attrs

__all__ = ["LRSchedule", "LearningRateSchedule", "scheduled_learning_rate"]


class LRSchedule(str, enum.Enum):
    """How the learning rate decays after warmup."""

    CONSTANT = "constant"
    """``algorithm.learning_rate`` on every step after warmup."""
    LINEAR = "linear"
    """Straight down to 0 at the last step (``schedule.steps``)."""
    COSINE = "cosine"
    """Half a cosine from ``learning_rate`` down to 0 at the last step."""


def scheduled_learning_rate(learning_rate: float, step: int, *, schedule: LRSchedule | str, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of ``step`` (1-based) of a run of ``total_steps``.

    ``learning_rate * warmup * decay``, where ``warmup`` is ``step / warmup_steps`` while
    ``step <= warmup_steps`` (a linear ramp; 1 after it, and always 1 when
    ``warmup_steps`` is 0), and ``decay`` depends on ``progress``, the share of the steps
    after warmup done by ``step``: ``(step - warmup_steps) / (total_steps - warmup_steps)``
    clipped to [0, 1] (0 when no step follows warmup). ``constant``: 1; ``linear``:
    ``1 - progress``, so the rate reaches 0 at ``step == total_steps``; ``cosine``:
    ``0.5 * (1 + cos(pi * progress))``.

    >>> scheduled_learning_rate(1.0, 1, schedule="linear", warmup_steps=2, total_steps=4)
    0.5
    >>> scheduled_learning_rate(1.0, 3, schedule="linear", warmup_steps=2, total_steps=4)
    0.5
    """
    schedule = LRSchedule(schedule)
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    warmup = step / warmup_steps if 0 < warmup_steps and step <= warmup_steps else 1.0
    after = total_steps - warmup_steps
    progress = min(max((step - warmup_steps) / after, 0.0), 1.0) if after > 0 else 0.0
    if schedule is LRSchedule.LINEAR:
        decay = 1.0 - progress
    elif schedule is LRSchedule.COSINE:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0
    return learning_rate * warmup * decay


@attrs.frozen(kw_only=True)
class LearningRateSchedule:
    """What a trainer needs of the recipe to give each step its rate: ``algorithm.lr_schedule``,
    ``algorithm.warmup_steps`` and ``schedule.steps``. The default changes no rate."""

    kind: LRSchedule = attrs.field(default=LRSchedule.CONSTANT, converter=LRSchedule)
    warmup_steps: int = 0
    total_steps: int = 1

    @classmethod
    def from_recipe(cls, config: object) -> LearningRateSchedule:
        """From a `TrainConfig` (``algorithm`` and ``schedule``)."""
        algorithm, schedule = getattr(config, "algorithm"), getattr(config, "schedule")  # noqa: B009 - ``config`` is typed object
        return cls(kind=algorithm.lr_schedule, warmup_steps=algorithm.warmup_steps, total_steps=schedule.steps)

    @property
    def is_constant(self) -> bool:
        return self.kind is LRSchedule.CONSTANT and self.warmup_steps == 0

    def rate(self, learning_rate: float, step: int) -> float:
        """`scheduled_learning_rate` of ``step`` (1-based)."""
        return scheduled_learning_rate(
            learning_rate, step, schedule=self.kind, warmup_steps=self.warmup_steps, total_steps=self.total_steps
        )
