"""A checked manifest's bytes, parsed when asked: whole, or one shard's entry at a time.

A restore of a big mixture opens dozens of stores at its first step and uses one or two shards
of each; parsing a whole manifest (~45 us of JSON for 8 shards, most of a store's open) to use
one entry wasted most of it. A store opened from bytes a host checked before (their SHA-256 is
the `StoreMeta.checked` of its metadata) keeps them as `ManifestText`, whose `entry` parses
the one shard entry asked for, and `manifest` the whole when something asks for it.

An entry is cut out of the bytes only where that is provably the entry `json.loads` would give
(`_entry_spans`), which holds for the layout `write_manifest` writes; any other layout is
parsed whole. The bytes were checked whole (`identity.check_manifest`) when their digest was
recorded, so nothing is checked less: only parsed later, and less of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from pipeline.store.meta import MANIFEST, StoreMeta, manifest_data, parse_manifest

_SHARDS = b'"shards": [\n'  # the shards list as `write_manifest` writes it (indent 2)
_END = b"\n  ]"  # and its end
_SCAN = json.JSONDecoder().scan_once  # the C scanner that `json.loads` runs in Python wrappers


class ManifestText:
    """A store's manifest as its open read it (`read`): its `meta`, the SHA-256 of its bytes
    (`digest`), and the manifest itself, parsed when asked (`manifest`, `entry`) when its
    bytes are ones a host checked before, parsed and checked by `read` otherwise."""

    __slots__ = ("_entries", "_manifest", "_spans", "data", "digest", "meta")

    def __init__(
        self, data: bytes | None, digest: str, meta: StoreMeta, manifest: dict[str, Any] | None
    ) -> None:
        self.data, self.digest, self.meta, self._manifest = data, digest, meta, manifest
        self._entries: list[dict[str, Any] | None] = [None] * meta.num_shards
        self._spans: list[tuple[int, int]] | None = None  # each entry's bytes ([]: none)

    @classmethod
    def read(cls, path: Path, identity: Hashable | None, known: StoreMeta | None) -> ManifestText:
        """The manifest of the store at `path`, whose file's identity (taken before the read)
        is `identity`: `known`'s as it was read (`StoreMeta.manifest_if`); else read, and kept
        unparsed when its bytes are those `known` was checked from (`StoreMeta.checked`: the
        host's summary of them), parsed and checked otherwise (`parse_manifest`)."""
        manifest = None if known is None else known.manifest_if(path, identity)
        if manifest is not None:
            return cls(None, known.checked, known, manifest)
        checked = known.checked if known is not None and known.path == path else None
        data = manifest_data(path, identity)
        digest = hashlib.sha256(data).hexdigest()
        if digest == checked:
            return cls(data, digest, known, None)
        manifest = parse_manifest(data, f"{path}/{MANIFEST}", digest, checked)
        return cls(None, digest, StoreMeta.from_manifest(path, manifest), manifest)

    def manifest(self) -> dict[str, Any]:
        """The whole manifest, parsed once."""
        manifest = self._manifest
        if manifest is None:
            manifest = self._manifest = json.loads(self.data)
        return manifest

    def entry(self, shard: int) -> dict[str, Any]:
        """Shard `shard`'s entry (`manifest()["shards"][shard]`), parsed alone at its first
        use where the layout allows (`_entry_spans`)."""
        entry = self._entries[shard]
        if entry is not None:
            return entry
        if self._manifest is None:
            spans = self._spans
            if spans is None:
                spans = self._spans = _entry_spans(self.data, len(self._entries))
            if spans:
                start, end = spans[shard]
                entry = _loads(self.data[start:end])
        if entry is None:
            entry = self.manifest()["shards"][shard]
        self._entries[shard] = entry
        return entry


def _entry_spans(data: bytes, shards: int) -> list[tuple[int, int]]:
    """Where each of the `shards` entries of a manifest's `shards` list is in `data` (valid
    JSON whose `shards` is a list of `shards` objects: bytes checked before), or [] when
    that cannot be told without parsing it all.

    Why a span is its entry: R, from the `[` after `"shards": ` to the last newline, two
    spaces and `]`, holds no other `[` or `]` byte, and `data` with R replaced by `[]` parses
    to an object whose "shards" is []. R contains a newline, which no JSON string does, so R
    does not start inside a string; `[` starts a value there (it does in the replaced text,
    whose parse up to R is the same); with no other bracket in R, that array ends at R's last
    byte, and the text after it parses as after `[]`: R is the value of the top-level "shards"
    (a manifest's list is never empty, so not another value that the replacement left []).
    R then holds each entry's `{` and `}`; with exactly `shards` of each, there are no others
    (no nested object, no brace in a string), and the k-th pair bounds entry k."""
    at = data.find(_SHARDS)
    end = data.rfind(_END) + len(_END)  # the last: a region of another `]` is refused below
    start = at + len(_SHARDS) - 2  # the `[`
    if at < 0 or end <= start:
        return []
    if data.find(b"[", start + 1, end) >= 0 or data.find(b"]", start, end - 1) >= 0:
        return []
    try:
        head = _loads(data[:start] + b"[]" + data[end:])
    except ValueError:
        return []
    if not isinstance(head, dict) or head.get("shards") != []:
        return []
    opens, closes = _positions(data, b"{", start, end), _positions(data, b"}", start, end)
    if len(opens) != shards or len(closes) != shards:
        return []
    return [(first, last + 1) for first, last in zip(opens, closes)]


def _positions(data: bytes, byte: bytes, start: int, end: int) -> list[int]:
    """Where `byte` is in `data[start:end]`: a `find` each (~0.2 us; a split, numpy or a regular
    expression cost more at a few dozen entries, and no more than a whole parse at thousands)."""
    found, at = [], data.find(byte, start, end)
    while at >= 0:  # bounded: `at` grows
        found.append(at)
        at = data.find(byte, at + 1, end)
    return found


def _loads(data: bytes) -> Any:
    """`json.loads(data)`, by the C scanner alone where `data` is UTF-8 text of one value
    (~5 us against ~7.6 us for an entry or a manifest's head: its wrappers guess the encoding
    and match whitespace in Python); any other bytes by `json.loads`, whose value or error
    they give."""
    try:
        text = data.decode()
        value, end = _SCAN(text, 0)
    except (StopIteration, ValueError):  # not a value at 0 (a BOM, other text): loads' answer
        return json.loads(data)
    if text[end:].strip(" \t\n\r"):  # json's whitespace; anything else is loads' error
        return json.loads(data)
    return value
