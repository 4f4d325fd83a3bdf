"""The plan's hot path: copy a batch's pieces, of every source, out of their stores in one pass.

A batch is a few hundred pieces (token ranges of shards) of a few stores; per piece the work is
one slice copy, so what it costs is the Python and numpy calls around it. `read_pieces` checks
every range at once, copies a piece of a shard with a flat sidecar from its memory map, and
copies the pieces of a shard without one by reading each ArrayRecord record they overlap once
(`_copy_records`). It reads through a `TokenStore`'s public methods only (`PieceSource`): what
is checked, open or cached is the store's business.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, chain
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.flat_blocks import FlatBlocks
from pipeline.store.open_shards import pool
from pipeline.store.remote_reads import PARALLEL, RemoteFlat, prefetch_blocks, together

DOC_TABLE = 1 << 16  # document offsets laid end to end per batch (`_doc_starts`): 512 KiB


class PieceSource(Protocol):
    """What `read_pieces` needs of a store: `TokenStore`'s methods, declared here rather than
    imported, since `token_store` imports this module."""

    shard_tokens: np.ndarray
    dtype: np.dtype

    @property
    def num_shards(self) -> int: ...
    def check_shard(self, shard: int) -> int: ...
    def shard_file(self, shard: int) -> Path: ...
    def opened(self, shard: int) -> bool: ...
    def flat_blocks(self, shard: int) -> FlatBlocks | RemoteFlat | None: ...
    def shard_view(self, shard: int) -> tuple[FlatBlocks | RemoteFlat | None, np.ndarray]: ...
    def held_view(
        self, shard: int
    ) -> tuple[FlatBlocks | RemoteFlat | None, np.ndarray, tuple[int, int] | None] | None: ...
    def record_offsets(self, shard: int) -> np.ndarray: ...
    def read_record_list(self, shard: int, records: list[int]) -> list[bytes]: ...


def read_pieces(
    stores: Sequence[PieceSource],
    which: Sequence[int],
    shards: Sequence[int],
    lo: Sequence[int],
    hi: Sequence[int],
    out: np.ndarray,
    out_rows: Sequence[int],
    out_cols: Sequence[int],
    *,
    doc_starts: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Copy tokens [lo[i], hi[i]) of shard shards[i] of stores[which[i]] into
    `out[out_rows[i], out_cols[i]:]`, cast to its dtype; returns (row, column) in `out` of every
    document start inside the pieces. `doc_starts=False` skips that lookup (and returns none)
    for a caller that knows them: a best-fit row reads whole documents (`copy_pieces`)."""
    found = copy_pieces(stores, which, shards, lo, hi, out, out_rows, out_cols, doc_starts)
    return np.divmod(found, out.shape[1])


def copy_pieces(
    stores: Sequence[PieceSource],
    which: Sequence[int],
    shards: Sequence[int],
    lo: Sequence[int],
    hi: Sequence[int],
    out: np.ndarray,
    out_rows: Sequence[int],
    out_cols: Sequence[int],
    doc_starts: bool = True,
) -> np.ndarray:
    """`read_pieces`, its document starts as flat indexes into `out` (ascending when the
    pieces are in `out`'s order): what a step's windows take, without a divmod and back.

    The plan's hot path: all pieces of a batch, of every source, in one pass. A piece of a shard
    with a flat sidecar is a slice of its memory map (its blocks checked on their first read,
    `FlatBlocks.read`), and its document starts one `searchsorted` of the shard's document
    index (a few pieces per shard and step: one Python loop over the pieces costs less than
    numpy calls per shard); pieces that fill `out` end to end in its order (a step's windows)
    are copied by one `np.concatenate` into it, others one slice assignment each. The pieces
    of a shard without a sidecar are copied by reading each record they overlap once
    (`_copy_records`).
    """
    which, shards, lo, hi, rows, cols = (
        np.asarray(a, dtype=np.int64).reshape(-1)
        for a in (which, shards, lo, hi, out_rows, out_cols)
    )
    width = out.shape[1]
    at = rows * width + cols
    pieces = list(zip(*(a.tolist() for a in (which, shards, lo, hi, at))))
    # each piece's shard, numbered in the order they are first read (a step of a big mixture
    # reads dozens of shards of dozens of stores: a few Python calls each, no numpy call)
    numbers: dict[tuple[int, int], int] = {}
    slot = [numbers.setdefault((k, shard), len(numbers)) for k, shard, *_ in pieces]
    sizes = [_shard_size(stores[k], shard) for k, shard in numbers]
    for (k, shard, start, stop, _), number in zip(pieces, slot):
        if not 0 <= start < stop <= sizes[number]:
            raise StoreError(
                f"{stores[k].shard_file(shard)}: token range [{start}, {stop}) is not a "
                f"non-empty range inside the shard (0..{sizes[number]})"
            )
    # stores in buckets, read through remote_reads
    remote = [k for k, store in enumerate(stores) if getattr(store, "remote", False)]
    if remote:
        _prefetch(stores, remote, which, shards, lo, hi)
    views = _views(stores, numbers)
    if not _copy_end_to_end(views, pieces, slot, out):
        _copy_each(stores, list(numbers), views, pieces, slot, out)
    if not doc_starts:
        return np.empty(0, np.int64)
    docs = [view[1] for view in views]
    return _doc_starts(docs, np.array(slot, np.int64), lo, hi, at - lo)


