"""Properties of the keyed bijection behind every shard and window order."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.keys import keyed_digests, keyed_hash, keyed_hashes
from pipeline.plan import layout as layout_module
from pipeline.plan.layout import SourceLayout, keyed_order, warm_orders
from pipeline.plan.permutation import (
    FEW,
    MAX_N,
    ROUNDS,
    many_round_keys,
    orders,
    permutation,
    permutations,
    permute,
    round_keys,
)
from pipeline.store.meta import StoreMeta

SETTINGS = settings(max_examples=60, deadline=None)

PRIMES = [2, 3, 5, 7, 13, 31, 127, 8191, 65521]
POWERS = [2**b for b in range(0, 17)]
sizes = st.one_of(
    st.sampled_from(PRIMES + POWERS + [p + 1 for p in POWERS] + [p - 1 for p in POWERS[1:]]),
    st.integers(1, 5000),
)
keys = st.builds(round_keys, st.integers(0, 2**63), st.sampled_from(["a", "window-order"]))
huge = st.one_of(
    st.sampled_from([2**32, 2**32 + 1, 10**12, MAX_N - 1, MAX_N]), st.integers(1, MAX_N)
)


@SETTINGS
@given(sizes, keys)
def test_the_whole_order_is_a_bijection_on_0_to_n(n, key):
    order = permutation(n, key)
    assert order.dtype == np.int64 and order.shape == (n,)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))


@SETTINGS
@given(huge, keys, st.lists(st.integers(0, MAX_N - 1), min_size=1, max_size=200, unique=True))
def test_large_domains_map_distinct_indices_to_distinct_indices_in_range(n, key, picks):
    index = np.array(sorted({p % n for p in picks}), dtype=np.int64)
    out = permute(index, n, key)
    assert out.min() >= 0 and out.max() < n
    assert len(np.unique(out)) == len(index)


@SETTINGS
@given(st.one_of(sizes, huge), keys, st.lists(st.integers(0, MAX_N - 1), min_size=1, max_size=8))
def test_few_indices_in_plain_integers_equal_many_in_numpy(n, key, picks):
    few = np.array([p % n for p in picks], dtype=np.int64)
    many = np.resize(few, FEW + 1)  # over FEW: the vectorised walk
    np.testing.assert_array_equal(permute(many, n, key), np.resize(permute(few, n, key), FEW + 1))


@SETTINGS
@given(sizes, keys, st.data())
def test_any_indices_on_their_own_equal_the_whole_order(n, key, data):
    order = permutation(n, key)
    index = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * FEW)), np.int64)
    np.testing.assert_array_equal(permute(index, n, key), order[index])
    for i in index[:5].tolist():  # one index alone, as a draw at any step computes it
        assert permute(np.array([i]), n, key)[0] == order[i]
    grid = np.arange(n)[: n - n % 2].reshape(-1, 2) if n > 1 else np.zeros((1, 1), np.int64)
    np.testing.assert_array_equal(permute(grid, n, key), order[grid])  # any index shape


@SETTINGS
@given(sizes, st.lists(keys, min_size=1, max_size=4), st.data())
def test_per_index_keys_equal_one_call_per_key(n, key_list, data):
    which = np.array(data.draw(st.lists(st.integers(0, len(key_list) - 1), max_size=2 * FEW)))
    index = np.array([data.draw(st.integers(0, n - 1)) for _ in which], dtype=np.int64)
    per_index = np.array(key_list, dtype=np.uint64)[which.astype(np.int64)].reshape(-1, ROUNDS)
    expected = [permutation(n, key_list[w])[i] for w, i in zip(which.tolist(), index.tolist())]
    np.testing.assert_array_equal(permute(index, n, per_index), np.array(expected, np.int64))


@SETTINGS
@given(sizes, st.lists(keys, min_size=1, max_size=5))
def test_orders_of_several_keys_at_once_equal_each_key_alone(n, key_list):
    together = permutations(n, np.array(key_list, dtype=np.uint64))
    assert together.dtype == np.int64 and together.shape == (len(key_list), n)
    for key, order in zip(key_list, together):
        np.testing.assert_array_equal(order, permute(np.arange(n), n, key))


@SETTINGS
@given(st.lists(st.tuples(sizes, keys), min_size=1, max_size=6))
def test_orders_of_several_sizes_at_once_equal_each_alone(pairs):
    ns = [n for n, _ in pairs]
    together = orders(ns, np.array([key for _, key in pairs], dtype=np.uint64))
    for (n, key), order in zip(pairs, together, strict=True):
        assert order.dtype == np.int64
        np.testing.assert_array_equal(order, permute(np.arange(n), n, key))


@SETTINGS
@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2, 8, 31, 33, 64, 65, 127, 500]) | sizes, keys),
        min_size=1,
        max_size=80,
    )
)
def test_orders_of_a_restores_many_sources_equal_each_permutation(pairs):
    """A restore's first step computes dozens of orders of a few sizes at once (`orders`):
    each is the permutation of its own keys, whatever the others with it."""
    ns = [n for n, _ in pairs]
    together = orders(ns, np.array([key for _, key in pairs], dtype=np.uint64))
    for (n, key), order in zip(pairs, together, strict=True):
        np.testing.assert_array_equal(order, permutation(n, key))


@SETTINGS
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**63),
            st.sampled_from(["window-order", "shard-order", ""]),
            st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
        ),
        max_size=5,
    ),
    st.integers(1, 20),
)
def test_many_keys_hashed_into_one_buffer_equal_each_keys_hashes(names, count):
    digests = keyed_digests([(seed, purpose, *parts) for seed, purpose, parts in names], count)
    expected = [
        keyed_hash(seed, purpose, *parts, i) for seed, purpose, parts in names for i in range(count)
    ]
    assert np.frombuffer(digests, "<u8").tolist() == expected
    if count == ROUNDS:
        keys = many_round_keys([(seed, purpose, *parts) for seed, purpose, parts in names])
        assert keys.dtype == np.uint64 and keys.reshape(-1).tolist() == expected


def test_a_restores_orders_warmed_together_are_each_their_own_keys_order():
    """`warm_orders` computes the first draws' shard and window orders of many sources in one
    pass (no epoch before them kept): each is the permutation of its own round keys, of the
    drawn epoch alone (the next epochs' are computed when drawn), and each window order is
    the one its layout's draws find (`lane_order`)."""
    metas = [
        StoreMeta(Path(f"/w{k}"), f"f{k}", np.full(3 + k, 40 + k), np.dtype("uint32"), {})
        for k in range(5)
    ]
    layouts = [SourceLayout(f"warm-{k}", meta, 9, 8, 2) for k, meta in enumerate(metas)]
    drawn = [(k, 1000 + k, k % 2) for k in range(5)]
    warm_orders(layouts, drawn)
    for k, epoch, lane in drawn:
        layout = layouts[k]
        for purpose, part, n in (
            ("window-order", (lane,), layout.windows_per_lane),
            ("shard-order", (), layout.meta.num_shards),
        ):
            key = (9, purpose, layout.name, epoch, part, n)
            assert key in layout_module._orders  # computed by warm_orders, not on demand
            assert (9, purpose, layout.name, epoch + 1, part, n) not in layout_module._orders
            order = keyed_order(*key)
            np.testing.assert_array_equal(
                order, permute(np.arange(n), n, round_keys(9, purpose, layout.name, epoch, *part))
            )
            assert not order.flags.writeable
        assert layout.lane_order(epoch, lane) is keyed_order(
            9, "window-order", layout.name, epoch, (lane,), layout.windows_per_lane
        )


def test_cached_orders_computed_ahead_are_each_their_own_keys_order():
    """`keyed_order` computes a small order with the next epochs' in one pass: each later
    epoch's (found computed) is still the permutation of its own round keys, read-only."""
    for n, lane in ((1, ()), (8, ()), (31, (0,)), (500, (3,)), (5000, (1,))):
        for epoch in range(20):
            order = keyed_order(5, "window-order", f"ahead-{n}", epoch, lane, n)
            keys = round_keys(5, "window-order", f"ahead-{n}", epoch, *lane)
            np.testing.assert_array_equal(order, permute(np.arange(n), n, keys))
            assert not order.flags.writeable


@SETTINGS
@given(
    st.integers(0, 2**63),
    st.text(max_size=10),
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=4),
    st.integers(0, 8),
)
def test_keys_hashed_from_a_common_prefix_equal_whole_hashes(seed, purpose, parts, count):
    expected = [keyed_hash(seed, purpose, *parts, i) for i in range(count)]
    assert keyed_hashes(seed, purpose, *parts, count=count) == expected


