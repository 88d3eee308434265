"""Recipes for ``nexrl train``: attrs classes, YAML files and ``key.path=value`` overrides.

A bad recipe fails fast with one `ConfigError` that lists every problem with its full
key path, before any model, GPU or network is touched.
"""

from nexrl_core.config.checks import Check, CheckFailed
from nexrl_core.config.components import component_choices, resolve_all_options, resolve_options
from nexrl_core.config.converter import describe_problems, dump_config, structure_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.load import load_config, read_recipe
from nexrl_core.config.overrides import apply_overrides
from nexrl_core.config.schema import (
    REGISTRY_KIND,
    AlgorithmConfig,
    ComponentChoice,
    DatasetSpec,
    DType,
    KLController,
    KLPenalty,
    KLSettings,
    ModelConfig,
    OutputConfig,
    PromptOverflow,
    RolloutConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "REGISTRY_KIND",
    "AlgorithmConfig",
    "Check",
    "CheckFailed",
    "ComponentChoice",
    "ConfigError",
    "DatasetSpec",
    "DType",
    "KLController",
    "KLPenalty",
    "KLSettings",
    "ModelConfig",
    "OutputConfig",
    "PromptOverflow",
    "RolloutConfig",
    "ScheduleConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "component_choices",
    "describe_problems",
    "dump_config",
    "load_config",
    "read_recipe",
    "resolve_all_options",
    "resolve_options",
    "structure_config",
]
