"""Grain interoperability: the host's rows as a MapDataset, with a Grain map chained on."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.feed.grain_source import host_dataset
from pipeline.plan.plan import Plan, host_rows
from tests.storegen import write_synthetic_store


def make_plan(tmp_path, batch=4) -> Plan:
    write_synthetic_store(tmp_path / "a", [[40, 13, 22], [31, 9]])
    write_synthetic_store(tmp_path / "b", [[17, 50], [12, 12, 12]])
    raw = {
        "seed": 5, "seq_len": 6, "global_batch_size": batch, "lanes": 2,
        "sources": {"a": {"path": str(tmp_path / "a")}, "b": {"path": str(tmp_path / "b")}},
        "mix": {"a": 2, "b": 1},
    }  # fmt: skip
    return Plan.from_config(parse_config(raw, origin="grain.yaml"))


def test_a_batch_schedule_is_refused_in_favour_of_the_feed(tmp_path):
    plan = make_plan(tmp_path, batch={"step": {0: 4, 3: 8}})
    with pytest.raises(ConfigError, match=r"^grain\.yaml: global_batch_size is a schedule; "):
        host_dataset(plan)


def test_map_dataset_elements_are_the_hosts_rows_in_step_order(tmp_path):
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, process_index=1, process_count=2, first_step=3, num_steps=5)
    assert len(dataset) == 5 * 2
    rows = host_rows(4, 1, 2)
    for index in (0, 1, 2, 9, 5):
        step, row = divmod(index, 2)
        expected = plan.batch(3 + step, rows[row : row + 1])
        for field, value in dataset[index].items():
            np.testing.assert_array_equal(value, expected[field][0])


def test_grain_transforms_chain_on_the_dataset(tmp_path):
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, num_steps=3).map(
        lambda example: {**example, "tokens_sum": int(example["inputs"].sum())}
    )
    batched = dataset.batch(4)
    first = batched[0]
    whole = plan.batch(0)
    np.testing.assert_array_equal(first["inputs"], whole["inputs"])
    assert first["tokens_sum"].tolist() == whole["inputs"].sum(axis=1).tolist()
    assert [element["tokens_sum"] for element in dataset.to_iter_dataset()][:4] == (
        whole["inputs"].sum(axis=1).tolist()
    )


def test_a_transform_cannot_write_into_a_row_and_change_its_other_fields(tmp_path):
    """`inputs` and `targets` are overlapping views of one buffer (so are the segment and the
    position pairs): writing a target in place would change an input. The fields are read-only;
    a transform that copies first changes only its copy."""
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, num_steps=2)

    def mask_first_target(example):
        example["targets"][0] = -1
        return example

    with pytest.raises(ValueError, match="read-only"):
        dataset.map(mask_first_target)[0]
    for field in plan.batch(0):
        with pytest.raises(ValueError, match="read-only"):
            plan.batch(0)[field][0, 0] = -1

    def copy_then_mask(example):
        example = {**example, "targets": example["targets"].copy()}
        example["targets"][0] = -1
        return example

    masked = dataset.map(copy_then_mask)[1]
    np.testing.assert_array_equal(masked["inputs"], plan.batch(0)["inputs"][1])
    assert masked["targets"][0] == -1 and plan.batch(0)["targets"][1, 0] != -1
