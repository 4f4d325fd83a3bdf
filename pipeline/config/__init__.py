"""The config layer: a YAML data config in, a validated `DataConfig` out, before any data is read.

`parse` checks every key and value with messages that name the file and key; `schedule` parses
the weight schedules (constants, `step`, `linear`) that stages mix with. Nothing here imports
JAX, Orbax or Grain.
"""

from pipeline.config.parse import (
    DataConfig,
    FeedOptions,
    SourceSpec,
    StageSpec,
    load_config,
    parse_config,
)

__all__ = ["DataConfig", "FeedOptions", "SourceSpec", "StageSpec", "load_config", "parse_config"]
