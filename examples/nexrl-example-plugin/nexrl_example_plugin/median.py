"""The estimator itself; imported only when a run chooses ``example.median``."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from nexrl_core.training.algorithms import AdvantageInputs, AdvantageOutput, check_inputs_present
from nexrl_example_plugin.plugin import MedianBaselineConfig


class MedianBaseline:
    """Advantage = (score - median score of the group) * scale, on every trained token.

    A group of one gets 0: its median is its own score. Rows that are padding
    (``valid_rows`` False) are left out of every median and get 0.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"group_ids"})
    group_relative: ClassVar[bool] = True

    def __init__(self, config: MedianBaselineConfig) -> None:
        self.config = config

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        check_inputs_present("advantage estimator", "example.median", self.requires, inputs)
        scores = (inputs.token_rewards * inputs.loss_mask).sum(dim=1)
        valid = inputs.valid_rows
        bad = [row for row in range(len(scores)) if valid[row] and not math.isfinite(scores[row].item())]
        if bad:
            raise ValueError(f"example.median: rewards of rows {bad} are not finite")
        assert inputs.group_ids is not None
        per_row = torch.zeros_like(scores)
        for group in {key for key, ok in zip(inputs.group_ids, valid.tolist()) if ok}:
            members = [row for row, key in enumerate(inputs.group_ids) if key == group and valid[row]]
            group_scores = scores[members]
            median = group_scores.sort().values[(len(members) - 1) // 2 : len(members) // 2 + 1].mean()
            per_row[members] = (group_scores - median) * self.config.scale
        advantages = per_row[:, None] * inputs.loss_mask
        return AdvantageOutput(advantages=advantages, returns=advantages, metrics={"advantages/mean": per_row[valid].mean().item()})
