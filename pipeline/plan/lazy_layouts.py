"""A segment's source layouts, each `concat` one laid out at its first use.

A restore lays out every source of its mixture before its first step, and its first steps draw
a few of them (at most 32 of 256 sources at a batch of 32 rows). A `concat` layout of the whole
store is a pure function of the store's metadata and the config, opening no file, so it is
made when a draw (`Layouts.ready`), a read or a report first asks for it, not at the start
(~1.5 us a source). Laid out at the start, as before: a layout that reads its store (best_fit's
packing) or excludes documents, one that `eager` names (a stage lays its mixture out from it:
an epochized blend, `mix_unit: tokens`; a layout that continues a previous segment's epochs),
and one whose store may hold less than a window per lane (`too_small`), so that its config error
stops the start, naming the config file, as it always did.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError
from pipeline.plan import exclusion
from pipeline.plan.row_layout import OpenStore, RowLayout, layout_kind
from pipeline.store.meta import StoreMeta

LAZY = "concat"
"""The packing whose layouts (of a whole store) wait for their first use."""


class Layouts(Mapping[str, RowLayout]):
    """The layouts of `config`'s sources by name, from their stores' `metas` (`open_store`:
    for a layout that reads its store); `ordered`: the same in source order, as draws index
    them, None until laid out (`ready` lays out the drawn ones first)."""

    def __init__(
        self,
        config: DataConfig,
        metas: Mapping[str, StoreMeta],
        open_store: OpenStore,
        eager: Collection[str] = (),
    ) -> None:
        self._config, self._metas, self._open = config, metas, open_store
        self._index = {name: k for k, name in enumerate(config.source_names)}
        self.ordered: list[RowLayout | None] = [None] * len(self._index)
        self._lock = threading.Lock()
        lazy, window = layout_kind(LAZY), config.seq_len + 1
        # each layout's class and kind of rows, for a step's draws to group its sources by
        # (`row_layout.by_kind`): a lazy one's is the class it will be
        self.types: list[type] = [lazy] * len(self._index)
        self._waiting = len(self._index)  # not laid out yet
        for k, spec in enumerate(config.sources):
            if (
                spec.packing != LAZY
                or spec.exclude is not None
                or spec.name in eager
                or too_small(self._metas[spec.name].num_tokens, window, config.lanes)
            ):
                self.types[k] = type(self._lay_out(k))

    def __getitem__(self, name: str) -> RowLayout:
        k = self._index[name]
        layout = self.ordered[k]
        return self._lay_out(k) if layout is None else layout

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def ready(self, drawn: list[int]) -> None:
        """Lay out the sources (indexes) `drawn` that are not yet: `ordered[k]` holds each."""
        if self._waiting:
            ordered = self.ordered
            for k in drawn:
                if ordered[k] is None:
                    self._lay_out(k)

    def replace(self, name: str, layout: RowLayout) -> None:
        """Hold `layout` for `name` instead (a layout that continues a previous segment's)."""
        k = self._index[name]
        self.ordered[k], self.types[k] = layout, type(layout)

    def _lay_out(self, k: int) -> RowLayout:
        """Source `k`'s layout, made once (a reader and the fetching thread may ask at once)."""
        with self._lock:
            layout = self.ordered[k]
            if layout is None:
                spec = self._config.sources[k]
                try:
                    layout = _layout(spec, self._metas[spec.name], self._config, self._open)
                except ConfigError as error:
                    raise ConfigError(f"{self._config.origin}: {error}") from error
                self.ordered[k] = layout
                self._waiting -= 1
            return layout


def too_small(tokens: int, window: int, lanes: int) -> bool:
    """Whether a store of `tokens` may hold less than one `window` per lane: its `concat`
    layout then refuses the config, and is laid out at the start to say so."""
    return tokens < window * lanes


def _layout(
    spec: SourceSpec, meta: StoreMeta, config: DataConfig, open_store: OpenStore
) -> RowLayout:
    """Source `spec`'s layout, by the kind its `packing` names (without the documents it
    excludes, `exclusion.build`)."""
    if spec.exclude is not None:
        return exclusion.build(spec, meta, config, open_store)
    return layout_kind(spec.packing).build(spec, meta, config, open_store)
