"""The six fields built on the devices from the compact form the feed transferred.

With `feed: {expand: device}` (the default) a reader task transfers a step's rows in their
compact form (`pipeline.read.compact`: the windows' tokens and packed segment numbers and
positions, 8 bytes per token instead of the six fields' 24) and one jitted function per
(form, sharding) builds the six fields on the devices, with the sharding the host path's
arrays have (`Geometry.sharding`): the same dtype, shape, sharding and values, so a trainer
cannot tell the paths apart. Each device expands its own rows: the batch axes shard rows, the
sequence axis is whole, so the function needs no communication.

The host path (`expand: host`, and any step whose ledger segment has no compact form: a
mixture of `concat` and `best_fit` sources, or `seq_len` > `compact.MAX_SEQ_LEN`) transfers
the six fields as read (`Geometry.to_global`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pipeline.feed.geometry import Geometry
from pipeline.read import objective
from pipeline.read.batch import FIELDS
from pipeline.read.compact import DOCUMENTS, NAMES, POSITION_MASK, SEGMENT_SHIFT, UNTRAINED, WINDOWS

Arrays = dict[str, jax.Array]


def on_device(mode: str, geometry: Geometry) -> bool:
    """Whether `feed.expand: mode` builds the six fields on `geometry`'s devices: `device`
    always, `host` never, `auto` on accelerators only. On CPU devices the expansion runs on
    the host's own cores, where its six kernels per device cost more CPU than the smaller
    transfer saves (docs/benchmarks.md, "Transfer less")."""
    if mode == "auto":
        return geometry.sharding.mesh.devices.flat[0].platform != "cpu"
    return mode == "device"


def describe(mode: str, geometry: Geometry) -> str:
    """Which transfer form `feed.expand: mode` gives on `geometry`'s devices, for the log."""
    platform = geometry.sharding.mesh.devices.flat[0].platform
    if on_device(mode, geometry):
        form = "transfers the rows' compact form, the devices build the six fields"
    else:
        form = "transfers the six fields built on the host"
    return f"{form} (feed.expand: {mode}, {platform} devices)"


def to_global(geometry: Geometry, host: dict[str, np.ndarray]) -> Arrays:
    """The global arrays of a step's rows, as `Geometry.to_global` gives them, from the six
    fields (transferred as they are) or from the compact form (transferred, then expanded)."""
    if "bounds" not in host:
        return geometry.to_global(host)
    form = WINDOWS if "tokens" in host else DOCUMENTS
    names = NAMES[form]
    rows = [name for name in host if name not in names]  # provenance
    packed, placed = geometry.place([host[n] for n in names], [host[n] for n in rows])
    fields = expander(form, geometry.sharding)(*packed)
    return {**{name: fields[name] for name in FIELDS}, **dict(zip(rows, placed))}


def weigh(arrays: Arrays, sharding: NamedSharding, sources: int) -> Arrays:
    """`arrays` with `loss_weights` (`objective.weights`, with the sharding of the fields)
    in place of the per-row `objective.ROW_FIELDS` it is derived from (`sources`: how many
    sources the rows' source indexes count). Usable on any step's global arrays that hold
    them (the Grain view's rows, made global by the trainer).

    Unlike the expansion, this reduces over the whole global batch: a computation with
    collectives across processes, which every process must launch in the same order. So
    `DataFeed` calls it in `next()`, in step order, never in its reader threads."""
    out = {name: value for name, value in arrays.items() if name not in objective.ROW_FIELDS}
    inputs = (arrays["targets_segmentation"], *(arrays[name] for name in objective.ROW_FIELDS))
    out["loss_weights"] = weigher(sharding, sources)(*inputs)
    return out


@lru_cache(maxsize=64)
def weigher(sharding: NamedSharding, sources: int) -> Callable[..., jax.Array]:
    """The jitted `objective.weights` whose output has `sharding` (the fields')."""
    return jax.jit(partial(objective.weights, jnp, sources=sources), out_shardings=sharding)


@lru_cache(maxsize=64)
def expander(form: str, sharding: NamedSharding) -> Callable[..., Arrays]:
    """The jitted expansion of `form` whose six outputs have `sharding` (the inputs' own)."""
    return jax.jit(EXPANSIONS[form], out_shardings=sharding)


def _unpack(bounds: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Segment numbers, positions (int32) and whether each target is trained."""
    segments = (bounds >> SEGMENT_SHIFT).astype(jnp.int32)
    positions = (bounds & POSITION_MASK).astype(jnp.int32)
    return segments, positions, (bounds & UNTRAINED) == 0


def expand_windows(tokens: jax.Array, bounds: jax.Array) -> Arrays:
    """The six fields of windows [..., seq_len + 1] (`batch.fields`, then the loss mask)."""
    segments, positions, trained = _unpack(bounds)
    return {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "inputs_segmentation": segments[..., :-1],
        "targets_segmentation": jnp.where(trained[..., 1:], segments[..., 1:], 0),
        "inputs_position": positions[..., :-1],
        "targets_position": positions[..., 1:],
    }


def expand_documents(inputs: jax.Array, targets: jax.Array, bounds: jax.Array) -> Arrays:
    """The six fields of whole-document rows [..., seq_len] (`documents.document_fields`)."""
    segments, positions, trained = _unpack(bounds)
    return {
        "inputs": inputs,
        "targets": targets,
        "inputs_segmentation": segments,
        "targets_segmentation": jnp.where(trained, segments, 0),
        "inputs_position": positions,
        "targets_position": positions,
    }


EXPANSIONS = {WINDOWS: expand_windows, DOCUMENTS: expand_documents}
