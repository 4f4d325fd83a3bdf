"""This host's rows, in step order, as a Grain `MapDataset`, so users can chain Grain transforms.

Element `i` is row `rows[i % len(rows)]` of step `first_step + i // len(rows)`: random access
by index, like any Grain source, and the same rows the feed would produce.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.plan import Plan, host_rows

UNBOUNDED_STEPS = 10**12  # Grain needs a length; runs are far shorter than this.


class HostRowSource:
    """A random-access source (len + getitem) over this host's rows of consecutive steps."""

    def __init__(
        self,
        plan: Plan,
        rows: Sequence[int],
        first_step: int = 0,
        num_steps: int = UNBOUNDED_STEPS,
    ) -> None:
        self.plan = plan
        self.rows = np.asarray(rows, dtype=np.int64)
        self.first_step = first_step
        self.num_steps = num_steps

    def __len__(self) -> int:
        return self.num_steps * len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row index {index} outside 0..{len(self) - 1}")
        step, row = divmod(int(index), len(self.rows))
        batch = self.plan.batch(self.first_step + step, self.rows[row : row + 1])
        return {field: value[0] for field, value in batch.items()}


def host_dataset(
    plan: Plan,
    process_index: int = 0,
    process_count: int = 1,
    first_step: int = 0,
    num_steps: int = UNBOUNDED_STEPS,
) -> grain.MapDataset:
    """This process's rows (an even split of the batch) as a `grain.MapDataset`.

    A host's rows per step are fixed here, so a batch-size schedule is refused (use `DataFeed`).
    """
    if plan.config.batch_is_scheduled:
        raise ConfigError(
            f"{plan.config.origin}: global_batch_size is a schedule; host_dataset serves a fixed "
            "number of rows per step, so use DataFeed, which follows the schedule"
        )
    rows = host_rows(plan.config.global_batch_size, process_index, process_count)
    return grain.MapDataset.source(HostRowSource(plan, rows, first_step, num_steps))
