"""Which earlier segment a source's counters carry from, across any switch history.

A source that a switch keeps, or brings back after segments that left it out or drew it from
another store, continues the counters, epochs and exclusions of the last segment that drew it
from the same store with the same packing (docs/mixtures.md): so no row is served twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeline.plan.ledger import Segment
from pipeline.plan.row_layout import order_key


def carries(previous: Segment, name: str, fingerprint: str, entry: Mapping[str, str]) -> bool:
    """Whether source `name` (its store's `fingerprint`, its config `entry`) of a segment
    draws the rows `previous` drew under that name: same store, same packing. Then its counter
    carries over, so its epoch goes on."""
    return previous.fingerprints.get(name) == fingerprint and order_key(
        previous.config["sources"].get(name, {})
    ) == order_key(entry)


def holder(
    segments: Sequence[Segment], index: int, name: str, fingerprint: str, entry: Mapping[str, str]
) -> int | None:
    """The last of segments 0..`index` that drew source `name` from the store `fingerprint`
    with `entry`'s packing (`carries`), None if none did: a segment that takes over after
    `index` continues that segment's counter and epochs for the source (docs/mixtures.md)."""
    for held in range(index, -1, -1):
        if carries(segments[held], name, fingerprint, entry):
            return held
    return None
