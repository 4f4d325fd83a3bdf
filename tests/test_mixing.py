"""The counting function behind every mixture: a real assignment that tracks its targets."""

from __future__ import annotations

import gc
import weakref

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.plan.mixing import Mixture, Steered, mixture_of

weights = st.floats(0.0, 10.0, allow_nan=False)


@st.composite
def mixtures(draw, max_sources=5):
    sources = draw(st.integers(1, max_sources))
    horizon = draw(st.integers(0, 20))
    rows = draw(st.integers(1, 6))
    matrix = np.array(draw(st.lists(st.lists(weights, min_size=sources, max_size=sources),
                                    min_size=horizon, max_size=horizon)), dtype=float)  # fmt: skip
    matrix = matrix.reshape(horizon, sources)
    matrix[matrix.sum(axis=1) == 0, 0] = 1.0
    tail = np.array(draw(st.lists(weights, min_size=sources, max_size=sources)))
    tail[0] += 0.5
    return matrix, tail, rows


def targets(matrix: np.ndarray, tail: np.ndarray, rows: int, positions: int) -> np.ndarray:
    steps = -(-positions // rows)
    per_step = np.vstack([matrix, np.tile(tail, (max(steps - len(matrix), 0), 1))])[:steps]
    per_row = np.repeat(per_step / per_step.sum(axis=1, keepdims=True), rows, axis=0)
    return np.vstack([np.zeros(len(tail)), np.cumsum(per_row, axis=0)])[: positions + 1]


@settings(max_examples=200, deadline=None)
@given(mixtures())
def test_counts_are_a_real_assignment(mix):
    mixture = Mixture(*mix)
    counts = mixture.counts(np.arange(200))
    steps = np.diff(counts, axis=0)
    assert (steps >= 0).all()
    assert (steps.sum(axis=1) == 1).all()
    source, before = mixture.sources(np.arange(199))
    np.testing.assert_array_equal(before, counts[np.arange(199), source])


@settings(max_examples=200, deadline=None)
@given(mixtures(max_sources=2))
def test_two_sources_stay_within_half_a_row_of_their_share(mix):
    counts = Mixture(*mix).counts(np.arange(301))
    assert np.abs(counts - targets(*mix, 300)).max() <= 0.5 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=4), st.integers(1, 8))
def test_constant_weights_stay_within_one_row(tail, rows):
    tail = np.array(tail)
    mix = (np.zeros((0, len(tail))), tail, rows)
    counts = Mixture(*mix).counts(np.arange(501))
    assert np.abs(counts - targets(*mix, 500)).max() < 1.0


@settings(max_examples=300, deadline=None)
@given(mixtures())
def test_any_schedule_stays_within_its_proven_bound(mix):
    mixture = Mixture(*mix)
    error = np.abs(mixture.counts(np.arange(301)) - targets(*mix, 300)).max(axis=0)
    assert (error <= mixture.error_bounds() + 1e-9).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4), st.integers(1, 8))
def test_constant_weights_have_a_bound_below_one_row(tail, rows):
    mixture = Mixture(np.zeros((0, len(tail))), np.array(tail), rows)
    assert (mixture.error_bounds() < 1.0).all()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 50), st.integers(1, 8), st.integers(2, 4))
def test_a_step_change_switches_at_the_first_row_of_its_step(switch, rows, sources):
    matrix = np.zeros((switch, sources))
    matrix[:, 0] = 1.0  # source 0 only, then the others only from step `switch`
    tail = np.ones(sources)
    tail[0] = 0.0
    source, _ = Mixture(matrix, tail, rows).sources(np.arange((switch + 3) * rows))
    assert (source[: switch * rows] == 0).all()
    assert (source[switch * rows :] != 0).all()


def test_far_positions_cost_what_near_ones_cost_and_agree_with_the_tail():
    mixture = Mixture(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1.0, 3.0]), 4)
    far = 10**12
    counts = mixture.counts(np.array([far]))[0]
    assert counts.sum() == far
    assert abs(counts[1] - (4 + (far - 8) * 0.75)) <= 0.5 + 1e-6


