"""The typed configuration: one frozen dataclass per section, with its defaults, constraints and a doc per
field (rloo/settings/fields.py), the one source of the JSON schema the config files are validated against.
A notebook builds one directly (`RlooConfig(k=8)`, `Config(rloo=RlooConfig(k=8))`); the pipeline builds
one from a validated dict (`Config.from_config(cfg)`)."""

from rloo.settings.config import Config
from rloo.settings.data import DataConfig, DataFieldsConfig, PromptConfig, SyntheticConfig
from rloo.settings.evaluation import EvaluateConfig, LlmJudgeConfig, ServeConfig
from rloo.settings.fields import Section, json_schema, section_types
from rloo.settings.model import LoraConfig, ModelConfig, ModelShape, TinyConfig
from rloo.settings.tools import ToolConfig, ToolsConfig
from rloo.settings.training import (
    AlarmConfig,
    PpoConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardHttpConfig,
    RlooConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SftConfig,
)
from rloo.settings.workflow import (
    ComparisonConfig,
    DistributedConfig,
    PathsConfig,
    PlanConfig,
    SeedsConfig,
    TrackingConfig,
)

__all__ = [
    "AlarmConfig", "ComparisonConfig", "Config", "DataConfig", "DataFieldsConfig", "DistributedConfig",
    "EvaluateConfig", "LlmJudgeConfig", "LoraConfig", "ModelConfig", "ModelShape", "PathsConfig", "PlanConfig",
    "PpoConfig", "PromptConfig", "RewardConfig", "RewardFunctionConfig", "RewardHttpConfig", "RlooConfig",
    "RolloutConfig", "RolloutCorrectionConfig", "Section", "SeedsConfig", "ServeConfig", "SftConfig",
    "SyntheticConfig", "TinyConfig", "ToolConfig", "ToolsConfig", "TrackingConfig", "json_schema", "section_types",
]
