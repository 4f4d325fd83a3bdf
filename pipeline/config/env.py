"""Settings read from `PIPELINE_*` environment variables, refused in one line when malformed."""

from __future__ import annotations

import math
import os

from pipeline.errors import ConfigError


def positive_number(variable: str, default: float, unit: str) -> float:
    """The number > 0 in the environment variable `variable` (in `unit`), else `default`."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"${variable}: expected a number of {unit} > 0, got {text!r}")
    return value
