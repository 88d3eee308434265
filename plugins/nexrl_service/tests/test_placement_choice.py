"""Which placer starts a service's worker groups: checked when the service starts, and a
cluster without room for a group is a 429, not a failed start."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_core.http.serving import ServeOptions, ServiceStartError
from nexrl_core.training.placement import PlacementRequest, PlacementUnavailable
from nexrl_core.training.worker_groups import GroupSettings, open_group_engines
from nexrl_engine.config import TrainingSpec
from nexrl_service.engines import BaseModelInfo, EnginePool, GroupLimits
from nexrl_service.errors import TooManyRequests
from nexrl_service.settings import ServerSettings
from nexrl_service.state import _group_limits


def test_a_placement_without_worker_groups_is_refused_naming_workers(tmp_path: Path) -> None:
    with pytest.raises(ServiceStartError, match="--placement places the ranks of worker groups; give --workers N"):
        ServerSettings.from_options(ServeOptions(data_dir=str(tmp_path), placement="local"), "test")


def test_a_placer_no_plugin_registers_stops_the_service_at_start_naming_what_is_installed(tmp_path: Path) -> None:
    settings = ServerSettings.from_options(ServeOptions(data_dir=str(tmp_path), workers=2, placement="slurm"), "test")
    with pytest.raises(ServiceStartError, match=r"--placement slurm: .*unknown placer 'slurm'; known: .*local \(from fsdp\)"):
        _group_limits(settings)


def test_a_bad_placer_option_stops_the_service_at_start_naming_it(tmp_path: Path) -> None:
    settings = ServerSettings.from_options(ServeOptions(data_dir=str(tmp_path), workers=2, placement_options={"racks": 2}), "test")
    with pytest.raises(ServiceStartError, match="--placement local: --placement-option racks"):
        _group_limits(settings)


class _FullCluster:
    """A placer whose cluster never has room: what the ray placer raises after its deadline."""

    def control_host(self) -> str:
        return "127.0.0.1"

    def place(self, request: PlacementRequest) -> None:
        raise PlacementUnavailable(f"no room for {request.ranks} ranks")

    def close(self) -> None:
        pass


def test_a_group_the_cluster_has_no_room_for_is_a_429_and_frees_its_place(tmp_path: Path) -> None:
    settings = GroupSettings(ranks=2, threads_per_rank=1, log_dir=tmp_path, placer=_FullCluster())
    pool = EnginePool(
        BaseModelInfo.load("nexrl-tiny"), 2, groups=GroupLimits(engines=open_group_engines(), settings=settings, max_groups=1)
    )
    for _ in range(2):  # the place is free again after each refusal
        with pytest.raises(TooManyRequests, match="no room for 2 ranks") as refused:
            pool.new_training_engine("m", TrainingSpec(base_model="nexrl-tiny"))
        assert refused.value.status_code == 429
    assert pool.group_starts.refusal() is None, "a full cluster is not a broken start"
