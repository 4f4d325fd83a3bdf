"""A process's host arrays to global `jax.Array`s of one sharding, without JAX's per-array
Python.

`jax.device_put(arrays, shardings)` spends ~55 us of Python per array before JAX's per-device
copies even start (the pytree, dtype canonicalisation, the sharding's index map, every
device's slice wrapped as a JAX typed array, a new abstract value), and
`jax.make_array_from_process_local_data` about as much. For the six fields on 8 devices that
was ~0.4 ms of the feed's ~1.6 ms per 32 x 2048 step (docs/benchmarks.md, "The transfer
without `device_put`'s Python"). A feed transfers the same few (shape, dtype) per sharding
every step, so the first array of each goes through `jax.make_array_from_process_local_data`,
and what it computed is kept: its result's abstract value, and each device's slice of the host
array. Every later array of that (shape, dtype) is sliced here and handed to
`pxla.batched_device_put`, the call in which `jax.device_put` and
`jax.make_array_from_callback` both end: the same per-device buffers, abstract value and
sharding, committed as they commit them (tests/test_placer.py, tests/test_multihost.py).

The one JAX-internal name the package uses for speed (`pipeline.feed.host_stop` uses another
for a shutdown); a JAX release that moves it fails those tests, not silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src.interpreters import pxla
from jax.sharding import Sharding

Index = tuple[Any, ...]


class Placer:
    """Places this process's blocks of global arrays sharded by `sharding`: along `axis`, a
    host array holds the global rows `held` (sorted) of `count`, every other axis whole."""

    def __init__(self, sharding: Sharding, held: np.ndarray, axis: int, count: int) -> None:
        self.sharding, self.held, self.axis, self.count = sharding, held, axis, count
        # (host shape, dtype) -> (abstract value, devices, each device's host slice)
        self._known: dict[tuple[tuple[int, ...], np.dtype], tuple[Any, list, list[Index]]] = {}

    def put(self, arrays: Sequence[np.ndarray]) -> list[jax.Array]:
        """`jax.make_array_from_process_local_data(sharding, values)` for each of `arrays`
        (`jax.device_put(values, sharding)` when the process holds every row)."""
        placed = []
        for values in arrays:
            known = self._known.get((values.shape, values.dtype))
            if known is None:
                placed.append(self._first(values))
                continue
            aval, devices, slices = known
            shards = [values[index] for index in slices]
            placed.append(pxla.batched_device_put(aval, self.sharding, shards, devices))
        return placed

    def _first(self, values: np.ndarray) -> jax.Array:
        """The public call itself; what it computed kept when it kept the dtype (a dtype JAX
        canonicalises, e.g. int64 without x64, always takes this path)."""
        axis = self.axis
        shape = (*values.shape[:axis], self.count, *values.shape[axis + 1 :])
        array = jax.make_array_from_process_local_data(self.sharding, values, shape)
        if array.dtype == values.dtype:
            indices = self.sharding.addressable_devices_indices_map(shape)
            slices = [self._local(index) for index in indices.values()]
            self._known[(values.shape, values.dtype)] = (array.aval, list(indices), slices)
        return array

    def _local(self, index: Index) -> Index:
        """A device's slice of the global array as a slice of the host array: its global rows
        along `axis` found among `held` (a range of them where they are consecutive)."""
        wanted = np.arange(self.count)[index[self.axis]]
        at = np.searchsorted(self.held, wanted)
        consecutive = at.size and at[-1] - at[0] == at.size - 1
        rows: Any = slice(int(at[0]), int(at[-1]) + 1) if consecutive else at
        return (*index[: self.axis], rows, *index[self.axis + 1 :])