@SETTINGS
@given(sizes, st.integers(0, 2**63), st.text(max_size=10), st.integers(0, 10**6))
def test_the_order_is_a_function_of_its_key_parts_only(n, seed, name, epoch):
    first = permutation(n, round_keys(seed, "window-order", name, epoch))
    again = permutation(n, round_keys(seed, "window-order", name, epoch))
    np.testing.assert_array_equal(first, again)


@SETTINGS
@given(st.integers(20, 5000), st.integers(0, 2**62), st.data())
def test_different_keys_give_different_orders(n, seed, data):
    other = data.draw(st.integers(0, 2**62).filter(lambda s: s != seed))
    purpose = data.draw(st.sampled_from(["window-order", "shard-order"]))
    base = permutation(n, round_keys(seed, purpose, "code", 0, 0))
    for key in (
        round_keys(other, purpose, "code", 0, 0),  # another seed
        round_keys(seed, purpose, "docs", 0, 0),  # another source
        round_keys(seed, purpose, "code", 1, 0),  # another epoch
        round_keys(seed, purpose, "code", 0, 1),  # another lane
    ):
        assert not np.array_equal(base, permutation(n, key))


@pytest.mark.parametrize("n", [4, 5])
def test_small_orders_are_close_to_uniform(n):
    """Every order of n items appears, each about 1/n! of 24,000 keys (chi-squared)."""
    trials = 24_000
    keys = np.array([round_keys(7, "uniform", t) for t in range(trials)], dtype=np.uint64)
    orders = permute(np.tile(np.arange(n), (trials, 1)), n, keys[:, None, :].repeat(n, axis=1))
    _, counts = np.unique(orders, axis=0, return_counts=True)
    assert len(counts) == math.factorial(n)  # odd orders too: no Feistel parity limit
    expected = trials / math.factorial(n)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    limit = {4: 50, 5: 170}[n]  # chi-squared with 23 / 119 degrees of freedom: p ~ 1e-3
    assert chi2 < limit


def test_the_algorithm_is_pinned():
    """Known answers from docs/data-plan.md: a reimplementation must give the same orders."""
    assert round_keys(0, "window-order", "code", 0, 0)[0] == 0xEE4BA6EF256BD7AC
    assert permutation(10, round_keys(0, "window-order", "code", 0, 0)).tolist() == [
        3, 4, 2, 0, 8, 9, 1, 5, 6, 7
    ]  # fmt: skip
    assert permutation(10, round_keys(1, "shard-order", "code", 0)).tolist() == [
        5, 3, 4, 2, 7, 6, 1, 9, 8, 0
    ]  # fmt: skip
    assert permute(np.array([0, 1, 10**11]), 10**12, round_keys(0, "x")).tolist() == [
        920099850582, 577329035140, 528229146536
    ]  # fmt: skip
