"""A step's assembly against references written plainly: the pieces of its windows
(`layout.window_pieces` against `SourceLayout.pieces`, window by window), their copy
(`read_pieces`, end to end or piece by piece, against each piece read alone) and the segment
fields of their starts (`batch.segment_fields` against a scan of each row).

The stores are `storegen`'s: a token's value is its offset in the store's stream, so what a
piece must hold, and where documents start, is known without reading anything.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.plan.layout import SourceLayout, window_pieces
from pipeline.read.batch import boundaries, segment_fields
from pipeline.store.token_store import TokenStore, read_pieces
from tests.storegen import doc_starts, synthetic_meta, write_synthetic_store

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SHARDS = [[5, 17, 3], [], [40, 2, 9, 30], [1], [12, 12, 12, 12, 6]]  # an empty shard among them
OTHER = [[64], [7, 3, 9], [50, 25]]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[TokenStore]:
    """One store read through its flat sidecars, its twin through ArrayRecord records."""
    flat = tmp_path_factory.mktemp("flat") / "store"
    records = tmp_path_factory.mktemp("records") / "store"
    write_synthetic_store(flat, SHARDS, record_tokens=4)
    write_synthetic_store(records, SHARDS, record_tokens=4, flat=False)
    return [TokenStore(flat), TokenStore(records)]


def scanned(rows: int, width: int, starts: set[int]) -> tuple[list[int], list[int]]:
    """Segment numbers and positions, token by token: a start after a row's first token opens
    the next segment at position 0."""
    segments, positions = [], []
    for row in range(rows):
        segment, position = 1, 0
        for column in range(width):
            if column and row * width + column in starts:
                segment, position = segment + 1, 0
            segments.append(segment)
            positions.append(position)
            position += 1
    return segments, positions


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 30), st.data())
def test_segment_fields_are_a_scan_of_each_row(rows: int, width: int, data) -> None:
    """Starts in any order, repeated, at row starts or not: the fields of a scan."""
    size = rows * width
    starts = data.draw(st.lists(st.integers(0, size - 1), max_size=3 * size))
    segments, positions = scanned(rows, width, set(starts))
    rows_too = data.draw(st.permutations(starts + list(range(0, size, width)) * 2))
    for got in (
        segment_fields((rows, width), np.array(rows_too, np.int64)),
        boundaries((rows, width), *np.divmod(np.array(starts, np.int64), width)),
    ):
        assert got[0].dtype == got[1].dtype == np.int32
        assert got[0].shape == got[1].shape == (rows, width)
        assert got[0].ravel().tolist() == segments
        assert got[1].ravel().tolist() == positions


@st.composite
def piece_sets(draw) -> tuple[int, list[tuple[int, int, int]]]:
    """A batch's width and the pieces (shard, lo, hi) that fill its rows, in row order."""
    sizes = [sum(shard) for shard in SHARDS]
    width, rows = draw(st.integers(1, 24)), draw(st.integers(1, 4))
    pieces = []
    for _ in range(rows):
        left = width
        while left:
            shard = draw(st.sampled_from([s for s, size in enumerate(sizes) if size]))
            length = draw(st.integers(1, min(left, sizes[shard])))
            lo = draw(st.integers(0, sizes[shard] - length))
            pieces.append((shard, lo, lo + length))
            left -= length
    return width, pieces


