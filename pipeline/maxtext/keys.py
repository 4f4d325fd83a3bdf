"""The MaxText config keys of the adapter, each with an environment-variable form.

One table serves both sides: the adapter (`pipeline.maxtext.adapter`) reads a key from MaxText's
config, else from its variable, and `pipeline maxtext install` declares the keys in MaxText's
`configs/types.py` and `base.yml` with these types and defaults. The variables work without
that install step, on every MaxText version: set them on every host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_bool(raw: str, where: str) -> bool:
    """`true`/`false` as a shell or MaxText's command line spells them (also 1/0, yes/no)."""
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{where}={raw!r}: expected true or false")


@dataclass(frozen=True)
class MaxTextKey:
    name: str  # the MaxText config key
    env: str  # its environment-variable form
    type: type  # str, bool or int: the types.py annotation
    default: str | bool | int
    help: str

    def parse_env(self) -> str | bool | int:
        """The variable's value (the default when unset); a bad boolean or count is a
        ConfigError."""
        raw = os.environ.get(self.env, "")
        if self.type is str:
            return raw or self.default
        if self.type is int:
            return parse_count(raw, f"environment variable {self.env}") if raw else self.default
        return parse_bool(raw, f"environment variable {self.env}")


def parse_count(raw: object, where: str) -> int:
    """An integer >= 0, from MaxText's config (an int) or a variable (its digits)."""
    text = str(raw).strip()
    if isinstance(raw, bool) or not text.isdigit():
        raise ConfigError(f"{where}={raw!r}: expected an integer >= 0")
    return int(text)


DATA_CONFIG = MaxTextKey(
    "pipeline_data_config",
    "PIPELINE_DATA_CONFIG",
    str,
    "",
    "Path of the pipeline's data config YAML; when set, the pipeline serves the batches.",
)
DATA_SWITCH = MaxTextKey(
    "pipeline_data_switch",
    "PIPELINE_DATA_SWITCH",
    bool,
    False,
    "Declare a data config change on restore (a ledger switch at the restored step).",
)
DATA_SKIP = MaxTextKey(
    "pipeline_data_skip",
    "PIPELINE_DATA_SKIP",
    int,
    0,
    "Steps of data to pass over on restore: the restored step s serves the plan's step s + N.",
)
DATA_SKIP_AT = MaxTextKey(
    "pipeline_data_skip_at",
    "PIPELINE_DATA_SKIP_AT",
    int,
    0,
    "With pipeline_data_skip=N: skip at training step S (> 0), once in the run, however often "
    "the command is repeated; 0: at the restored step.",
)
EVAL_SOURCE = MaxTextKey(
    "pipeline_eval_source",
    "PIPELINE_EVAL_SOURCE",
    str,
    "",
    "Eval source of the data config to serve (default: the first by name).",
)
KEYS = (DATA_CONFIG, DATA_SWITCH, DATA_SKIP, DATA_SKIP_AT, EVAL_SOURCE)
