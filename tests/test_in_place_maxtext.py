"""Corpora read in place (Megatron, Parquet/Arrow) through the MaxText iterator (the feed, on
CPU devices)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

from pipeline.config import load_config
from pipeline.maxtext.adapter import create_data_iterator
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store.columns_index import build_columns_index
from pipeline.store.megatron_format import write_megatron
from pipeline.store.megatron_index import build_index
from tests.test_columns import write_parquet
from tests.test_maxtext import maxtext_config


def write_corpus(tmp_path, kind: str) -> dict:
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, 300, rng.integers(2, 30)).tolist(), 0] for _ in range(120)]
    if kind == "megatron":
        write_megatron(tmp_path / "corpus", [[doc] for doc in docs])
        build_index(tmp_path / "corpus")
    else:
        write_parquet(tmp_path / "corpus", [docs[:50], docs[50:]], row_group_size=16)
        build_columns_index(tmp_path / "corpus")
    return {"path": "corpus", "format": kind}


@pytest.mark.parametrize("kind", ["megatron", "parquet"])
def test_the_maxtext_iterator_serves_the_planned_rows_of_a_corpus_read_in_place(tmp_path, kind):
    raw = {
        "seed": 5, "seq_len": 8, "global_batch_size": 8, "lanes": 4,
        "sources": {"c": write_corpus(tmp_path, kind)}, "mix": {"c": 1.0},
    }  # fmt: skip
    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(yaml.safe_dump(raw))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
    plan = Plan.from_config(load_config(data_yaml))
    train, evals = create_data_iterator(maxtext_config(data_yaml, eval_interval=-1), mesh)
    try:
        for step in range(6):
            batch = next(train)
            expected = plan.batch(step)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), expected[field])
    finally:
        for iterator in (train, evals):
            if iterator is not None:
                iterator.close()
