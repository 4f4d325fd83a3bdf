"""What the plan needs of a token store, from its manifest alone: shard sizes and content identity.

A data plan (which window of which epoch every row holds) depends on a store only through its
shard token counts and, for the ledger, its content fingerprint. `StoreMeta` carries exactly
that, so a plan can be computed, inspected and tested without opening shard files; reading
tokens takes an open `TokenStore` (token_store.py), whose `meta` this is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.in_place import hint
from pipeline.store.doc_ids import has_ids, shard_ids
from pipeline.store.identity import check_manifest, tokenizer_identity
from pipeline.store.manifest_spans import entry_spans
from pipeline.store.remote_reads import manifest_bytes
from pipeline.urls import is_url, location, read_bytes, read_local

FORMAT_NAME = "pipeline-token-store"
FORMAT_VERSION = 3
# A version 3 store plus a loss mask (every shard's untrained spans, identity.MASK_KEYS). Older
# readers refuse it rather than train on every token; a store without a mask stays version 3.
MASKED_FORMAT_VERSION = 4
MANIFEST = "manifest.json"
_KEPT = ("_read", "_checked", "_spans")  # what a StoreMeta keeps of its reading, not pickled


@dataclass(frozen=True, eq=False)
class StoreMeta:
    """A store's location, content fingerprint, tokens per shard (in shard order), token
    dtype and tokenizer (whose identity says whether two stores' ids mean the same tokens)."""

    path: Path  # an etils.epath.Path for a gs:// store
    fingerprint: str
    shard_tokens: np.ndarray  # int64 [num_shards]
    dtype: np.dtype
    tokenizer: dict[str, Any]  # the manifest's tokenizer entry
    masked: bool = False  # the store records a loss mask (docs/instruction-data.md)

    @classmethod
    def from_manifest(cls, path: Path, manifest: dict[str, Any]) -> StoreMeta:
        """The metadata of the store at `path` whose (checked) manifest is `manifest`."""
        shards = manifest["shards"]
        content = {
            "tokenizer": manifest["tokenizer"]["name"],
            "dtype": manifest["dtype"],
            "shards": [(s["documents"], s["tokens"], s["sha256"]) for s in shards],
        }
        masked = manifest["format_version"] == MASKED_FORMAT_VERSION
        if masked:  # the same tokens trained on differently are different data
            content["untrained"] = [s["untrained_sha256"] for s in shards]
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
        tokens = np.array([s["tokens"] for s in shards], dtype=np.int64)
        tokenizer = manifest["tokenizer"]
        return cls(path, digest, tokens, np.dtype(manifest["dtype"]), tokenizer, masked)

    @classmethod
    def kept(
        cls,
        values: tuple[Path, str, np.ndarray, np.dtype, dict, bool],
        num_tokens: int,
        checked: str,
        spans: tuple[np.ndarray, int] | None = None,
    ) -> StoreMeta:
        """The metadata of field `values` (in field order) as a host's summary kept them
        (`meta_cache`), with their `num_tokens`, the SHA-256 of the manifest bytes they were
        `checked` from and where its shard entries are in them (`spans`: the summary's array
        of (start, end) pairs and where this store's begin in it, not sliced here): set as a frozen
        instance's fields are, without the dataclass's `__init__` (~3 us, of each of a
        restore's hundreds of sources) nor a `zip` of the names (~1 us): a field added to
        `StoreMeta` and not here stops the import (`_FIELDS`), never takes its default."""
        path, fingerprint, shard_tokens, dtype, tokenizer, masked = values
        meta = _new(cls)
        _set(meta, "__dict__", {
            "path": path, "fingerprint": fingerprint, "shard_tokens": shard_tokens,
            "dtype": dtype, "tokenizer": tokenizer, "masked": masked,
            "num_tokens": num_tokens, "_checked": checked, "_spans": spans,
        })  # fmt: skip
        return meta

    @classmethod
    def load(cls, path: str | Path, identity: Hashable | None = None) -> StoreMeta:
        """The metadata of the store at `path` (a directory or a `gs://` URL), reading its
        manifest only. With the manifest file's `identity` (`store_files.store_identity`, taken
        before the read), the checked manifest stays with the metadata, so that opening the
        unchanged store at its first draw does not read and check it again (`manifest_if`), and
        where its shard entries are in the bytes, for the host's summary (`spans`)."""
        path = location(path)
        manifest, digest, data = read_manifest(path)
        meta = cls.from_manifest(path, manifest)
        meta.vouch(digest)
        if identity is not None:  # not a field: a plan pickles its metadata without manifests
            object.__setattr__(meta, "_read", (identity, manifest))
            spans = entry_spans(data, len(manifest["shards"]))  # ~17 us, for the summary
            flat = (np.array(spans, np.int64).reshape(-1), 0) if spans else None
            object.__setattr__(meta, "_spans", flat)
        return meta

    def vouch(self, digest: str) -> None:
        """Record that the manifest bytes of SHA-256 `digest` were checked and are this
        metadata's (`checked`)."""
        object.__setattr__(self, "_checked", digest)

    @property
    def checked(self) -> str | None:
        """The SHA-256 of the manifest bytes this metadata was read from, checked (`load`, or
        a host's summary of them: `meta_cache`); None when not known."""
        return self.__dict__.get("_checked")

    @property
    def spans(self) -> list[tuple[int, int]] | None:
        """Where each shard's entry is in the manifest bytes of SHA-256 `checked`
        (`manifest_spans.entry_spans`, recorded by `load` and the host's summary); None when
        not known."""
        kept = self.__dict__.get("_spans")
        if kept is None:
            return None
        pairs, first = kept
        flat = pairs[first : first + 2 * self.num_shards].tolist()
        return list(zip(flat[0::2], flat[1::2]))

    def manifest_if(self, path: Path, identity: Hashable | None) -> dict[str, Any] | None:
        """The manifest `load` read, if it was read at `path` from the file of `identity` (the
        manifest's now); None if it was not kept, or the store was replaced since."""
        read = self.__dict__.get("_read")
        if read is None or identity is None or path != self.path or read[0] != identity:
            return None
        return read[1]

    def __getstate__(self) -> dict[str, Any]:
        """The fields (another process opens its stores afresh), not what `load` kept."""
        return {key: value for key, value in self.__dict__.items() if key not in _KEPT}

    @property
    def tokenizer_identity(self) -> tuple[str, str, int, int]:
        """(kind, model file SHA-256, vocab size, eod id): equal for stores whose ids agree."""
        return tokenizer_identity(self.tokenizer)

    @property
    def num_shards(self) -> int:
        """How many shards the store has."""
        return len(self.shard_tokens)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size: every token id of the store is below it."""
        return int(self.tokenizer["vocab_size"])

    @cached_property
    def num_tokens(self) -> int:
        """Tokens in the store, end-of-document tokens included (once: ~4 us of numpy, asked
        of each of a mixture's hundreds of sources as it is laid out)."""
        return int(self.shard_tokens.sum())

    @cached_property
    def shard_starts(self) -> np.ndarray:
        """Where each shard starts in the natural stream, and the total (num_shards + 1)."""
        return np.concatenate([[0], np.cumsum(self.shard_tokens)])


_FIELDS = ("path", "fingerprint", "shard_tokens", "dtype", "tokenizer", "masked")  # `kept`'s
if tuple(field.name for field in fields(StoreMeta)) != _FIELDS:
    raise TypeError("StoreMeta's fields changed: make StoreMeta.kept and meta_cache set them")
_new, _set = object.__new__, object.__setattr__


class StoreFacts:
    """What an open store of any format tells from its metadata alone (`meta`, and the
    `manifest`, or index record, it was read from)."""

    meta: StoreMeta
    manifest: dict[str, Any]

    @property
    def num_shards(self) -> int:
        """How many shards the store has."""
        return self.meta.num_shards

    @property
    def num_tokens(self) -> int:
        """Tokens in the store, end-of-document tokens included."""
        return self.meta.num_tokens

    @property
    def num_documents(self) -> int:
        """Documents in the store (a long one split into several records counts once)."""
        return int(self.manifest["num_documents"])

    @property
    def fingerprint(self) -> str:
        """Identity of the content (not the location): equal stores have equal fingerprints."""
        return self.meta.fingerprint

    @property
    def tokenizer_identity(self) -> tuple[str, str, int, int]:
        """(kind, model file SHA-256, vocab size, eod id): equal for stores whose ids agree."""
        return self.meta.tokenizer_identity

    @property
    def has_ids(self) -> bool:
        """Whether the store records document ids (`prepare --id-field/--record-ids`)."""
        return has_ids(self.manifest)

    def document_ids(self, shard: int) -> list[str]:
        """The ids of a shard's documents, in order, read and checked (`doc_ids.shard_ids`)."""
        if not self.has_ids:
            raise StoreError(
                f"{self.meta.path}: the store records no document ids (prepare it with "
                "--id-field or --record-ids)"
            )
        entry = self.manifest["shards"][shard]
        return shard_ids(self.meta.path, entry, entry["documents"])

    def trained(self, shard: int, start: int, stop: int) -> np.ndarray:
        """Per token of shard tokens [start, stop): whether it is trained on (as a target)."""
        mask = np.ones(stop - start, dtype=bool)
        spans = self.untrained_spans([shard], [start], [stop])  # type: ignore[attr-defined]
        for _, lo, hi in zip(*(a.tolist() for a in spans)):
            mask[lo:hi] = False
        return mask


def load_manifest(path: Path, identity: Any = None, checked: str | None = None) -> dict[str, Any]:
    """The manifest, in one read when it exists (one request for a `gs://` store), checked to
    be one this version reads and to be its own (`identity.check_manifest`). A cloud store's
    `identity` (`store_files.store_identity`, taken by the caller) names the generation to
    read, which a warm restart then finds in the host's cache (`remote_reads`). Bytes of
    SHA-256 `checked` (`StoreMeta.checked`: the same bytes passed these checks before) are
    parsed, not checked again."""
    return read_manifest(path, identity, checked)[0]


def read_manifest(
    path: Path, identity: Any = None, checked: str | None = None
) -> tuple[dict[str, Any], str, bytes]:
    """`load_manifest`'s manifest, the SHA-256 of the bytes it was read from, and the bytes."""
    data = manifest_data(path, identity)
    digest = hashlib.sha256(data).hexdigest()
    return parse_manifest(data, f"{path}/{MANIFEST}", digest, checked), digest, data


def manifest_data(path: Path, identity: Any = None) -> bytes:
    """The bytes of the manifest of the store at `path` (`load_manifest`'s read), refused in
    one line that says what is there instead when there are none."""
    manifest_path = f"{path}/{MANIFEST}"  # not a `pathlib` join: ~3 us of a store's open
    try:
        if not is_url(path):  # bytes the caller hashes: compared with a digest, or checked
            return read_local(manifest_path, checked=True)
        if identity is not None:
            version = (identity.version[0], identity.size)
            return manifest_bytes(manifest_path, version)
        return read_bytes(manifest_path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
        if path.exists() and not path.is_dir():
            raise StoreError(
                f"{path}: a file, not a store directory (give the directory `pipeline "
                "prepare` wrote)"
            ) from error
        local = not is_url(path)
        read_in_place = hint(Path(path)) if local else ""
        if not path.is_dir():
            why = read_in_place or " (create it with `pipeline prepare`)"
            raise StoreError(f"{path}: no such store directory{why}") from error
        raise StoreError(
            f"{path}: not a token store{read_in_place}"
            if read_in_place
            else f"{path}: not a token store ({MANIFEST} is missing; an interrupted prepare "
            "never leaves one: run `pipeline prepare` again)"
        ) from error
    except OSError as error:
        raise StoreError(f"{manifest_path}: unreadable manifest: {error}") from None


def parse_manifest(
    data: bytes, manifest_path: str, digest: str, checked: str | None = None
) -> dict[str, Any]:
    """The manifest of bytes `data` (of SHA-256 `digest`, read from `manifest_path`), checked
    (`load_manifest`) unless they are the bytes of SHA-256 `checked`."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreError(f"{manifest_path}: unreadable manifest: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StoreError(f"{manifest_path}: not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") not in (FORMAT_VERSION, MASKED_FORMAT_VERSION):
        raise StoreError(
            f"{manifest_path}: format version {manifest.get('format_version')}, this "
            f"version of pipeline reads {FORMAT_VERSION} and {MASKED_FORMAT_VERSION}: prepare "
            "the store again"
        )
    if digest != checked:
        check_manifest(
            manifest, manifest_path, masked=manifest["format_version"] == MASKED_FORMAT_VERSION
        )
    return manifest