def _copy_end_to_end(
    views: list[tuple[FlatBlocks | RemoteFlat | None, np.ndarray]],
    pieces: list[tuple[int, ...]],
    slot: list[int],
    out: np.ndarray,
) -> bool:
    """Copy the pieces in one call when they fill C-contiguous `out` end to end from its start,
    in order, each from a flat sidecar (a step's windows, a best-fit step's documents): their
    slices (each checked, `FlatBlocks.read`) concatenated straight into `out`, cast as a slice
    assignment casts. False (nothing copied) for any other pieces."""
    if not out.flags.c_contiguous:
        return False
    slices, end = [], 0
    for (_, _, start, stop, at), number in zip(pieces, slot):
        flat = views[number][0]
        if flat is None or at != end:
            return False
        slices.append(flat.read(start, stop))
        end += stop - start
    if end > out.size:
        return False
    np.concatenate(slices, out=out.reshape(-1)[:end], casting="unsafe")
    return True


def _copy_each(
    stores: Sequence[PieceSource],
    shard_of: list[tuple[int, int]],
    views: list[tuple[FlatBlocks | RemoteFlat | None, np.ndarray]],
    pieces: list[tuple[int, ...]],
    slot: list[int],
    out: np.ndarray,
) -> None:
    """Copy the pieces one by one: a slice assignment each from a flat sidecar, the pieces of
    a shard without one (`shard_of[slot]`: its store and shard) through its records
    (`_copy_records`)."""
    width = out.shape[1]
    by_record: dict[int, list[tuple[int, int, int, int]]] = {}
    for (_, _, start, stop, at), number in zip(pieces, slot):
        row, col = divmod(at, width)
        flat = views[number][0]
        if flat is None:
            by_record.setdefault(number, []).append((start, stop, row, col))
        else:
            out[row, col : col + stop - start] = flat.read(start, stop)
    for number, group in by_record.items():
        k, shard = shard_of[number]
        _copy_records(stores[k], shard, *map(list, zip(*group)), out)


def _shard_size(store: PieceSource, shard: int) -> int:
    """The tokens of the store's shard `shard`, refused unless the store has it (a negative
    shard would silently read another one)."""
    if not 0 <= shard < len(store.shard_tokens):
        store.check_shard(shard)
    return int(store.shard_tokens[shard])


def _views(
    stores: Sequence[PieceSource], shards: Iterable[tuple[int, int]]
) -> list[tuple[FlatBlocks | RemoteFlat | None, np.ndarray]]:
    """(flat sidecar, document offsets) of each (store, shard), the shards held marked used
    together (`OpenShards.touch_many`: one lock, not one a shard); a shard not held is opened
    (`shard_view`, which marks it)."""
    views, used = [], []
    for k, shard in shards:
        held = stores[k].held_view(shard)
        if held is None:
            views.append(stores[k].shard_view(shard))
            continue
        flat, docs, key = held
        views.append((flat, docs))
        if key is not None:
            used.append(key)
    if used:
        pool().touch_many(used)
    return views


def _doc_starts(
    docs: list[np.ndarray], slot: np.ndarray, lo: np.ndarray, hi: np.ndarray, at: np.ndarray
) -> np.ndarray:
    """The document offsets in [lo[i], hi[i]) of each piece's shard (docs[slot[i]]), each at
    at[i] + offset: every shard's offsets but its end laid end to end, shifted past the tokens
    of the shards before it, so that one `searchsorted` finds the starts of all the pieces (a
    big mixture's step reads dozens of shards once each: not a call a piece). Shards of more
    than `DOC_TABLE` offsets in all are searched piece by piece instead: their indexes are not
    copied every step."""
    counts = [len(offsets) - 1 for offsets in docs]
    if sum(counts) > DOC_TABLE:
        found = [np.empty(0, np.int64)]
        for offsets, start, stop, base in zip(
            map(docs.__getitem__, slot.tolist()), lo.tolist(), hi.tolist(), at.tolist()
        ):
            first, last = offsets.searchsorted((start, stop)).tolist()
            found.append(offsets[first:last] + base)
        return np.concatenate(found)
    shift = np.cumsum([0, *(int(offsets[-1]) for offsets in docs[:-1])], dtype=np.int64)
    table = np.concatenate([offsets[:-1] for offsets in docs]) + np.repeat(shift, counts)
    base = shift[slot]
    first, last = table.searchsorted(np.concatenate((lo, hi)).reshape(2, -1) + base).tolist()
    # a few document starts a step: their pieces and places in `table` in plain Python
    piece, index = [], []
    for i, (a, b) in enumerate(zip(first, last)):
        if b > a:
            piece += [i] * (b - a)
            index += range(a, b)
    return table[index] + (at - base)[piece]


