"""A ledger's `set_mix` entries (`MixEntry`) held as arrays, and their compact JSON encoding.

A run may record one entry per step for its whole length, so the entries must cost next to
nothing to restore: `MixTable` keeps them as two arrays (the steps, and the weights of each
entry by source column), which the plan places and counts vectorised, and encodes them in the
ledger (version 5) as base64 of little-endian binary, whose parse is a decode and a few
vectorised checks instead of a JSON object per entry:

    "mixes": {"count": E, "sources": [name, ...], "steps": base64 of E int64,
              "weights": base64 of E x len(sources) uint32 (row-major, 0: left out),
              "digest": first 16 hex digits of SHA-256 over the four}

That is 4/3 * (8 + 4 * sources) bytes per entry (~21 for two sources). The digest names a
damaged or edited table in a bare ledger file too (a data state's digest also covers it).
Ledgers of version 4 wrote the entries as a list of `[step, {source: weight}]`: `from_entries`
reads them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from pipeline.errors import ConfigError, LedgerError

MIX_UNIT = 2**20
"""`set_mix` weights are stored as integers in units of 1/MIX_UNIT of their total."""


@dataclass(frozen=True)
class MixEntry:
    """A `DataFeed.set_mix` call: from `step` on, the weights of the stage in force."""

    step: int
    weights: tuple[tuple[str, int], ...]  # (source name, weight in 1/MIX_UNIT), by name, > 0

    def to_json(self) -> list[Any]:
        return [self.step, dict(self.weights)]


def quantize(weights: Mapping[str, float], where: str = "set_mix") -> tuple[tuple[str, int], ...]:
    """`weights` as a `MixEntry` holds them: each round(w / total * 2^20), zeros left out, so
    that hosts whose floats differ in the last bits record the same integers."""
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{where}: weights must be a non-empty mapping of source names")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)):
            raise ConfigError(f"{where}: weight of {name!r} is not a number: {weight!r}")
        try:
            value = float(weight)  # an int beyond a float (10**400) is not finite either
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or value < 0:
            huge = isinstance(weight, int) and value == math.inf
            shown = f"an integer of {weight.bit_length()} bits" if huge else weight
            raise ConfigError(f"{where}: weight of {name!r} must be finite and >= 0, got {shown}")
    largest = max(float(w) for w in weights.values())  # scaled first: 1e308 + 1e308 overflows
    total = math.fsum(float(w) / largest for w in weights.values()) if largest > 0 else 0.0
    units = {str(n): round(float(w) / largest / total * MIX_UNIT) if total > 0 else 0
             for n, w in weights.items()}  # fmt: skip
    if not any(units.values()):
        raise ConfigError(f"{where}: at least one weight must be > 0, got {dict(weights)}")
    return tuple(sorted((n, u) for n, u in units.items() if u))


class MixTable(Sequence[MixEntry]):
    """Entries by step (strictly increasing): a sequence of `MixEntry`, held as `steps` [E]
    and `weights` [E, len(sources)] int64 arrays, the columns only the sources some entry
    weights, by name (so equal entries make equal tables). `weights` is column-major: what
    reads it reduces over entries or over a few sources, which NumPy does ~10x faster along
    contiguous columns than across 10,000 short rows."""

    def __init__(self, sources: Sequence[str] = (), steps: Any = (), weights: Any = None) -> None:
        steps = np.asarray(steps, dtype=np.int64).reshape(-1)
        shape = (len(steps), len(sources))
        weights = np.zeros(shape, np.int64) if weights is None else np.asarray(weights, np.int64)
        weights = np.asfortranarray(weights)
        used = weights.any(axis=0)
        keep = [k for k in sorted(range(len(sources)), key=sources.__getitem__) if used[k]]
        self.sources: tuple[str, ...] = tuple(sources[k] for k in keep)
        self.steps = steps
        self.weights = np.asfortranarray(weights[:, keep].reshape(len(steps), len(keep)))
        self.steps.flags.writeable = self.weights.flags.writeable = False

    @classmethod
    def from_entries(cls, entries: Sequence[MixEntry]) -> MixTable:
        names = sorted({name for entry in entries for name, _ in entry.weights})
        column = {name: k for k, name in enumerate(names)}
        weights = np.zeros((len(entries), len(names)), dtype=np.int64)
        for row, entry in enumerate(entries):
            for name, weight in entry.weights:
                weights[row, column[name]] = weight
        return cls(names, [entry.step for entry in entries], weights)

    def __len__(self) -> int:
        return len(self.steps)

    @overload
    def __getitem__(self, index: int) -> MixEntry: ...
    @overload
    def __getitem__(self, index: slice) -> MixTable: ...
    def __getitem__(self, index: int | slice) -> MixEntry | MixTable:
        if isinstance(index, slice):
            if range(len(self))[index] == range(len(self)):  # all of it (immutable): itself
                return self
            return MixTable(self.sources, self.steps[index], self.weights[index])
        row = self.weights[index]
        weights = tuple((n, int(w)) for n, w in zip(self.sources, row.tolist()) if w)
        return MixEntry(int(self.steps[index]), weights)

    def __iter__(self) -> Iterator[MixEntry]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MixTable):
            return NotImplemented
        return (
            self.sources == other.sources
            and np.array_equal(self.steps, other.steps)
            and np.array_equal(self.weights, other.weights)
        )

    def __hash__(self) -> int:  # by content, like `==` (the arrays are read-only)
        return hash((self.sources, self.steps.tobytes(), self.weights.tobytes()))

    def __repr__(self) -> str:
        return f"MixTable({len(self)} entries, sources {list(self.sources)})"

    def first_at(self, step: int) -> int:
        """The index of the first entry at or after `step` (bisection)."""
        return int(np.searchsorted(self.steps, step, side="left"))

    def appended(self, entry: MixEntry) -> MixTable:
        """The table with `entry` after its last (the caller checks the order)."""
        names = sorted(set(self.sources) | {name for name, _ in entry.weights})
        weights = np.zeros((len(self) + 1, len(names)), dtype=np.int64)
        weights[:-1, [names.index(n) for n in self.sources]] = self.weights
        for name, weight in entry.weights:
            weights[-1, names.index(name)] = weight
        return MixTable(names, np.append(self.steps, entry.step), weights)

    def columns(self, names: Sequence[str]) -> np.ndarray:
        """[E, len(names)] the weights by `names`' columns; a `LedgerError` naming the first
        entry that weights a source not in `names`."""
        outside = [k for k, name in enumerate(self.sources) if name not in names]
        if outside:
            rows = self.weights[:, outside].any(axis=1)
            if rows.any():
                first = int(np.argmax(rows))
                name = next(self.sources[k] for k in outside if self.weights[first, k])
                raise LedgerError(
                    f"set_mix at step {int(self.steps[first])}: no source {name} in the data "
                    f"config in force (sources: {', '.join(names)})"
                )
        out = np.zeros((len(self), len(names)), dtype=np.int64, order="F")
        for k, name in enumerate(self.sources):
            if name in names:
                out[:, names.index(name)] = self.weights[:, k]
        return out

    def to_json(self) -> dict[str, Any]:
        steps = self.steps.astype("<i8").tobytes()
        weights = self.weights.astype("<u4").tobytes()
        return {
            "count": len(self),
            "sources": list(self.sources),
            "steps": base64.b64encode(steps).decode(),
            "weights": base64.b64encode(weights).decode(),
            "digest": _digest(len(self), self.sources, steps, weights),
        }

    @classmethod
    def from_json(cls, raw: Any, where: str) -> MixTable:
        """The table `to_json` wrote, its digest and shapes checked (not its content: see
        `check`)."""
        try:
            count, sources = int(raw["count"]), [str(name) for name in raw["sources"]]
            # a2b_base64 takes the str as is (b64decode copies it to bytes first)
            steps = binascii.a2b_base64(raw["steps"])
            weights = binascii.a2b_base64(raw["weights"])
            digest = raw["digest"]
        except (KeyError, TypeError, ValueError, binascii.Error) as error:
            raise LedgerError(
                f"{where} is malformed ({type(error).__name__}: {error}): expected count, "
                "sources, steps, weights and digest"
            ) from None
        if digest != _digest(count, sources, steps, weights):
            raise LedgerError(
                f"{where}: the digest does not match the entries (the ledger was damaged or edited)"
            )
        if len(steps) != 8 * count or len(weights) != 4 * count * len(sources):
            raise LedgerError(f"{where}: {count} entries do not fit the arrays' sizes")
        if len(set(sources)) != len(sources):
            raise LedgerError(f"{where}: a source is named twice in {sources}")
        step_array = np.frombuffer(steps, dtype="<i8").astype(np.int64)
        weight_array = np.frombuffer(weights, dtype="<u4").astype(np.int64)
        return cls(sources, step_array, weight_array.reshape(count, len(sources)))

    def check(self, where: str) -> None:
        """Refuse entries a `set_mix` call could not have made: steps not increasing or
        negative, weights all 0 or above twice `MIX_UNIT` in total."""
        if len(self) == 0:
            return
        bad = np.flatnonzero(np.diff(self.steps) <= 0)
        if self.steps[0] < 0:
            raise LedgerError(f"{where}[0]: step {int(self.steps[0])} is negative")
        if bad.size:
            index = int(bad[0]) + 1
            raise LedgerError(
                f"{where}[{index}]: step {int(self.steps[index])} is not after the entry before it"
            )
        totals = self.weights.sum(axis=1)
        bad = np.flatnonzero((totals <= 0) | (totals > 2 * MIX_UNIT))
        if bad.size:
            raise LedgerError(
                f"{where}[{int(bad[0])}]: weights must be integers > 0 (units of 1/{MIX_UNIT} "
                f"of their total); got {dict(self[int(bad[0])].weights)}"
            )


NO_MIXES = MixTable()
"""The empty table (its arrays are read-only, so it can be shared)."""


def _digest(count: int, sources: Sequence[str], steps: bytes, weights: bytes) -> str:
    head = json.dumps([count, list(sources)]).encode()
    return hashlib.sha256(head + b"\0" + steps + weights).hexdigest()[:16]
