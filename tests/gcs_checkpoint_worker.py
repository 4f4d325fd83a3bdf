"""One process of `test_gcs.py::test_an_orbax_checkpoint_of_a_feed_round_trips_through_a_bucket`.

    python tests/gcs_checkpoint_worker.py save|restore STORES CHECKPOINT_URL OUT.npz

`save` feeds 3 steps, saves an Orbax checkpoint at step 3 (a model state, written by
TensorStore, and the data state, written by Orbax's JSON handler through etils.epath) to the
bucket, then feeds on; `restore` is a new process that restores step 3 from the bucket. Each
writes the batches of steps 3 and 4 it fed to OUT.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from pipeline.feed.checkpoint import DataRestore
from pipeline.feed.data_feed import DataFeed
from pipeline.read.batch import FIELDS
from tests.feedstores import two_stage_config
from tests.test_checkpoint import manager, mesh, save

STEP = 3


def main(phase: str, stores: str, checkpoint: str, out: str) -> None:
    config = two_stage_config(Path(stores))
    with (
        DataFeed(config, mesh()) as feed,
        manager(epath.Path(checkpoint), async_save=False) as mngr,
    ):
        if phase == "save":
            for _ in range(STEP):
                next(feed)
            save(mngr, STEP, feed)
            mngr.wait_until_finished()
        else:
            abstract = jax.ShapeDtypeStruct((4,), jnp.float32)
            args = {"state": ocp.args.StandardRestore({"w": abstract}), "data": DataRestore(feed)}
            restored = mngr.restore(STEP, args=ocp.args.Composite(**args))
            np.testing.assert_array_equal(restored["state"]["w"], np.arange(4.0) * STEP)
        batches = {}
        for step in (feed.step, feed.step + 1):
            batch = next(feed)
            batches.update({f"{field}@{step}": np.asarray(batch[field]) for field in FIELDS})
    np.savez(out, **batches)


if __name__ == "__main__":
    main(*sys.argv[1:])
