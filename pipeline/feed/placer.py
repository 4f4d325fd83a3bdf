"""Host arrays to global `jax.Array`s of one sharding, without `jax.device_put`'s per-array
Python work.

`jax.device_put(arrays, shardings)` spends ~55 us of Python per array before JAX's per-device
copies even start: the pytree, dtype canonicalisation, the sharding's index map, every
device's slice wrapped as a JAX typed array, a new abstract value. For the six fields on 8
devices that is ~0.4 ms of the feed's ~1.6 ms per 32 x 2048 step (docs/benchmarks.md, "The
transfer without `device_put`'s Python"). A feed transfers the same few (shape, dtype) per
sharding every step, so the first array of each goes through `jax.device_put`, and what it
computed is kept: its result's abstract value, and the sharding's device order and slices.
Every later array of that (shape, dtype) is sliced here and handed to
`pxla.batched_device_put`, the call in which `jax.device_put` and
`jax.make_array_from_callback` both end: the same per-device buffers, abstract value and
sharding, committed as `device_put` commits them (tests/test_placer.py compares them).

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


class Placer:
    """Places whole global arrays (every row on this process's devices) with `sharding`."""

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding
        # (shape, dtype) -> (abstract value, devices, each device's slice)
        self._known: dict[tuple[tuple[int, ...], np.dtype], tuple[Any, list, tuple]] = {}

    def put(self, arrays: Sequence[np.ndarray]) -> list[jax.Array]:
        """`jax.device_put(arrays, [sharding] * len(arrays))`, the same arrays."""
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
        """`jax.device_put` itself; its abstract value kept when it kept the dtype (a dtype JAX
        canonicalises, e.g. int64 without x64, always takes this path)."""
        array = jax.device_put(values, self.sharding)
        if array.dtype == values.dtype:
            indices = self.sharding.addressable_devices_indices_map(values.shape)
            self._known[(values.shape, values.dtype)] = (
                array.aval,
                list(indices),
                tuple(indices.values()),
            )
        return array
