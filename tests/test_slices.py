"""Simulated large slices: one process computes any host's rows for up to 4,096 processes.

A host's batch is `plan.batch(step, host_rows(B, p, P))`; nothing in it depends on the other
hosts, so a single process can stand in for any of them. The union over hosts is the global
batch, whatever the process count.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.plan.rows import host_rows
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

GLOBAL_BATCH = 8192  # 2 rows per host at 4,096 processes
PROCESS_COUNTS = [2**k for k in range(13)]  # 1 .. 4,096
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    directory: Path = tmp_path_factory.mktemp("slice")
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        shards = [rng.integers(1, 400, size=60).tolist() for _ in range(6)]
        write_synthetic_store(directory / name, shards)
    raw = {
        "seed": 11,
        "seq_len": 16,
        "global_batch_size": GLOBAL_BATCH,
        "lanes": 64,
        "sources": {name: {"path": str(directory / name)} for name in ("web", "code")},
        "mix": {"web": 3, "code": 1},
    }
    return Plan.from_config(parse_config(raw, origin="slice.yaml"))


@pytest.fixture(scope="module")
def global_batch(plan: Plan):
    return cache(plan.batch)


@SETTINGS
@given(
    processes=st.sampled_from(PROCESS_COUNTS),
    data=st.data(),
    step=st.sampled_from([0, 1, 97, 10**6]),
)
def test_any_host_of_any_slice_gets_its_rows_of_the_global_batch(
    plan, global_batch, processes, data, step
):
    host = data.draw(st.integers(0, processes - 1), label="host")
    rows = host_rows(GLOBAL_BATCH, host, processes)
    assert len(rows) == GLOBAL_BATCH // processes
    mine = plan.batch(step, rows)
    whole = global_batch(step)
    for field in FIELDS:
        np.testing.assert_array_equal(mine[field], whole[field][rows], err_msg=field)


@pytest.mark.parametrize("processes", [4096, 64, 1])
def test_the_union_over_hosts_is_the_global_batch(plan, global_batch, processes):
    """Every host of a small slice, and 64 hosts spread over a 4,096-host one, tile the batch."""
    hosts = np.unique(np.linspace(0, processes - 1, num=min(processes, 64)).astype(int))
    step = 5
    whole = global_batch(step)
    covered = []
    for host in hosts.tolist():
        rows = host_rows(GLOBAL_BATCH, host, processes)
        mine = plan.batch(step, rows)
        for field in FIELDS:
            np.testing.assert_array_equal(mine[field], whole[field][rows], err_msg=field)
        covered.extend(rows.tolist())
    assert len(covered) == len(set(covered))  # hosts never share a row
    if len(hosts) == processes:
        assert sorted(covered) == list(range(GLOBAL_BATCH))
