"""This host's rows, in step order, as a Grain `MapDataset`, so users can chain Grain transforms.

Element `i` is row `rows[i % len(rows)]` of step `first_step + i // len(rows)`: random access
by index, like any Grain source, and the same rows the feed would produce. A source `by_step`
serves the host's rows of step `first_step + i` as element `i` instead (one read per step):
what a `grain.DataLoader` with workers needs to serve whole steps, since its `Batch` operation
batches each worker's own elements, which mixes steps.

With an `objective:` each row also carries `loss_source` and `loss_objective` (int32): the
weights need every row of the step, which no host holds, so a trainer makes its rows global
arrays as for the six fields and derives `loss_weights` there with `pipeline.feed.expand.weigh`
(what `DataFeed` does on its own).

Grain runs a pipeline's sources in other processes (`mp_prefetch` workers, a `DataLoader`'s
`worker_count`), so the source pickles: its `Plan` crosses as the ledger, the stores' metadata
and the segments' configs (`Plan.__getstate__`), and each worker opens the stores on first use
with the identity check the parent's plan makes. An error there (a store replaced or damaged
since) is our typed exception with the line the parent would give: Grain pickles a worker's
exception and raises it again in the process that iterates.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.rows import host_rows
from pipeline.read import objective
from pipeline.read.plan import Plan

UNBOUNDED_STEPS = 10**12  # Grain needs a length; runs are far shorter than this.


class HostRowSource:
    """A random-access source (len + getitem) over this host's rows of consecutive steps: one
    row per element, or one step's rows (`by_step`)."""

    def __init__(
        self,
        plan: Plan,
        rows: Sequence[int],
        first_step: int = 0,
        num_steps: int = UNBOUNDED_STEPS,
        by_step: bool = False,
    ) -> None:
        self.plan = plan
        self.rows = np.asarray(rows, dtype=np.int64)
        self.first_step = first_step
        self.num_steps = num_steps
        self.by_step = by_step

    def __len__(self) -> int:
        return self.num_steps * (1 if self.by_step else len(self.rows))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(
                f"{'step' if self.by_step else 'row'} index {index} outside 0..{len(self) - 1}"
            )
        if self.by_step:
            return self._rows(self.first_step + int(index), self.rows)
        step, row = divmod(int(index), len(self.rows))
        batch = self._rows(self.first_step + step, self.rows[row : row + 1])
        return {field: value[0] for field, value in batch.items()}

    def _rows(self, step: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The six fields of `rows` of `step`, and with an objective the per-row inputs of
        `loss_weights` (`objective.ROW_FIELDS`), which span the whole step: the trainer derives
        them on the global arrays (`pipeline.feed.expand.weigh`)."""
        draws = self.plan.draws(step, rows)
        return {**self.plan.read(draws), **objective.row_fields(self.plan, draws)}

    def __repr__(self) -> str:
        """The same for the same rows in any process: `grain.DataLoader` compares a restored
        state's `repr` of its source with its own, and refuses another data order."""
        ledger = self.plan.ledger
        order = "+".join(segment.fingerprint for segment in ledger.segments)
        if len(ledger.mixes):  # set_mix entries change the rows too
            order += f"+mix:{ledger.mixes.to_json()['digest']}"
        if len(ledger.objectives):  # and objective entries the loss_objective field
            order += f"+objective:{ledger.objectives.to_json()['digest']}"
        return (
            f"HostRowSource(order={order}, rows={self.rows.tolist()}, "
            f"first_step={self.first_step}, num_steps={self.num_steps}, by_step={self.by_step})"
        )


def host_source(
    plan: Plan,
    process_index: int = 0,
    process_count: int = 1,
    first_step: int = 0,
    num_steps: int = UNBOUNDED_STEPS,
    by_step: bool = False,
) -> HostRowSource:
    """This process's rows (an even split of the batch) as a Grain data source, for
    `grain.DataLoader(data_source=...)` (`by_step`: one element per step); `host_dataset` is
    the same rows as a `MapDataset`.

    A host's rows per step are fixed here, so a batch-size schedule is refused (use `DataFeed`),
    and so is a ledger whose segments from `first_step` on differ in batch size (a switch).
    """
    ledger = plan.ledger
    serving = range(ledger.segment_index(first_step), len(ledger.segments))
    for index in reversed(serving):  # the last first: its batch is the one served
        config = plan.segment_plan(index).config
        where = "" if index == len(ledger.segments) - 1 else f" in ledger segment {index}"
        if config.batch_is_scheduled:
            raise ConfigError(
                f"{plan.config.origin}: global_batch_size is a schedule{where}; the Grain view "
                "serves a fixed number of rows per step, so use DataFeed, which follows it"
            )
        size = plan.config.global_batch_size
        if config.global_batch_size != size:
            raise ConfigError(
                f"{plan.config.origin}: global_batch_size is {config.global_batch_size}{where} "
                f"(from step {ledger.segments[index].start_step}) and {size} in the last; the "
                "Grain view serves a fixed number of rows per step, so use DataFeed, which "
                "follows the ledger"
            )
    rows = host_rows(size, process_index, process_count)
    return HostRowSource(plan, rows, first_step, num_steps, by_step)


def host_dataset(
    plan: Plan,
    process_index: int = 0,
    process_count: int = 1,
    first_step: int = 0,
    num_steps: int = UNBOUNDED_STEPS,
) -> grain.MapDataset:
    """This process's rows (`host_source`) as a `grain.MapDataset`."""
    source = host_source(plan, process_index, process_count, first_step, num_steps)
    return grain.MapDataset.source(source)
