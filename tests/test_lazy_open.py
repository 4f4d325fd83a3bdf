"""A feed opens a local store at its first draw: a restore's work follows the sources its
first steps draw, not the mixture's, and a store damaged or replaced since the plan read its
manifest is still refused, in one line naming the file, at that first draw."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pipeline.config import parse_config
from pipeline.errors import FeedError
from pipeline.feed.data_feed import DataFeed
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store
from tests.test_shared_stores import released

SOURCES, SHARDS, RESTORE = 48, 4, 10**6


def mixture_raw(root: Path) -> dict:
    """48 small stores of distinct contents, 8 rows a step: a step draws from at most 8."""
    sources = {}
    for k in range(SOURCES):
        path = root / f"s{k:02d}"
        shards = [[5 + (k + s) % 7, 9, 3 + s] for s in range(SHARDS)]
        write_synthetic_store(path, shards, first=1000 * k).close()
        sources[f"s{k:02d}"] = {"path": str(path)}
    return {
        "seed": 5,
        "seq_len": 8,
        "global_batch_size": 8,
        "lanes": 2,
        "sources": sources,
        "mix": {name: 1 + k % 3 for k, name in enumerate(sources)},
    }


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> tuple[dict, Plan]:
    """The mixture's config and its plan (every store opened: the reference batches)."""
    raw = mixture_raw(tmp_path_factory.mktemp("lazy"))
    plan = Plan.from_config(parse_config(raw, origin="lazy.yaml"))
    yield raw, plan
    for store in plan.stores():
        store.close()


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("data",))


def drawn(plan: Plan, steps: range) -> set[str]:
    """The store paths the rows of `steps` draw from."""
    names = plan.config.source_names
    paths = {name: plan.config.source(name).path for name in names}
    return {str(paths[names[s]]) for step in steps for s in plan.draws(step).source.tolist()}


def test_a_restore_opens_only_the_stores_its_steps_draw(mixture):
    raw, plan = mixture
    config = parse_config(raw, origin="lazy.yaml")
    with DataFeed(config, mesh(), step=RESTORE, prefetch=1) as feed:
        assert feed.plan.stores() == []  # planned from the manifests alone: no store open yet
        for step in range(RESTORE, RESTORE + 3):
            batch = next(feed)
            want = plan.batch(step)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), want[field])
            opened = {str(store.path) for store in feed.plan.stores()}
            # the steps read so far and at most the one prefetched: never the mixture
            assert drawn(plan, range(RESTORE, step + 1)) <= opened
            assert opened <= drawn(plan, range(RESTORE, step + 2))
            assert len(opened) <= 8 * (step + 2 - RESTORE) < SOURCES


def first_draw(plan: Plan, name: str) -> int:
    """The first step from `RESTORE` on that draws from source `name`."""
    index = plan.config.source_names.index(name)
    return next(s for s in range(RESTORE, RESTORE + 1000) if index in plan.draws(s).source)


def feed_until_error(config, stop: int, damage) -> tuple[int, str]:
    """Feed from `RESTORE`, `damage()` done once the feed is planned, until a step fails
    (never past `stop`): that step and its line."""
    with DataFeed(config, mesh(), step=RESTORE, prefetch=1) as feed:
        damage()
        for step in range(RESTORE, stop + 1):
            try:
                next(feed)
            except FeedError as error:
                return step, str(error)
    raise AssertionError(f"no step up to {stop} failed")


def truncate(path: Path) -> None:
    for shard in path.glob("shard-*.array_record"):
        with shard.open("r+b") as file:
            file.truncate(shard.stat().st_size - 1)


def replace(path: Path) -> None:
    """A store of other content prepared where it was."""
    shutil.rmtree(path)
    write_synthetic_store(path, [[5, 9, 3 + s] for s in range(SHARDS)], first=7).close()


@pytest.mark.parametrize(
    ("damage", "line"),
    [
        (truncate, r"array_record: \d+ bytes, the manifest says \d+; the shard is truncated"),
        (replace, "the store has content fingerprint .* the ledger recorded"),
    ],
)
def test_a_store_changed_after_the_plan_is_refused_at_its_first_draw(tmp_path, damage, line):
    raw = mixture_raw(tmp_path)
    plan = Plan.from_config(parse_config(raw, origin="lazy.yaml"))
    name = max(plan.config.source_names, key=lambda n: first_draw(plan, n))  # drawn last
    at = first_draw(plan, name)
    for store in plan.stores():
        store.close()
    path = Path(raw["sources"][name]["path"])
    config = parse_config(raw, origin="lazy.yaml")
    step, found = feed_until_error(config, at, lambda: damage(path))
    assert step == at  # the steps before read nothing of it; its first draw stops the feed
    assert "\n" not in found
    prefix = f"step {at}: cannot read the batch: lazy.yaml: sources.{name}.path: {path}"
    assert found.startswith(prefix), found
    assert re.search(line, found), found
    assert released(path)  # the store refused at its first draw too: no feed holds it
