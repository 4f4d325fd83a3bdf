"""Loss-mask spans inside token ranges: the vectorised lookup every masked store shares.

A masked store keeps, per shard, its untrained token ranges as an int64 [k, 2] array of
(start, end) shard offsets, ascending and disjoint. The plan asks, for all of a batch's pieces
at once, which of those ranges fall inside each piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def spans_in_ranges(
    spans_of: Callable[[int], np.ndarray],
    shards: Sequence[int],
    starts: Sequence[int],
    stops: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The untrained ranges (`spans_of(shard)`) inside each token range [starts[i], stops[i])
    of shard shards[i], as (i, first, end) arrays, clipped to the range and relative to
    starts[i] (grouped by shard): one `searchsorted` and one gather per shard, the rest in one
    pass over the pieces."""
    pieces = [np.asarray(a, np.int64).reshape(-1) for a in (shards, starts, stops)]
    if not pieces[0].size:
        return (np.empty(0, np.int64),) * 3
    shards, starts, stops = pieces
    order = np.argsort(shards, kind="stable")
    numbers, cuts = np.unique(shards[order], return_index=True)
    cuts = np.append(cuts, order.size).tolist()
    spans = [spans_of(n) for n in numbers.tolist()]
    # In a shard's spans flattened (ascending), n(<= start) // 2 spans end by `start` and
    # (n(<= stop - 1) + 1) // 2 begin before `stop`.
    found = np.stack([starts[order], stops[order] - 1], axis=1)
    for k, mine in enumerate(spans):
        found[cuts[k] : cuts[k + 1]] = mine.reshape(-1).searchsorted(
            found[cuts[k] : cuts[k + 1]], side="right"
        )
    first = found[:, 0] // 2
    count = np.maximum((found[:, 1] + 1) // 2 - first, 0)
    ends = np.cumsum(count)
    index = np.repeat(first - ends + count, count) + np.arange(ends[-1])
    bounds = np.empty((index.size, 2), dtype=np.int64)
    at = np.concatenate([[0], ends])[cuts].tolist()  # each shard's spans in `index`
    for k, mine in enumerate(spans):
        bounds[at[k] : at[k + 1]] = mine[index[at[k] : at[k + 1]]]
    piece = order[np.repeat(np.arange(order.size), count)]
    base = starts[piece]
    lo = np.maximum(bounds[:, 0], base) - base
    hi = np.minimum(bounds[:, 1], stops[piece]) - base
    return piece, lo, hi
