"""`Placer.put` of a process that holds every row gives what `jax.device_put` gives: per
array the same values, dtype, shape, sharding, abstract value, commitment and per-device
buffers, for the feed's layouts (rows sharded, micro-batches, a model axis that replicates
them, per-row fields) and the dtypes it transfers, on the first array of a (shape, dtype)
(`jax.make_array_from_process_local_data` itself) and every later one
(`pxla.batched_device_put`, the path that skips JAX's per-array Python). A process's block of
the rows: tests/test_multihost.py (every field of every step equals the plan's)."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipeline.feed.placer import Placer

LAYOUTS = {  # mesh shape and names, the array's spec, its shape, its rows' axis
    "rows": ((8,), ("data",), PartitionSpec(("data",), None), (16, 5), 0),
    "micro-batches": ((4,), ("data",), PartitionSpec(None, ("data",), None), (2, 8, 3), 1),
    "model axis": ((2, 4), ("data", "model"), PartitionSpec(("data",), None), (6, 4), 0),
    "two batch axes": ((2, 4), ("data", "fsdp"), PartitionSpec(("data", "fsdp"), None), (8, 2), 0),
    "per row": ((8,), ("data",), PartitionSpec(("data",)), (16,), 0),
}
DTYPES = [np.int32, np.uint16, np.uint32, np.float32, np.int64]  # int64: canonicalised


def assert_same(got: jax.Array, expected: jax.Array) -> None:
    assert (got.dtype, got.shape, got.aval) == (expected.dtype, expected.shape, expected.aval)
    assert got.sharding == expected.sharding and got.committed == expected.committed
    assert got.weak_type == expected.weak_type
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    for mine, theirs in zip(got.addressable_shards, expected.addressable_shards, strict=True):
        assert (mine.device, mine.index) == (theirs.device, theirs.index)
        np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(theirs.data))


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    dtype=st.sampled_from(DTYPES),
    strided=st.booleans(),
    seeds=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3),
)
def test_put_is_device_put(layout: str, dtype: type, strided: bool, seeds: list[int]) -> None:
    mesh_shape, names, spec, shape, axis = LAYOUTS[layout]
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
    sharding = NamedSharding(mesh, spec)
    placer = Placer(sharding, np.arange(shape[axis]), axis, shape[axis])
    for seed in seeds:  # the first array of the (shape, dtype), then the fast path's
        rng = np.random.default_rng(seed)
        wide = rng.integers(0, 2**15, (*shape[:-1], shape[-1] + strided)).astype(dtype)
        arrays = [wide[..., : shape[-1]], wide[..., strided:]]  # overlapping views, as Plan.read's
        expected = jax.device_put(arrays, [sharding] * 2)
        for got, want in zip(placer.put(arrays), expected, strict=True):
            assert_same(got, want)
    # every array after the first took the fast path, unless JAX changes the dtype (int64)
    assert ((shape, np.dtype(dtype)) in placer._known) == (dtype is not np.int64)
