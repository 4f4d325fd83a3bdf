"""Property tests of the transitional epoch (`plan.transition`, `plan.repack`): random stores,
seq_len and lanes before and after, switch points, and a second switch inside the transitional
epoch. Inside each epoch no edge (pair of consecutive stream tokens) is served twice, so no
token sequence is; what an epoch never serves is under the lane tails (`lanes * seq_len` tokens
of the layout it ends in); a best_fit epoch uses every document exactly once."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.plan.ledger import Ledger, Segment, config_mapping
from pipeline.plan.plan import DrawPlan
from tests.storegen import synthetic_meta, write_synthetic_store

geometry = st.tuples(st.integers(2, 40), st.integers(1, 4))  # (seq_len, lanes)


def config(path: Path, seq_len: int, lanes: int, packing: str = "concat") -> dict:
    raw = {
        "seed": 9, "seq_len": seq_len, "lanes": lanes, "global_batch_size": lanes,
        "sources": {"s": {"path": str(path), "packing": packing}},
        "stages": [{"name": "all", "mix": {"s": 1}}],
    }  # fmt: skip
    return config_mapping(parse_config(raw, origin="t.yaml"))


def plan_of(path: Path, metas: list, geometries: list, fractions: list[float], packing: str):
    """A one-source run (one row per lane per step, so the counter is the step) switched to
    each next geometry at a point `fractions` of the way through the epoch it is in."""
    fingerprint = {"s": metas[0].fingerprint}
    ledger = Ledger((Segment(0, config(path, *geometries[0], packing), fingerprint, {"s": 0}),))
    step = 0
    for (seq_len, lanes), fraction in zip(geometries[1:], fractions):
        layout = DrawPlan(ledger, metas).segment_plan(len(ledger.segments) - 1).layouts["s"]
        epoch = layout.epoch_of(step)
        into = int(fraction * layout.epoch_windows(epoch))
        step = max(step + 1, layout.epoch_start(epoch) + into)
        segment = Segment(step, config(path, seq_len, lanes, packing), fingerprint, {"s": step})
        ledger = Ledger((*ledger.segments, segment))
    return DrawPlan(ledger, metas), step


def tails(plan: DrawPlan, stop: int) -> dict[int, int]:
    """Per epoch, the documented bound on the tokens it leaves out: lanes * (seq_len + 1) of
    the geometry in force where it ends (of the last layout that drew from it, or of the one
    that drew next, when a switch came right at its end)."""
    bound: dict[int, int] = defaultdict(int)
    for step in range(stop):
        draws = plan.draws(step)
        layout = plan.segment_plan(draws.segment_index).layouts["s"]
        for epoch in np.unique(draws.epoch).tolist():
            for e in (epoch, epoch - 1):
                bound[e] = max(bound[e], layout.lanes * (layout.seq_len + 1))
    return bound


def stream_positions(layout, epoch: int, start: int) -> np.ndarray:
    """The epoch stream positions of the window at `start` (of its epoch's own stream)."""
    order, bounds, _ = layout.stream_shards(epoch)
    where = {int(shard): int(bounds[i]) for i, shard in enumerate(order)}
    pieces = layout.pieces(epoch, start, start + layout.seq_len + 1)
    return np.concatenate([np.arange(lo, hi) + where[s] for s, lo, hi in pieces])


def edges_served(plan: DrawPlan, stop: int) -> tuple[dict, dict]:
    """Per epoch: every served window's stream edges and tokens (positions in the epoch
    stream, through the shard table of the epoch's whole stream)."""
    edges, tokens = defaultdict(list), defaultdict(list)
    for step in range(stop):
        draws = plan.draws(step)
        layout = plan.segment_plan(draws.segment_index).layouts["s"]
        for epoch, start in zip(draws.epoch.tolist(), draws.start.tolist()):
            positions = stream_positions(layout, epoch, start)
            assert positions.size == layout.seq_len + 1
            real = np.flatnonzero(np.diff(positions) == 1)
            edges[epoch].append(positions[real])
            tokens[epoch].append(positions)
    return edges, tokens


@settings(max_examples=60, deadline=None)
@given(
    shards=st.lists(st.lists(st.integers(1, 80), min_size=1, max_size=12), min_size=1, max_size=4),
    geometries=st.lists(geometry, min_size=2, max_size=3),
    fractions=st.lists(st.floats(0.0, 0.99), min_size=2, max_size=2),
)
def test_concat_transitions_serve_each_edge_once_and_leave_only_lane_tails(
    shards, geometries, fractions
):
    path = Path("/nonexistent/s")
    meta = synthetic_meta(path, shards)
    need = max(lanes * (seq_len + 1) for seq_len, lanes in geometries)
    assume(meta.num_tokens >= need)  # else refused as too small (tests/test_plan.py)
    plan, last = plan_of(path, [meta], geometries, fractions, "concat")
    final = plan.segment_plan(len(plan.ledger.segments) - 1).layouts["s"]
    ended = final.epoch_of(last) + 1  # epochs before it end inside the range
    stop = final.epoch_start(ended) + 1
    edges, tokens = edges_served(plan, stop)
    bound = tails(plan, stop)
    for epoch, mine in edges.items():
        flat = np.concatenate(mine)
        assert flat.size == np.unique(flat).size, f"epoch {epoch}: an edge served twice"
        if epoch < ended:
            left = meta.num_tokens - np.unique(np.concatenate(tokens[epoch])).size
            assert left < bound[epoch], (epoch, left)


@pytest.fixture(scope="module")
def packed_stores(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("packed")
    paths = []
    for index, docs in enumerate((30, 70, 140)):
        path = root / f"s{index}"
        write_synthetic_store(path, [rng.integers(1, 50, docs).tolist() for _ in range(2)])
        paths.append(path)
    return paths


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.integers(0, 2),
    geometries=st.lists(geometry, min_size=2, max_size=3),
    fractions=st.lists(st.floats(0.0, 0.99), min_size=2, max_size=2),
)
def test_best_fit_transitions_use_every_document_once_per_epoch(
    packed_stores, which, geometries, fractions
):
    from pipeline.store.token_store import TokenStore

    store = TokenStore(packed_stores[which])
    try:
        plan, last = plan_of(store.path, [store], geometries, fractions, "best_fit")
        final = plan.segment_plan(len(plan.ledger.segments) - 1).layouts["s"]
    except ConfigError:  # rows that cannot be split evenly over the lanes: refused
        reject()
    ended = final.epoch_of(last) + 1
    used = defaultdict(list)
    for step in range(final.epoch_start(ended)):
        draws = plan.draws(step)
        layout = plan.segment_plan(draws.segment_index).layouts["s"]
        for epoch, row in zip(draws.epoch.tolist(), draws.window.tolist()):
            used[epoch].append(layout.documents_of(np.array([row])))
    slots = final.doc_tokens - 1  # at the longest seq_len of the run, the most a tail holds
    longest = max(seq_len for seq_len, _ in geometries)
    for epoch in range(ended):
        counts = np.bincount(np.concatenate(used[epoch]), minlength=store.num_documents)
        assert counts.max() == 1, (epoch, np.flatnonzero(counts > 1)[:8])
        # left out: fewer than `lanes` rows of a transitional packing (its lane tails)
        left = np.minimum(slots[counts == 0], longest).sum()
        assert left < max(lanes for _, lanes in geometries) * longest, (epoch, left)


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.tuples(st.integers(0, 990), st.integers(1, 60)), min_size=1, max_size=5),
    counter=st.integers(1, 60),
)
def test_removed_token_ranges_are_left_out_of_the_transitional_epoch(cuts, counter):
    """The hook for documents taken down: the ranges of the epoch stream the new layout
    removes (`removed_ranges`) are in no window of the transitional epoch (nor are the
    windows served before it)."""
    from pipeline.plan.layout import SourceLayout
    from pipeline.plan.transition import merged, relaid, served

    removed = (np.array([a for a, _ in cuts]), np.array([a + n for a, n in cuts]))

    class Removing(SourceLayout):
        def removed_ranges(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
            return merged(*removed)

    meta = synthetic_meta(Path("/nonexistent/s"), [[50] * 10, [30] * 10])  # 800 tokens
    before = SourceLayout("s", meta, 9, 8, 1)
    after = Removing("s", meta, 9, 16, 2)
    epoch, taken = served(before, counter)
    relaid(before, after, counter)
    transition = after.transition
    assume(transition is not None)
    gone = np.zeros(meta.num_tokens + 1, bool)
    for a, b in zip(*removed):
        gone[a:b] = True
    edges = np.zeros(meta.num_tokens, bool)
    for a, b in zip(*taken):
        edges[a:b] = True
    for lane in range(after.lanes):
        for window in range(transition.windows):
            start = lane * transition.lane_tokens + window * after.seq_len
            positions = stream_positions(after, epoch, start)
            assert not gone[positions].any()
            real = positions[:-1][np.diff(positions) == 1]
            assert not edges[real].any()  # no edge served before the switch
