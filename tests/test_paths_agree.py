"""One step agrees on every local training path: the in-process engine split into one
micro-batch per datum, and NexRL's Tinker and Weaver services reached through the real
SDKs, for every registered loss under every aggregation mode. (The 2-rank worker group
is held to the same engine in ``nexrl_fsdp/tests/test_workers.py``.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nexrl_core.config import ModelConfig
from nexrl_core.testing.aggregation_cases import loss_aggregation_cases, with_entropy_bonus
from nexrl_core.testing.loss_option_contract import FROZEN, gradient_norm, probe_datums
from nexrl_core.training.holders import ServiceHolder, TrainStepConfig

pytestmark = pytest.mark.slow

TINY = ModelConfig(name="nexrl-tiny")
CASES = loss_aggregation_cases()


@pytest.fixture(scope="module")
def holders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceHolder]]:
    from nexrl_engine.inprocess.config import EngineHolderConfig, EngineOptions
    from nexrl_engine.inprocess.holder import EngineHolder
    from nexrl_tinker.holder import TinkerServiceHolder
    from nexrl_tinker.holder_config import TinkerHolderConfig
    from nexrl_tinker.testing import start_service as start_tinker
    from nexrl_weaver.holder import WeaverServiceHolder
    from nexrl_weaver.holder_config import WeaverHolderConfig
    from nexrl_weaver.testing import start_service as start_weaver

    tinker = start_tinker(tmp_path_factory.mktemp("tinker"))
    weaver = start_weaver(tmp_path_factory.mktemp("weaver"))
    built: dict[str, ServiceHolder] = {}
    try:
        built["inprocess, a micro-batch per datum"] = EngineHolder(
            EngineHolderConfig(model=TINY, engine=EngineOptions(max_tokens_per_microbatch=1)), tmp_path_factory.mktemp("engine")
        )
        built["tinker service"] = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=tinker.base_url, api_key="tml-local"))
        built["weaver service"] = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=weaver.base_url, api_key="sk-local"))
        yield built
    finally:
        for holder in built.values():
            holder.close()
        tinker.stop()
        weaver.stop()


def _loss(metrics: dict[str, float]) -> float:
    (value,) = [value for key, value in metrics.items() if key.rpartition("/")[2].partition(":")[0] == "loss"]
    return value


@pytest.mark.parametrize(("loss", "options"), CASES, ids=[f"{loss}-{o.get('agg_mode', 'none')}" for loss, o in CASES])
def test_one_step_is_the_same_on_every_path(holders: dict[str, ServiceHolder], loss: str, options: dict[str, Any]) -> None:
    step = TrainStepConfig(loss_fn=loss, loss_fn_config=with_entropy_bonus(loss, options), optimizer=FROZEN)
    first = next(iter(holders.values()))
    datums = probe_datums(first)
    results = {name: holder.train(datums, step) for name, holder in holders.items()}
    reference_name, reference = next(iter(results.items()))
    for name, metrics in results.items():
        assert gradient_norm(metrics) == pytest.approx(gradient_norm(reference), rel=1e-4), f"{name} vs {reference_name}"
        assert _loss(metrics) == pytest.approx(_loss(reference), rel=1e-4, abs=1e-6), f"{name} vs {reference_name}"