def _prefetch(
    stores: Sequence[PieceSource],
    remote: list[int],
    which: np.ndarray,
    shards: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> None:
    """The pieces of stores in buckets (`remote`), fetched at once (`fetch_blocks`)."""
    masks = [(stores[k], which == k) for k in remote]
    fetch_blocks([(store, shards[m], lo[m], hi[m]) for store, m in masks])


def fetch_blocks(
    pieces: Iterable[tuple[PieceSource, np.ndarray, np.ndarray, np.ndarray]],
    parallel: int = PARALLEL,
) -> None:
    """Download what reading `pieces` (store, shards, lo, hi: tokens [lo[i], hi[i]) of shard
    shards[i]) needs of stores in buckets and this process does not hold: the shards they read
    opened at once, then the blocks they touch downloaded at once (at most `parallel` requests
    at a time); two round trips for any number of sources, shards and blocks, where
    reading piece by piece waits for each in turn. Stores on disk are skipped."""
    ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    held: dict[int, PieceSource] = {}
    for store, shards, lo, hi in pieces:
        if not getattr(store, "remote", False):
            continue
        held[id(store)] = store
        for shard, start, stop in zip(shards.tolist(), lo.tolist(), hi.tolist(), strict=True):
            ranges.setdefault((id(store), shard), []).append((start, stop))
    # the shards not opened yet opened at once (a thread each), each once; the others, most
    # steps', need no request
    unopened = [(k, s) for k, s in ranges if not held[k].opened(s)]
    calls = (lambda k=k, s=s: held[k].flat_blocks(s) for k, s in unopened)
    opened = dict(zip(unopened, together(*calls, parallel=parallel), strict=True))
    flats = [opened[k, s] if (k, s) in opened else held[k].flat_blocks(s) for k, s in ranges]
    prefetch_blocks(
        (
            (flat, spans)
            for flat, spans in zip(flats, ranges.values(), strict=True)
            if isinstance(flat, RemoteFlat)
        ),
        parallel,
    )


def _copy_records(
    store: PieceSource,
    shard: int,
    starts: list[int],
    stops: list[int],
    rows: list[int],
    cols: list[int],
    out: np.ndarray,
) -> None:
    """`read_pieces`'s copy through ArrayRecord: each needed record read once."""
    offsets = store.record_offsets(shard)
    # first record of [lo, hi): the last offset <= lo; one past its last: offsets <= hi - 1
    ends = np.searchsorted(offsets, starts + [stop - 1 for stop in stops], side="right")
    firsts = (ends[: len(starts)] - 1).tolist()
    lasts = ends[len(starts) :].tolist()
    # A few pieces and records per shard and step: plain Python beats numpy calls here.
    needed = sorted(set(chain.from_iterable(map(range, firsts, lasts))))
    raw = store.read_record_list(shard, needed)
    # All records in one buffer; a piece's records are consecutive in `needed`, so in it.
    joined = b"".join(raw)
    itemsize = store.dtype.itemsize
    ends = list(accumulate(map(len, raw)))  # byte offsets in `joined`
    where = dict(zip(needed, [0, *ends]))
    where_end = dict(zip(needed, ends))
    tokens = np.frombuffer(joined, dtype=np.uint8)
    for first, last, start, stop, row, col in zip(firsts, lasts, starts, stops, rows, cols):
        bounds = offsets[first : last + 1].tolist()
        held = where_end[last - 1] - where[first]
        if held != (bounds[-1] - bounds[0]) * itemsize:
            raise StoreError(
                f"{store.shard_file(shard)}: records {first}..{last - 1} hold {held} bytes "
                f"but the index says {bounds[-1] - bounds[0]} tokens of {itemsize} bytes; "
                "the store is corrupt"
            )
        source = where[first] + (start - bounds[0]) * itemsize
        window = tokens[source : source + (stop - start) * itemsize].view(store.dtype)
        out[row, col : col + stop - start] = window
