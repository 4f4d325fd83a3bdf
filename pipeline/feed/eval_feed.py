"""Eval data: the same full batches every time, sharded like training, never padded.

An eval set is one held-out store (see `prepare --eval-fraction`). Its batches are the first
`batches` steps of a one-source, one-lane plan over it: distinct windows of its epoch 0 in a
fixed keyed order. Only full batches are used; the at most `global_batch_size - 1` windows
(plus the tail tokens) past the last full batch are never evaluated, rather than padded. When
the training batch is a schedule, eval batches have the size it ends at (one shape to compile).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
from jax.sharding import Mesh

from pipeline.config import DataConfig, SourceSpec
from pipeline.feed.data_feed import DataFeed
from pipeline.read.eval_plan import eval_plan
from pipeline.read.plan import Plan


class EvalFeed:
    """Iterating yields `batches` global batches, from the first one again each time."""

    def __init__(
        self,
        config: DataConfig,
        source: SourceSpec,
        mesh: Mesh,
        batch_axes: str | tuple[str, ...] = ("data",),
    ) -> None:
        self.name = source.name
        plan, self.batches = eval_plan(config, source)
        self._feed = DataFeed(plan, mesh, batch_axes, log_events=False)  # same batches each time

    @property
    def plan(self) -> Plan:
        """The eval sources' plan (a fresh ledger of their own)."""
        return self._feed.plan

    def reset(self) -> None:
        """Serve the first batch next: every eval sees the same batches."""
        self._feed.seek(0)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        self.reset()
        for _ in range(self.batches):
            yield next(self._feed)

    def close(self) -> None:
        """Stop the feed's reader threads and close its stores."""
        self._feed.close()


def eval_feeds(
    config: DataConfig, mesh: Mesh, batch_axes: str | tuple[str, ...] = ("data",)
) -> list[EvalFeed]:
    return [EvalFeed(config, source, mesh, batch_axes) for source in config.eval_sources]