def grown(mixture: Mixture | Steered, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, its count before) of each position as every source's count defines it: the
    source whose count grows over the position (what `sources` finds walking one path)."""
    before, after = mixture.counts(np.stack([positions, positions + 1]))
    assert ((after - before).sum(axis=-1) == 1).all()
    source = np.argmax(after - before, axis=-1)
    return source, before[np.arange(positions.size), source]


@settings(max_examples=100, deadline=None)
@given(mixtures(max_sources=40), st.integers(0, 10**12))
def test_a_rows_walk_down_the_tree_finds_the_source_whose_count_grows(mix, far):
    mixture = Mixture(*mix)
    # every position of the pieces and their boundaries, and far ones (the tail)
    positions = np.concatenate([np.arange(200), far + np.arange(50)])
    source, before = mixture.sources(positions)
    expected = grown(mixture, positions)
    np.testing.assert_array_equal(source, expected[0])
    np.testing.assert_array_equal(before, expected[1])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(weights, min_size=2, max_size=300),
    st.integers(1, 64),
    st.sampled_from([0, 10**6, 10**12, 2**50]),
)
def test_a_constant_mixtures_walk_finds_the_source_whose_count_grows(tail, rows, far):
    # constant weights walk the tree on their own path (`descend_constant`): what `counts`
    # says, bit for bit, for any number of sources and positions up to 2^50
    tail = np.array(tail)
    tail[0] += 0.5
    mixture = Mixture(np.zeros((0, len(tail))), tail, rows)
    positions = far + np.arange(64)
    source, before = mixture.sources(positions)
    expected = grown(mixture, positions)
    np.testing.assert_array_equal(source, expected[0])
    np.testing.assert_array_equal(before, expected[1])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 40),
    st.lists(st.tuples(st.integers(1, 12), st.integers(0, 2**31 - 1)), min_size=1, max_size=4),
    st.integers(1, 4),
)
def test_a_steered_rows_walk_finds_the_source_whose_count_grows(sources, sets, rows):
    base = Mixture(np.zeros((0, sources)), np.arange(1.0, sources + 1), rows)
    steps = np.cumsum([gap for gap, _ in sets])
    seeds = [np.random.default_rng(seed) for _, seed in sets]
    weights = np.array([rng.integers(0, 6, sources) for rng in seeds])  # small: ties round
    weights[:, 0] += 1  # no piece without weight
    mixture = Steered(base, steps, steps * rows, weights)
    positions = np.arange(int(steps[-1] + 5) * rows)
    source, before = mixture.sources(positions)
    expected = grown(mixture, positions)
    np.testing.assert_array_equal(source, expected[0])
    np.testing.assert_array_equal(before, expected[1])


def node_by_node(mixture: Mixture) -> list[tuple]:
    """The splits as `Mixture` built them before it built a level at a time: each node on its
    own, in pre-order (the reference its level-at-a-time build must equal bit for bit)."""
    pieces, out = mixture._pieces, []

    def build(lo: int, hi: int, count: np.ndarray) -> None:
        if hi - lo == 1:
            return
        mid = (lo + hi) // 2
        left = pieces[:, lo:mid].sum(axis=1)
        total = left + pieces[:, mid:hi].sum(axis=1)
        omega = np.divide(left, total, out=np.zeros_like(total), where=total > 0)
        cum_omega = np.zeros(len(mixture.piece_starts))
        np.cumsum(omega[:-1] * np.diff(count), out=cum_omega[1:])
        out.append((lo, mid, hi, omega, cum_omega, count))
        left_count = np.floor(cum_omega + 0.5).astype(np.int64)
        build(lo, mid, left_count)
        build(mid, hi, count - left_count)

    build(0, mixture.num_sources, mixture.piece_starts)
    return out


# a random mixture's (sources, pieces, rows, seed, kind), as `random_mixture` takes them
RANDOM_MIXTURES = given(
    st.integers(1, 300),
    st.integers(0, 3),
    st.integers(1, 64),
    st.integers(0, 2**32),
    st.sampled_from(["uniform", "integers", "sparse"]),
)


@settings(max_examples=40, deadline=None)
@RANDOM_MIXTURES
def test_the_tree_built_a_level_at_a_time_is_the_tree_built_node_by_node(
    sources, pieces, rows, seed, kind
):
    mixture = random_mixture(sources, pieces, rows, seed, kind)
    got = [(s.lo, s.mid, s.hi, s.omega, s.cum_omega, s.count) for s in mixture._splits]
    want = node_by_node(mixture)
    assert len(got) == len(want) == sources - 1
    for g, w in zip(got, want, strict=True):
        assert g[:3] == w[:3]
        for a, b in zip(g[3:], w[3:], strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@settings(max_examples=40, deadline=None)
@RANDOM_MIXTURES
def test_counts_a_level_at_a_time_are_the_counts_node_by_node(sources, pieces, rows, seed, kind):
    mixture = random_mixture(sources, pieces, rows, seed, kind)
    positions = np.random.default_rng(seed).integers(0, 10**7, (3, 4))
    want = {(0, sources): positions}  # each node's split of the rows it received, in pre-order
    for split in mixture._splits:
        count = want.pop((split.lo, split.hi))
        step = np.searchsorted(mixture.piece_starts, positions, side="right") - 1
        cum = split.cum_omega[step] + split.omega[step] * (count - split.count[step])
        left = np.floor(cum + 0.5).astype(np.int64)
        want[split.lo, split.mid], want[split.mid, split.hi] = left, count - left
    got = mixture.counts(positions)
    assert got.shape == (3, 4, sources) and got.dtype == np.int64
    for (lo, _), count in want.items():
        assert np.array_equal(got[..., lo], count)
    assert np.array_equal(mixture.counts(positions[0, 1]), got[0, 1])


def random_mixture(sources: int, pieces: int, rows: int, seed: int, kind: str) -> Mixture:
    """A mixture of `sources` and `pieces` pieces whose weights are of `kind`."""
    rng = np.random.default_rng(seed)
    weights = {
        "uniform": lambda: rng.random((pieces + 1, sources)) * 10.0 ** rng.integers(-3, 4),
        "integers": lambda: rng.integers(0, 5, (pieces + 1, sources)).astype(float),
        "sparse": lambda: (
            rng.random((pieces + 1, sources)) * (rng.random((pieces + 1, sources)) < 0.1)
        ),
    }[kind]()
    weights[:, 0] += 1  # no step without weight
    starts = np.cumsum(rng.integers(1, 50, pieces)) if pieces else np.zeros(0, np.int64)
    horizon = int(starts[-1]) + 7 if pieces else 0
    return Mixture(weights[:-1], weights[-1], rows, starts, horizon)


@settings(max_examples=50, deadline=None)
@given(mixtures(max_sources=9), st.integers(0, 10**6))
def test_a_mixture_of_the_same_numbers_is_made_once_and_counts_as_a_fresh_one(mix, far):
    """A feed lays its config out again (adopt, set_mix, another feed): the mixture of the
    same numbers is the one made before while it is held (`mixture_of`), shared read-only,
    and counts and draws what a mixture made afresh does; other numbers make another, and
    one that nothing holds any more is not kept."""
    matrix, tail, rows = mix
    kept = mixture_of(matrix, tail, rows)
    assert mixture_of(matrix.copy(), tail.copy(), rows) is kept
    assert not kept.weights.flags.writeable and not kept._tree.children.flags.writeable
    fresh = Mixture(matrix, tail, rows)
    positions = far + np.arange(64)
    np.testing.assert_array_equal(kept.counts(positions), fresh.counts(positions))
    for got, want in zip(kept.sources(positions), fresh.sources(positions)):
        np.testing.assert_array_equal(got, want)
    other = tail.copy()
    other[-1] += 1.0
    assert mixture_of(matrix, other, rows) is not kept
    gone = weakref.ref(kept)
    del kept
    gc.collect()
    assert gone() is None  # the cache does not keep it
