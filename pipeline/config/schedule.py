"""Weight schedules: a source's relative weight as a function of the optimizer step in a stage.

    3                           constant
    {step: {0: 1, 1000: 0}}     piecewise constant: the value of the last point at or before t
    {linear: {0: 100, 100: 10}} piecewise linear between points, constant after the last one
                                (and before the first)

Every schedule is constant from its `horizon` (one past its last point) on. The mixture sees a
schedule as constant pieces (`pieces`): a `step` schedule is one piece per point; a `linear`
ramp of n steps is one piece per step when n <= RAMP_PIECES, else RAMP_PIECES pieces of equal
length, each holding the ramp's value at its first step. So a schedule costs O(points) memory
and time whatever its steps (a point at step 10^12 included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import ConfigError

KINDS = ("step", "linear")
RAMP_PIECES = 4096
"""A linear ramp longer than this many steps changes its weight this many times, evenly."""


@dataclass(frozen=True)
class WeightSchedule:
    kind: str  # "constant", "step" or "linear"
    points: tuple[tuple[int, float], ...]

    @property
    def horizon(self) -> int:
        """First step from which the weight never changes."""
        return 0 if self.kind == "constant" else self.points[-1][0] + 1

    def at(self, steps: np.ndarray) -> np.ndarray:
        steps = np.asarray(steps)
        if self.kind == "constant":  # a mixture of hundreds of sources asks each: no search
            return np.full(steps.shape, self.points[0][1], dtype=np.float64)
        xs = np.array([p[0] for p in self.points], dtype=np.float64)
        ys = np.array([p[1] for p in self.points], dtype=np.float64)
        if self.kind == "linear":
            return np.interp(steps, xs, ys)
        index = np.searchsorted(xs, steps, side="right") - 1
        return ys[np.maximum(index, 0)]

    def piece_starts(self) -> np.ndarray:
        """The steps at which the weight the mixture uses may change (always includes 0)."""
        if self.kind == "constant":
            return np.zeros(1, dtype=np.int64)
        steps = [0, *(step for step, _ in self.points)]
        if self.kind == "linear":
            for (a, _), (b, _) in zip(self.points, self.points[1:]):
                count = min(b - a, RAMP_PIECES)
                steps.extend(a + (np.arange(count, dtype=np.int64) * (b - a)) // count)
        return np.unique(np.array(steps, dtype=np.int64))

    def to_json(self) -> Any:
        if self.kind == "constant":
            return self.points[0][1]
        return {self.kind: {str(step): weight for step, weight in self.points}}


def parse_schedule(value: Any, where: str) -> WeightSchedule:
    """Parse a YAML weight; `where` names the key (and file) for error messages."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ConfigError(
            f"{where}: a weight is a number, {{step: {{STEP: W}}}} or {{linear: {{STEP: W}}}}, "
            f"got {value!r}"
        )
    if not isinstance(value, dict):
        return WeightSchedule("constant", ((0, _weight(value, where)),))
    if len(value) != 1 or next(iter(value)) not in KINDS:
        raise ConfigError(
            f"{where}: a schedule has exactly one key, 'step' or 'linear', got {sorted(value)}"
        )
    kind, table = next(iter(value.items()))
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{where}.{kind}: expected a mapping STEP: WEIGHT, got {table!r}")
    _refuse_spellings_of_one_step(table, f"{where}.{kind}")
    points = []
    for step, weight in table.items():
        if isinstance(step, str) and step.isdigit():
            step = int(step)  # JSON (a ledger) keeps mapping keys as strings
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"{where}.{kind}: steps are integers >= 0, got {step!r}")
        points.append((step, _weight(weight, f"{where}.{kind}.{step}")))
    steps = [p[0] for p in points]
    if steps != sorted(steps):
        raise ConfigError(f"{where}.{kind}: steps must be in increasing order, got {steps}")
    return WeightSchedule(kind, tuple(points))


def _named_step(key: Any) -> int | None:
    """The step a schedule key names, however spelled (0, '0', '00', 1e3, '1e3', 1000.0),
    accepted or not; None for a key that names no whole step."""
    if isinstance(key, bool) or not isinstance(key, (int, float, str)):
        return None
    try:
        value = float(key)
    except (ValueError, OverflowError):
        return None
    return int(value) if np.isfinite(value) and value == int(value) else None


def _refuse_spellings_of_one_step(table: dict[Any, Any], where: str) -> None:
    """Refuse two keys that name one step: YAML keeps `0` and `'0'` (or `1e3`, a string in YAML
    1.1, and `1000`) as different keys, and the last one's weight would silently win."""
    seen: dict[int, Any] = {}
    for key in table:
        step = _named_step(key)
        if step is None:
            continue
        if step in seen:
            raise ConfigError(
                f"{where}: keys {seen[step]!r} and {key!r} both name step {step}; write each "
                "step once"
            )
        seen[step] = key


def _weight(value: Any, where: str) -> float:
    # math's isfinite, not numpy's: ~20x less, for each of a mixture's hundreds of weights
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: a weight is a finite number, got {value!r}")
    if value < 0:
        raise ConfigError(f"{where}: weights must be >= 0, got {value}")
    return float(value)
