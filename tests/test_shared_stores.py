"""Feeds of one process share their open stores while the files are unchanged."""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.feed import shared_stores
from pipeline.feed.data_feed import DataFeed
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_config
from tests.storegen import write_synthetic_store


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("data",))


def assert_batch(feed: DataFeed, plan: Plan) -> None:
    step = feed.step
    batch = next(feed)
    expected = plan.batch(step)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(batch[field]), expected[field], err_msg=field)


def by_path(feed: DataFeed) -> dict:
    return {store.path: store for store in feed.plan.stores()}


def test_a_second_feed_reads_through_the_first_feeds_open_stores(tmp_path):
    config = two_stage_config(tmp_path)
    plan = Plan.from_config(config)
    first = DataFeed(config, mesh())
    assert_batch(first, plan)
    opened = {path: list(store._opened) for path, store in by_path(first).items()}
    second = DataFeed(config, mesh(), step=5)
    assert_batch(second, plan)  # opens the stores it draws (at their first draw): the first's
    shared = by_path(second)
    assert shared and all(store is by_path(first)[path] for path, store in shared.items())
    # the shards the first feed checked stay checked: the second opens none of them again
    assert all(list(store._opened) >= opened[path] for path, store in shared.items())
    first.close()  # the second feed still holds the stores: they stay open
    assert all(shared_stores.holds(store) for store in shared.values())
    assert_batch(second, plan)
    second.close()  # the last one closes them
    assert not any(shared_stores.holds(store) for store in shared.values())
    assert not any(any(store._opened) for store in shared.values())
    with DataFeed(config, mesh()) as third:  # a later feed opens them afresh
        assert all(store is not shared[store.path] for store in third.plan.stores())
        assert_batch(third, plan)


def test_a_store_whose_files_changed_is_opened_anew(tmp_path):
    config = two_stage_config(tmp_path)
    plan = Plan.from_config(config)
    with DataFeed(config, mesh()) as first:
        assert_batch(first, plan)
        store = next(iter(first.plan.stores()))
        shard = store.shard_file(store._opened.index(True))  # one it has used
        stat = shard.stat()
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place
        with DataFeed(config, mesh()) as second:
            assert_batch(second, plan)  # the stores it draws opened: its first batch's
            fresh = by_path(second)[store.path]
            assert fresh is not store
            others = [s for s in second.plan.stores() if s.path != store.path]
            assert all(s is by_path(first)[s.path] for s in others)
            assert_batch(second, plan)
        assert shared_stores.holds(store)  # the first feed keeps reading its own
        assert_batch(first, plan)
    assert not shared_stores.holds(store)


def test_a_feed_never_closed_hands_its_stores_back_when_collected(tmp_path):
    config = two_stage_config(tmp_path)
    feed = DataFeed(config, mesh())
    next(feed)
    stores = feed.plan.stores()
    assert all(shared_stores.holds(store) for store in stores)
    del feed
    gc.collect()
    assert not any(shared_stores.holds(store) for store in stores)


def released(path) -> bool:
    """Whether no feed holds a store at `path`: a store acquired now is fresh, and the last
    user once released (a leaked one would be taken, and still held after)."""
    store = shared_stores.acquire(path)
    shared_stores.release(store)
    return not shared_stores.holds(store)


def test_a_plan_that_fails_hands_back_the_stores_its_layout_opened(tmp_path):
    """A best-fit layout opens its store to read the document lengths; a plan that then
    fails (3 documents cannot make a row per lane of 8) hands that store back."""
    path = tmp_path / "few"
    write_synthetic_store(path, [[5, 9, 3]]).close()
    raw = {
        "seed": 1, "seq_len": 16, "global_batch_size": 8, "lanes": 8,
        "sources": {"sft": {"path": str(path), "packing": "best_fit"}}, "mix": {"sft": 1},
    }  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be split evenly over 8 lanes"):
        DataFeed(parse_config(raw, origin="few.yaml"), mesh())
    assert released(path)


def test_a_store_opened_twice_into_one_set_is_handed_back_once_for_each_opening(tmp_path):
    """Two sources of one path in a feed's plan: the set keeps one store, and handing the set
    back releases both openings (the second was held for the life of the process)."""
    path = tmp_path / "twice"
    write_synthetic_store(path, [[5, 9, 3]]).close()
    held = shared_stores.store_set(check_reads=True)
    first, second = held.open_now(path), held.open_now(path)
    assert second is first and held.stores() == [first]
    shared_stores.release_all(held)
    assert not shared_stores.holds(first)
