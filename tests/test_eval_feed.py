"""Eval feeds: a fixed set of full batches, the same every time, distinct windows, no padding."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.feed.eval_feed import eval_feeds
from pipeline.read.batch import FIELDS
from pipeline.store.columns_index import build_columns_index
from pipeline.store.megatron_format import write_megatron
from pipeline.store.megatron_index import build_index
from tests.storegen import write_synthetic_store
from tests.test_columns import positional_files, write_parquet


def config(tmp_path, batches=None, eval_docs=None):
    write_synthetic_store(tmp_path / "train", [[50, 30], [40, 40]])
    write_synthetic_store(tmp_path / "held", eval_docs or [[37, 21, 60], [44, 18, 29, 33]])
    raw = {
        "seed": 2, "seq_len": 7, "global_batch_size": 4,
        "sources": {"train": {"path": str(tmp_path / "train")}},
        "mix": {"train": 1},
        "eval": {"sources": {"held": {"path": str(tmp_path / "held")}}},
    }  # fmt: skip
    if batches is not None:
        raw["eval"]["batches"] = batches
    return parse_config(raw, origin="eval.yaml")


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def collect(feed) -> list[np.ndarray]:
    return [np.asarray(batch["inputs"]) for batch in feed]


def test_every_pass_yields_the_same_full_batches_of_distinct_windows(tmp_path, caplog):
    (feed,) = eval_feeds(config(tmp_path), mesh())
    windows = (242 - 1) // 7  # all 242 tokens of the held-out store, one lane
    assert feed.batches == windows // 4
    with caplog.at_level(logging.INFO, logger="pipeline"):
        first, second = collect(feed), collect(feed)
    assert len(first) == feed.batches
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    starts = [int(row[0]) for batch in first for row in batch]
    assert len(set(starts)) == len(starts), "an eval window repeats"
    assert not [r for r in caplog.records if r.name == "pipeline"], "eval resets are not events"
    feed.close()


def test_batches_caps_the_eval_set_and_a_tiny_store_is_refused(tmp_path):
    (feed,) = eval_feeds(config(tmp_path, batches=2), mesh())
    assert len(collect(feed)) == 2
    feed.close()
    with pytest.raises(ConfigError, match=r"eval.sources.held: 2 windows .* one batch of 4 rows"):
        eval_feeds(config(tmp_path / "small", eval_docs=[[9, 8]]), mesh())


@pytest.mark.parametrize("kind", ["megatron", "parquet"])
def test_an_eval_set_read_in_place(tmp_path, kind):
    """`eval.sources` take `format:` as training sources do; ids are stream positions, so each
    eval row is the window its first id names, cut where documents start."""
    lengths = [37, 21, 60, 44, 18, 29, 33]
    files, starts = positional_files([lengths])
    if kind == "megatron":
        write_megatron(tmp_path / "held", [[doc] for doc in files[0]])
        build_index(tmp_path / "held")
    else:
        write_parquet(tmp_path / "held", files)
        build_columns_index(tmp_path / "held")
    write_synthetic_store(tmp_path / "train", [[50, 30], [40, 40]])
    raw = {
        "seed": 2, "seq_len": 7, "global_batch_size": 4, "shared_vocabulary": True,
        "sources": {"train": {"path": str(tmp_path / "train")}},
        "mix": {"train": 1},
        "eval": {"sources": {"held": {"path": str(tmp_path / "held"), "format": kind}}},
    }  # fmt: skip
    (feed,) = eval_feeds(parse_config(raw, origin="eval.yaml"), mesh())
    windows = (sum(lengths) - 1) // 7
    assert feed.batches == windows // 4
    rows = [row for batch in feed for row in zip(*(np.asarray(batch[f]) for f in FIELDS))]
    feed.close()
    assert len(rows) == feed.batches * 4
    firsts = set()
    for inputs, targets, _, _, positions, _ in rows:
        first = int(inputs[0])
        assert first % 7 == 0 and first not in firsts
        firsts.add(first)
        np.testing.assert_array_equal(inputs, np.arange(first, first + 7))
        np.testing.assert_array_equal(targets, np.arange(first + 1, first + 8))
        restarts = [j for j in range(7) if j == 0 or first + j in starts]
        assert [j for j in range(7) if positions[j] == 0] == restarts
    raw["eval"]["sources"]["held"]["packing"] = "best_fit"
    with pytest.raises(ConfigError, match=r"eval.sources.held.*packing"):
        parse_config(raw, origin="eval.yaml")
