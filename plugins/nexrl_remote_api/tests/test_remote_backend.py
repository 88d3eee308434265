"""The ``remote_api`` backend's own pieces, on a small in-test holder config."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from nexrl_core.config import ConfigError, load_config
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holders import HolderTarget
from nexrl_remote_api.remote_backend import RemoteApiBackendConfig, holder_config


@attrs.frozen(kw_only=True)
class CounterConfig(HolderTarget):
    refuse: tuple[str, ...] = ()


def test_the_holder_config_takes_model_and_seed_from_the_recipe(tmp_path: Path) -> None:
    recipe = load_config(None, ["model.name=m", "model.lora.rank=4", "seed=7"])
    setup = BackendSetup(recipe=recipe, options=RemoteApiBackendConfig(holder={"refuse": ["x"]}), work_dir=tmp_path)
    config = holder_config(CounterConfig, setup, "http://127.0.0.1:1", "key")
    assert (config.model.name, config.model.lora.rank, config.seed) == ("m", 4, 7)
    assert (config.base_url, config.api_key, config.refuse) == ("http://127.0.0.1:1", "key", ("x",))
    taken = BackendSetup(recipe=recipe, options=RemoteApiBackendConfig(holder={"model": {}}), work_dir=tmp_path)
    with pytest.raises(ConfigError, match="backend.options.holder.model: set by the recipe"):
        holder_config(CounterConfig, taken, None, None)
