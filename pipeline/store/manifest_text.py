"""A checked manifest's bytes, parsed when asked: whole, or one shard's entry at a time.

A restore of a big mixture opens dozens of stores at its first step and uses one or two shards
of each; parsing a whole manifest (~45 us of JSON for 8 shards, most of a store's open) to use
one entry wasted most of it. A store opened from bytes a host checked before (their SHA-256 is
the `StoreMeta.checked` of its metadata) keeps them as `ManifestText`, whose `entry` parses
the one shard entry asked for, and `manifest` the whole when something asks for it.

An entry is cut out of the bytes only where that is provably the entry `json.loads` would give
(`manifest_spans.entry_spans`), which holds for the layout `write_manifest` writes; any other
layout is parsed whole. The bytes were checked whole (`identity.check_manifest`) when their
digest was recorded, so nothing is checked less: only parsed later, and less of them. Where
the entries are is recorded with that digest in the host's summary (`StoreMeta.spans`), so a
restore's open does not look for them again (~17 us a store); an entry found there that is not
an object's bytes is looked for again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from pipeline.store.manifest_spans import entry_spans, loads
from pipeline.store.meta import MANIFEST, StoreMeta, manifest_data, parse_manifest


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
        if digest == checked:  # `known.spans` were found in these bytes, if recorded
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
        use where the layout allows (`entry_spans`)."""
        entry = self._entries[shard]
        if entry is not None:
            return entry
        if self._manifest is None:
            entry = self._cut(shard)
            if entry is None and self._spans:  # recorded where no entry is: looked for here
                self._spans = entry_spans(self.data, len(self._entries))
                entry = self._cut(shard)
        if entry is None:
            entry = self.manifest()["shards"][shard]
        self._entries[shard] = entry
        return entry

    def _cut(self, shard: int) -> dict[str, Any] | None:
        """The entry at its span (found, or recorded with these bytes' digest); None where
        the layout has no spans, or the span holds no object."""
        spans = self._spans
        if spans is None:  # recorded with these bytes' digest (`StoreMeta.spans`), else found
            spans = self._spans = self.meta.spans or entry_spans(self.data, len(self._entries))
        if not spans:
            return None
        start, end = spans[shard]
        piece = self.data[start:end]
        if piece[:1] != b"{" or piece[-1:] != b"}":
            return None
        try:
            entry = loads(piece)
        except ValueError:
            return None
        return entry if isinstance(entry, dict) else None
