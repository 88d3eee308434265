"""On a machine with GPUs, each model's worker group takes GPUs of its own, one per rank,
and a group that does not fit is refused with a 429 naming the GPUs (checked here with
the pool's GPU count set, so it runs on any machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_core.training.placement import LOCAL_PLACEMENT, open_placer
from nexrl_core.training.worker_groups import GroupSettings, open_group_engines
from nexrl_service.engines import BaseModelInfo, EnginePool, GroupLimits
from nexrl_service.errors import TooManyRequests


def _pool(tmp_path: Path, gpus: int, ranks: int = 2) -> EnginePool:
    settings = GroupSettings(ranks=ranks, threads_per_rank=1, log_dir=tmp_path, placer=open_placer(LOCAL_PLACEMENT, {}, "placement"))
    limits = GroupLimits(engines=open_group_engines(), settings=settings, max_groups=8, gpus=gpus)
    return EnginePool(BaseModelInfo.load("nexrl-tiny"), 2, groups=limits)


def test_each_group_takes_gpus_of_its_own_and_one_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    pool = _pool(tmp_path, gpus=5)
    pool.reserve_group("a")
    pool.reserve_group("b")
    assert (pool.gpus_of("a"), pool.gpus_of("b")) == ([0, 1], [2, 3])
    with pytest.raises(TooManyRequests, match="needs as many GPUs of its own, and 1 of this machine's 5 are free") as refused:
        pool.reserve_group("c")
    assert refused.value.status_code == 429
    pool.release_training("a")
    pool.reserve_group("c")
    assert pool.gpus_of("c") == [0, 1], "a released model's GPUs go to the next group"


def test_without_gpus_groups_take_none(tmp_path: Path) -> None:
    pool = _pool(tmp_path, gpus=0)
    for model in "abc":
        pool.reserve_group(model)
        assert pool.gpus_of(model) == []
