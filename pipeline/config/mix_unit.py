"""`mix_unit:` what a stage's weights share out: its rows (`rows`, the default) or its target
tokens (`tokens`, pipeline/plan/token_mix.py: for mixtures with `best_fit` sources, whose rows
carry fewer tokens than windows do). Given at the top (every mixing stage) or per stage."""

from __future__ import annotations

from typing import Any

from pipeline.config.schedule import WeightSchedule
from pipeline.errors import ConfigError

MIX_UNITS = ("rows", "tokens")


def parse_mix_unit(
    raw: Any, mix: tuple[tuple[str, WeightSchedule], ...] | None, origin: str, key: str
) -> str:
    """The unit at `key` (its value `raw`) of a stage mixing `mix` (None: an epochized
    stage, which takes none); tokens need constant weights."""
    if raw not in MIX_UNITS:
        raise ConfigError(f"{origin}: {key}: expected 'rows' or 'tokens', got {raw!r}")
    if raw == "tokens":
        if mix is None:
            raise ConfigError(
                f"{origin}: {key}: an epochized stage draws its epochs, not shares; give "
                "mix_unit to stages with a mix"
            )
        varying = [name for name, schedule in mix if schedule.kind != "constant"]
        if varying:
            raise ConfigError(
                f"{origin}: {key}: mix_unit: tokens needs constant weights; {varying[0]} has a "
                "schedule"
            )
    return raw