@SETTINGS
@given(piece_sets(), st.sampled_from(["end to end", "shuffled", "a gap"]), st.data())
def test_pieces_copy_as_each_read_alone(stores, batch, order: str, data) -> None:
    """`read_pieces` copies pieces that fill the batch end to end in one call, others one by
    one, from sidecars or records: each piece's tokens and document starts as its own read."""
    width, pieces = batch
    places = []
    for _, lo, hi in pieces:
        at = places[-1][1] if places else 0
        places.append((at, at + hi - lo))
    extra = width if order == "a gap" else 0  # a row left unwritten: the pieces' rows move
    if order == "shuffled":
        moved = data.draw(st.permutations(range(len(pieces))))
        pieces, places = [pieces[i] for i in moved], [places[i] for i in moved]
    elif order == "a gap":
        places = [(a + extra, b + extra) for a, b in places]
    rows = (places and max(b for _, b in places) // width) or 1
    starts = np.cumsum([0, *map(sum, SHARDS)])
    all_starts = set(doc_starts(SHARDS).tolist())
    for store in stores:
        out = np.full((rows, width), -1, np.int32)
        shards, lo, hi = (np.array(values, np.int64) for values in zip(*pieces))
        at = np.array([a for a, _ in places], np.int64)
        found_rows, found_cols = read_pieces(
            [store], np.zeros_like(shards), shards, lo, hi, out, at // width, at % width
        )
        expected = np.full(rows * width, -1, np.int64)
        expected_starts = set()
        for (shard, first, end), (a, b) in zip(pieces, places):
            tokens = np.arange(first, end) + starts[shard]
            expected[a:b] = tokens
            expected_starts |= {a + i for i, t in enumerate(tokens.tolist()) if t in all_starts}
        assert out.ravel().tolist() == expected.tolist()
        found = (found_rows * width + found_cols).tolist()
        assert sorted(found) == sorted(expected_starts)
        assert len(found) == len(set(found))


def layouts_of(seq_len: int, lanes: int, seed: int) -> list[SourceLayout]:
    return [
        SourceLayout(name, synthetic_meta(Path(name), shards), seed, seq_len, lanes)
        for name, shards in (("a", SHARDS), ("b", OTHER))
    ]


@SETTINGS
@given(
    st.integers(1, 40),
    st.sampled_from([1, 2]),
    st.integers(0, 2**31),
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 10**6)), min_size=1),
    st.booleans(),
)
def test_window_pieces_are_each_windows_pieces(seq_len, lanes, seed, draws, reverse) -> None:
    """Every window's pieces, in window order: those of its own stream (`SourceLayout.pieces`),
    whether every window lies in one shard or some span several, and under any order of the
    layouts passed (the sources are indexes into it)."""
    layouts = layouts_of(seq_len, lanes, seed)
    which, epochs, starts, expected = [], [], [], []
    for source, epoch, k in draws:
        layout = layouts[source]
        lane, window = k % lanes, k // lanes % layout.windows_per_lane
        start = lane * layout.lane_tokens + window * seq_len
        which.append(source), epochs.append(epoch), starts.append(start)
        column = 0
        for shard, lo, hi in layout.pieces(epoch, start, start + seq_len + 1):
            expected.append((source, shard, lo, hi, len(starts) - 1, column))
            column += hi - lo
    for order in ([0, 1], [1, 0]) if reverse else ([0, 1],):
        given_layouts = [layouts[i] for i in order]
        index = [order.index(source) for source in which]
        got = window_pieces(given_layouts, np.array(index), np.array(epochs), np.array(starts))
        owner, *rest = (values.tolist() for values in got)
        assert [order[k] for k in owner] == [piece[0] for piece in expected]
        assert list(zip(*rest)) == [piece[1:] for piece in expected]


@SETTINGS
@given(
    st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=6), min_size=1, max_size=6),
    st.integers(2, 8),
    st.integers(0, 2**31),
    st.data(),
)
def test_new_streams_laid_out_together_are_each_streams_own(shards, seq_len, seed, data) -> None:
    """A restore's first step finds the shard tables of many new (source, epoch) streams in
    one pass (`window_pieces` on fresh layouts): each window's pieces are still those of its
    own stream (`SourceLayout.pieces`), and so are a later step's, which finds them kept."""
    metas = [
        synthetic_meta(Path(f"s{k}"), [[t] for t in tokens]) for k, tokens in enumerate(shards)
    ]
    usable = [k for k, meta in enumerate(metas) if meta.num_tokens > seq_len]
    if not usable:
        return
    layouts = [SourceLayout(f"s{k}", metas[k], seed, seq_len, 1) for k in usable]
    draws = data.draw(
        st.lists(st.tuples(st.integers(0, len(usable) - 1), st.integers(0, 5), st.integers(0, 99)))
    )
    for _ in range(2):  # new layouts, then the same ones with their tables kept
        which, epochs, starts, expected = [], [], [], []
        for source, epoch, k in draws:
            layout = layouts[source]
            start = k % layout.windows_per_lane * seq_len
            which.append(source), epochs.append(epoch), starts.append(start)
            column = 0
            for shard, lo, hi in layout.pieces(epoch, start, start + seq_len + 1):
                expected.append((source, shard, lo, hi, len(starts) - 1, column))
                column += hi - lo
        if not draws:
            return
        got = window_pieces(layouts, np.array(which), np.array(epochs), np.array(starts))
        assert list(zip(*(values.tolist() for values in got))) == expected
