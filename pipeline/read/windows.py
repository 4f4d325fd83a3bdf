"""Reading the rows of `concat` sources: windows of `seq_len + 1` tokens of an epoch stream.

The shard pieces of every drawn window, of all such sources of a step, are found in one pass
(`layout.window_pieces`) and copied in one pass (`read_pieces`) straight into one
[rows, seq_len + 1] buffer, with the segment numbers and positions of its document starts
(`batch.segment_fields`), which `batch.window_fields` turns into the six fields, or (`packed`)
`compact.pack` into the windows' compact form. The copy and the boundaries are one seam
(`_assemble`), where benchmarks/native_ab.py measures a compiled assembly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.plan.layout import window_pieces
from pipeline.plan.row_layout import OpenStore, RowLayout
from pipeline.read import compact
from pipeline.read.batch import mask_untrained, segment_fields, untrained_ranges, window_fields
from pipeline.store.piece_reads import copy_pieces
from pipeline.store.token_store import TokenStore


def read_windows(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    drawn: list[int],
    which: np.ndarray,
    epoch: np.ndarray,
    window: np.ndarray,
    start: np.ndarray,
    *,
    packed: bool,
    found: dict,
) -> dict[str, np.ndarray]:
    """The six fields of drawn windows (`packed`: their compact form, `pipeline.read.compact`):
    row i is the window at token start[i] of epoch epoch[i] of source layouts[which[i]]
    (`drawn`: the sources `which` names, ascending; `found`: their draws' `Draws.found`)."""
    seq_len = layouts[int(which[0])].seq_len
    tokens = np.empty((len(which), seq_len + 1), dtype=np.int32)
    kept = found.pop(found_key(drawn), None)
    stores, pieces = kept or window_reads(layouts, open_store, drawn, which, epoch, start)
    owner, shard, lo, hi, row, col = pieces
    segments, positions = _assemble(stores, pieces, tokens, packed)
    masked = any(store.masked for store in stores)
    if packed:
        bounds = segments  # the compact form's, segment numbers and positions in one
        if masked:  # the target at token column c is target c - 1 of its row
            first = row * (seq_len + 1) + 1
            ranges = untrained_ranges(stores, owner, shard, lo, hi, first + col, first)
            compact.mark_untrained(bounds, ranges)
        return {"tokens": tokens, "bounds": bounds}
    batch = window_fields(tokens, segments, positions)
    if masked:
        # its own array: the segment fields are views of one buffer
        batch["targets_segmentation"] = batch["targets_segmentation"].copy()
        first = row * seq_len  # a window's target column j is its token j + 1
        targets = batch["targets_segmentation"].reshape(-1)
        mask_untrained(targets, untrained_ranges(stores, owner, shard, lo, hi, first + col, first))
    return batch


def window_reads(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    drawn: list[int],
    which: np.ndarray,
    epoch: np.ndarray,
    start: np.ndarray,
) -> tuple[list[TokenStore], tuple[np.ndarray, ...]]:
    """The stores of the drawn windows' sources (`drawn`: those `which` names, ascending) and
    the windows' shard pieces (`layout.window_pieces`: owner, shard, lo, hi, row, column;
    owner indexes the stores)."""
    owner = np.searchsorted(drawn, which)
    mine = [layouts[s] for s in drawn]
    return [open_store(layout.meta) for layout in mine], window_pieces(mine, owner, epoch, start)


def found_key(drawn: list[int]) -> tuple:
    """The key in `Draws.found` of the `window_reads` of the windows of sources `drawn`: the
    fetch-ahead thread of a feed over buckets finds a step's pieces (`Plan.pieces`) and keeps
    them there, the step's reader takes them (`read_windows`) instead of finding them again."""
    return ("window_reads", *drawn)


def _assemble(
    stores: Sequence[TokenStore], pieces: tuple[np.ndarray, ...], tokens: np.ndarray, packed: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Copy the `pieces` into `tokens` and return (segments, positions), or with `packed`
    (bounds, None): the step's assembly, one seam (benchmarks/native_ab.py swaps in a
    compiled one)."""
    owner, shard, lo, hi, row, col = pieces
    found = copy_pieces(stores, owner, shard, lo, hi, tokens, row, col)
    # Every piece begins a segment: a window's first at its row's column 0; one after it begins
    # a document: at a shard's start it does anyway, and in a transitional epoch's stream
    # (`transition`) it joins stretches apart in the store.
    starts = np.concatenate([found, row * tokens.shape[1] + col])
    segments, positions = segment_fields(tokens.shape, starts)
    return (compact.pack(segments, positions), None) if packed else (segments, positions)
