"""One typed config tree, loaded from TOML and overridable from the command line.

Every field has a type and a default (`schema.py`). Loading checks keys and types strictly
(`loading.py`) and then runs the per-field and cross-field checks (`validation.py`), so a bad config
fails with one message that names the key and what is allowed, before any model, data or process
group is built.
"""

from depthscale.config.loading import (
    from_dict,
    load_config,
    parse_overrides,
    set_value,
    to_dict,
    to_toml,
)
from depthscale.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    DataStage,
    EvalConfig,
    EvalSet,
    EvalTask,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ResidualMode,
    ResilienceConfig,
    RopeScalingKind,
    TrainConfig,
)
from depthscale.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "DataStage",
    "EvalConfig",
    "EvalSet",
    "EvalTask",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ResilienceConfig",
    "ResidualMode",
    "RopeScalingKind",
    "TrainConfig",
    "from_dict",
    "load_config",
    "parse_overrides",
    "set_value",
    "to_dict",
    "to_toml",
]
