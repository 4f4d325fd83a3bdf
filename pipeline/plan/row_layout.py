"""How a source's documents become rows: the interface every row layout declares, and its registry.

A source's `packing:` names its layout (`concat`: windows of the concatenated stream, in
`layout`; `best_fit`: whole documents packed into rows, in `packing`). The names and the module
of each are `pipeline.config.parse.PACKINGS`, the one registry: the config checks a name there,
and `layout_kind` imports the module's `LAYOUT`. Everything the plan does per kind goes through
this interface, so a new layout is one module (a class with these members, `LAYOUT = ...`)
and one registry line (docs/architecture.md).

A layout works in batches of draws of all the sources of its kind at once (`draw`), which
keeps a step's concat windows one vectorised pass over every concat source. Its rows are of
a kind it names (`row_kind`): windows of a stream (`WINDOWS`) or whole documents then padding
(`DOCUMENTS`); the read layer (`pipeline.read.plan.READERS`) maps each kind to its reader, so
a layout whose rows are of a kind already read adds nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Any, ClassVar, Protocol

import numpy as np

from pipeline.config import DataConfig, SourceSpec
from pipeline.config.parse import PACKINGS
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore

OpenStore = Callable[[StoreMeta], TokenStore]
"""The open store of some metadata: the plan's one way to a store's files (injected)."""

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]
NO_DOCUMENTS = np.zeros(0, dtype=np.int64)

WINDOWS = "windows"
"""`RowLayout.row_kind` of windows of a stream (`seq_len + 1` tokens at a token start)."""
DOCUMENTS = "documents"
"""`RowLayout.row_kind` of whole documents then padding (a packing's rows)."""


@dataclass(frozen=True)
class Excluded:
    """Documents a source leaves out (`sources.NAME.exclude`, plan/exclusion.py): sorted
    document ids (shard-major) and the digest of the id list that named them ("" for none)."""

    documents: np.ndarray
    digest: str = ""


NO_EXCLUSION = Excluded(NO_DOCUMENTS)


class RowLayout(Protocol):
    """Where one source's rows are, per epoch and lane."""

    policy: ClassVar[str]  # its name in PACKINGS (`packing:`), part of every key it makes
    row_kind: ClassVar[str]  # what its rows are (`WINDOWS`, `DOCUMENTS`): who reads them
    name: str
    meta: StoreMeta
    seq_len: int
    lanes: int
    windows_per_lane: int  # rows each lane draws per epoch
    excluded: Excluded  # the documents it leaves out

    @classmethod
    def build(
        cls, spec: SourceSpec, meta: StoreMeta, config: DataConfig, open_store: OpenStore
    ) -> RowLayout:
        """The layout of source `spec` of `config` (its store's metadata `meta`; its files only
        through `open_store`)."""
        ...

    @staticmethod
    def order_key(entry: Mapping[str, str]) -> list[str] | None:
        """What of a source's config entry decides its rows besides the store (its part of the
        ledger's data-order fingerprint; None: nothing, as concat)."""
        ...

    @classmethod
    def draw(
        cls, layouts: Sequence[RowLayout], which: np.ndarray, counter: np.ndarray, lane: np.ndarray
    ) -> Arrays:
        """(epoch, window, token start) of draws of sources of this kind: draw i is the
        counter[i]-th row lane[i] draws from layouts[which[i]]."""
        ...

    @property
    def stats(self) -> Any:
        """What `epochs` and `verify` print of the layout (None: nothing)."""
        ...


@cache  # a mixture of hundreds of sources asks once per source
def layout_kind(packing: str) -> type[RowLayout]:
    """The layout class registered under `packing` (a name the config has checked)."""
    return import_module(PACKINGS[packing]).LAYOUT


def order_key(entry: Mapping[str, str]) -> list[str] | None:
    """`RowLayout.order_key` of a source's config entry (no `packing`: concat)."""
    return layout_kind(entry.get("packing", "concat")).order_key(entry)


class SourceKinds(tuple):
    """Each source's kind (its layout's class, or its kind of rows), in source order, and `only`:
    the kind every source has (None: several). Made once per plan, so that a step groups the
    sources it draws (`by_kind`) without a look at every source of the mixture."""

    only: Any

    def __new__(cls, kinds: Iterable[Any]) -> SourceKinds:
        made = super().__new__(cls, kinds)
        made.only = made[0] if made and made.count(made[0]) == len(made) else None
        return made


def by_kind(kinds: SourceKinds, drawn: list[int], order: Iterable = ()) -> dict[Any, list[int]]:
    """The drawn sources (`drawn`, ascending) grouped by their kind (`kinds[k]`: source k's,
    `SegmentPlan.layout_types`, `row_kinds`): the kinds of `order` first, in its order, then as
    drawn; only kinds that draw. Work in the drawn sources, none in a plan of one kind (the
    common one)."""
    if not drawn:
        return {}
    if kinds.only is not None:
        return {kinds.only: drawn}
    groups: dict[Any, list[int]] = {key: [] for key in order}
    for k in drawn:
        groups.setdefault(kinds[k], []).append(k)
    return {key: mine for key, mine in groups.items() if mine}


def rows_of(which: np.ndarray, groups: Iterable[list[int]], drawn: int) -> list[np.ndarray | slice]:
    """The rows of `which` (each row's source, of `drawn` sources in all) that each group of
    sources draws: every row, as a slice (no selection, no copy), when one group holds every
    drawn source (a step's common case)."""
    groups = list(groups)
    if len(groups) == 1 and len(groups[0]) == drawn:
        return [slice(None)]
    return [np.flatnonzero(np.isin(which, mine)) for mine in groups]


def draw(
    layouts: Sequence[RowLayout],
    which: np.ndarray,
    counter: np.ndarray,
    lane: np.ndarray,
    drawn: list[int],
    types: SourceKinds,
) -> Arrays:
    """`RowLayout.draw` of draws of any sources (`drawn`: those `which` names, ascending;
    `types`: each layout's class): each kind's rows in one call."""
    kinds = by_kind(types, drawn)
    if len(kinds) == 1:  # the common step: one kind draws every row, no selection of rows
        return next(iter(kinds)).draw(layouts, which, counter, lane)
    out = tuple(np.empty_like(counter) for _ in range(3))
    for kind, rows in zip(kinds, rows_of(which, kinds.values(), len(drawn))):
        for part, values in zip(out, kind.draw(layouts, which[rows], counter[rows], lane[rows])):
            part[rows] = values
    return out
