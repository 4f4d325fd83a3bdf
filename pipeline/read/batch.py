"""Windows to MaxText batch fields. A window of seq_len + 1 tokens gives one row:

    inputs  = w[:-1]    targets = w[1:]
    *_segmentation: 1, 2, 3, ... numbering the documents inside the row (a new one starts after
                    every end-of-document); never 0, because there is never padding
    *_position:     offset of each token from the start of its document *within the row*; a
                    document continued from the previous row counts from the row's first token,
                    so positions stay below seq_len for any position embedding

`targets_*` describe the target tokens (w[1:]), so `targets_segmentation` is the segment of the
token being predicted. A target that carries no loss (a prompt's, in a masked store) has
segment 0 there: `mask_untrained`, for windows and whole-document rows alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Protocol

import numpy as np

FIELDS = (
    "inputs",
    "targets",
    "inputs_segmentation",
    "targets_segmentation",
    "inputs_position",
    "targets_position",
)


def fields(tokens: np.ndarray, doc_rows: np.ndarray, doc_cols: np.ndarray) -> dict[str, np.ndarray]:
    """The six fields of int32 windows `tokens` [rows, seq_len + 1] whose documents start at
    (doc_rows[i], doc_cols[i]); every row also starts a segment at column 0."""
    return window_fields(tokens, *boundaries(tokens.shape, doc_rows, doc_cols))


def window_fields(
    tokens: np.ndarray, segments: np.ndarray, positions: np.ndarray
) -> dict[str, np.ndarray]:
    """The six fields of windows `tokens` with their `boundaries` (views, no copies)."""
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "inputs_segmentation": segments[:, :-1],
        "targets_segmentation": segments[:, 1:],
        "inputs_position": positions[:, :-1],
        "targets_position": positions[:, 1:],
    }


def boundaries(
    shape: tuple[int, int], doc_rows: np.ndarray, doc_cols: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The segment numbers and positions (int32, `shape`) of windows whose documents start at
    (doc_rows[i], doc_cols[i]), every row also at column 0 (`segment_fields`)."""
    rows, width = shape
    flat = np.asarray(doc_rows, np.int64) * width + np.asarray(doc_cols, np.int64)
    return segment_fields(shape, np.concatenate([flat, np.arange(0, rows * width, width)]))


def segment_fields(shape: tuple[int, int], starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segment numbers and positions (int32, `shape`) of windows whose segments start at
    the flat indexes `starts` (int64, in any order, repeats allowed), which name every row's
    column 0.

    Vectorised over the whole block: segment boundaries are the sorted flat indices of the
    starts (a few per row), and positions / segment numbers are `np.repeat`s of per-segment
    values, so no per-token scan (cumsum, maximum.accumulate) is needed. A few numpy calls in
    all, whatever the rows: a step's small arrays cost their calls, not their values.
    """
    rows, width = shape
    size = rows * width
    bounds = np.sort(starts)
    if bounds.size > 1:  # repeats out (a document that starts where a piece or row does)
        first = np.empty(bounds.size, bool)
        first[0] = True
        np.not_equal(bounds[1:], bounds[:-1], out=first[1:])
        bounds = bounds[first]
    lengths = np.empty_like(bounds)
    np.subtract(bounds[1:], bounds[:-1], out=lengths[:-1])
    lengths[-1] = size - bounds[-1]
    index = np.int32 if size < 2**31 else np.int64
    positions = np.repeat(bounds.astype(index), lengths)
    np.subtract(_counting(size, index), positions, out=positions)
    # a segment's number: one more than the bounds before it in its row (its row's start's)
    number = np.arange(1, bounds.size + 1, dtype=np.int32)
    number -= bounds.searchsorted(bounds - bounds % width).astype(np.int32)
    segments = np.repeat(number, lengths).reshape(rows, width)
    return segments, positions.astype(np.int32, copy=False).reshape(rows, width)


@lru_cache(maxsize=2)
def _counting(size: int, dtype: type) -> np.ndarray:
    """0, 1, ..., size - 1 (read-only, kept per size): every step of a run subtracts its
    segments' starts from the same one. Two sizes kept (a training feed's and an evaluation
    feed's), each the size of one step's positions."""
    values = np.arange(size, dtype=dtype)
    values.flags.writeable = False
    return values


class MaskSource(Protocol):
    """What the loss mask needs of a store (`TokenStore`'s members)."""

    masked: bool

    def untrained_spans(
        self, shards: Sequence[int], starts: Sequence[int], stops: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def mask_untrained(targets: np.ndarray, ranges: Iterable[tuple[int, int]]) -> None:
    """Segment 0 on the targets that carry no loss, in place: the one loss-mask path of every
    row layout. `targets` is the rows' `targets_segmentation`, flat; `ranges` its flat ranges
    [a, b) of untrained targets (`untrained_ranges`)."""
    for a, b in ranges:
        targets[a:b] = 0


def untrained_ranges(
    stores: Sequence[MaskSource],
    owner: np.ndarray,
    shard: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    at: np.ndarray,
    floor: np.ndarray,
) -> Iterator[tuple[int, int]]:
    """The flat ranges [a, b) of the targets that carry no loss: piece i is tokens
    [lo[i], hi[i]) of shard shard[i] of stores[owner[i]], whose token t (t from 0) is the
    target at flat index at[i] + t - 1, and none below floor[i] (the first target of the row
    a window starts, or of a whole document's slots). One `untrained_spans` call per store.
    What `mask_untrained` zeroes, and the compact form (`pipeline.read.compact`) marks."""
    for k, store in enumerate(stores):
        if not store.masked:
            continue
        mine = np.flatnonzero(owner == k)
        piece, first, end = store.untrained_spans(shard[mine], lo[mine], hi[mine])
        before = at[mine][piece] - 1
        starts = np.maximum(before + first, floor[mine][piece]).tolist()
        yield from zip(starts, (before + end).tolist())
