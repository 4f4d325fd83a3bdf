"""A mixture of 1,024 sources of 8 shards each under `ulimit -n 1024`: bounded open files.

Every store keeps its own bound on open shards (256), so before the process-wide bound
(`pipeline.store.open_shards`) such a mixture opened one file per shard it touched (a flat
sidecar's map holds a descriptor) and died with "Too many open files" within a few hundred
steps. Here 1 and 2 real JAX processes feed 500 steps with their open-file limit, soft and
hard, at 1,024, and serve exactly the batches `Plan.batch` computes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store
from tests.test_multihost import launch, reference_checksums, worker_output

pytestmark = pytest.mark.multiprocess

SOURCES, SHARDS, STEPS, NOFILE = 1024, 8, 500, 1024


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """The config of 1,024 tiny stores (distinct contents, so 1,024 stores open), and the
    plan's batches of its first `STEPS` steps."""
    root = tmp_path_factory.mktemp("mixture")
    sources = {}
    for k in range(SOURCES):
        shards = [[3 + (k + s) % 7, 11, 5 + s] for s in range(SHARDS)]
        path = root / f"s{k:04d}"
        write_synthetic_store(path, shards, first=1000 * k).close()
        sources[f"s{k:04d}"] = {"path": str(path)}
    raw = {
        "seed": 3,
        "seq_len": 16,
        "global_batch_size": 16,
        "lanes": 2,
        "sources": sources,
        "mix": {name: 1 + k % 3 for k, name in enumerate(sources)},
    }
    plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    expected = [plan.batch(step) for step in range(STEPS)]
    for store in plan.stores():
        store.close()
    return raw, expected


@pytest.mark.parametrize("processes", [1, 2])
def test_a_1024_source_mixture_feeds_under_ulimit_1024_exactly(tmp_path, mixture, processes):
    raw, expected = mixture
    task = {
        "kind": "checksums",
        "name": "mix",
        "mesh": [[4], ["data"]],
        "batch_axes": ["data"],
        "steps": list(range(STEPS)),
    }
    codes = launch(tmp_path, raw, [task], processes, 4 // processes, timeout=500, nofile=NOFILE)
    assert codes == [0] * processes, worker_output(tmp_path)
    result = np.load(tmp_path / "mix.npz")
    for step, want in enumerate(expected):
        for field in FIELDS:
            np.testing.assert_array_equal(result[f"{field}_{step}"], want[field])
        np.testing.assert_array_equal(result[f"checksum_{step}"], reference_checksums(want))
    for index in range(processes):
        files = json.loads((tmp_path / f"mix-files-{index}.json").read_text())
        assert files["bound"] == NOFILE // 4  # sized from the limit the raise could not lift
        assert NOFILE // 4 < files["most"] < NOFILE // 2  # the open shards reached the bound
