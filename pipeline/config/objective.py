"""`objective:` weights: how much of each step's loss each source's trained tokens carry.

    mix: {web: 3, chat: 1}          # what the rows are drawn from (sampling)
    objective: {web: 1, chat: 1}    # what the loss sees: half of each step's loss weight each

A data config may give `objective` at the top (every stage without its own) or per stage
(`stages[i].objective`). Weights are relative, finite and >= 0, at least one > 0; a source the
objective leaves out weighs 0 (its tokens carry no loss), as in `DataFeed.set_mix`. The batch
then carries `loss_weights` (docs/mixtures.md, "Objective weights"); without `objective`
nothing changes. Parsing only: the plan quantizes the weights (`mix_table.quantize`).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.errors import ConfigError

Objective = tuple[tuple[str, float], ...]
"""(source name, weight) by name."""


def parse_objective(raw: Any, origin: str, key: str, names: set[str]) -> Objective:
    """The weights of `raw` (the value at `key` of the file `origin`): a mapping of known source
    names to numbers; every refusal names the file and key."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{origin}: {key}: expected a non-empty mapping of source names to weights, got {raw!r}"
        )
    out = []
    for name, weight in sorted(raw.items(), key=lambda item: str(item[0])):
        if name not in names:
            raise ConfigError(
                f"{origin}: {key}.{name}: unknown source (sources: {', '.join(sorted(names))})"
            )
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{origin}: {key}.{name}: expected a number >= 0, got {weight!r}")
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(
                f"{origin}: {key}.{name}: expected a finite number >= 0, got {weight}"
            )
        out.append((str(name), float(weight)))
    if not any(weight > 0 for _, weight in out):
        raise ConfigError(f"{origin}: {key}: at least one weight must be > 0, got {raw!r}")
    return tuple(out)


def objective_json(objective: Objective) -> dict[str, float | int]:
    """The mapping that parses back to `objective` (whole numbers as integers)."""
    return {name: int(w) if w.is_integer() else w for name, w in objective}
