"""A checked manifest's shard entries parsed one at a time (`manifest_text`): each is the entry
a whole parse gives, whatever the manifest's layout, and a store opened from a host's summary
reads a shard without parsing its whole manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store.formats import load_meta
from pipeline.store.manifest_spans import entry_spans, loads
from pipeline.store.manifest_text import ManifestText
from pipeline.store.meta import StoreMeta
from pipeline.store.meta_cache import CACHE_ENV, Summaries
from pipeline.store.token_store import TokenStore
from tests.storegen import write_synthetic_store

# Strings that would mislead a parser that looked for brackets or braces alone.
TEXT = st.text(alphabet='ab{}[]",:\\ \n\t\u00e9', max_size=6)
SCALAR = st.one_of(st.integers(-5, 10**12), TEXT, st.booleans(), st.none())
VALUE = st.recursive(
    SCALAR,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(TEXT | st.just("shards"), inner, max_size=3)
    ),
    max_leaves=6,
)
ENTRY = st.fixed_dictionaries(
    {"file": TEXT, "tokens": st.integers(0, 10**9), "sha256": st.just("ab" * 32)},
    optional={"extra": VALUE, "created": VALUE},
)


def text_of(data: bytes, shards: int) -> ManifestText:
    """`data` as a store's open keeps the bytes a host checked before: unparsed."""
    meta = StoreMeta(Path("s"), "f", np.zeros(shards, np.int64), np.dtype(np.uint16), {})
    return ManifestText(data, "digest", meta, None)


@settings(max_examples=300, deadline=None)
@given(
    shards=st.lists(ENTRY, min_size=1, max_size=5),
    created=VALUE,
    tokenizer=VALUE,
    indent=st.sampled_from([None, 0, 1, 2, 4, "\t"]),
    sort_keys=st.booleans(),
)
def test_an_entry_is_the_one_a_whole_parse_gives_in_any_layout(
    shards, created, tokenizer, indent, sort_keys
):
    """Entries whose strings or values hold brackets and braces, in layouts of every indent:
    `entry` cuts out only what provably parses to the entry, and parses whole otherwise."""
    manifest = {"created": created, "shards": shards, "tokenizer": tokenizer, "dtype": "uint16"}
    data = json.dumps(manifest, indent=indent, sort_keys=sort_keys).encode()
    text = text_of(data, len(shards))
    for k, expected in enumerate(shards):
        assert text.entry(k) == expected
    assert text.manifest() == json.loads(data)


def test_the_layout_write_manifest_writes_is_cut_entry_by_entry(tmp_path: Path) -> None:
    """A prepared store's manifest (`write_manifest`'s layout, a creation record with lists
    and objects) has its entries cut out, each the whole parse's."""
    store = write_synthetic_store(tmp_path / "s", [[5, 9], [3, 4], [7]])
    path = store.path
    store.close()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["created"] = {"inputs": ["a{b]", "c"], "row_format": {"x": [1, {"y": "}"}]}}
    data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    spans = entry_spans(data, 3)
    assert len(spans) == 3
    assert [json.loads(data[a:b]) for a, b in spans] == manifest["shards"]


def test_a_store_opened_from_a_summary_reads_a_shard_without_parsing_its_manifest(
    tmp_path: Path, monkeypatch
) -> None:
    """The store's open hashes the manifest's bytes against the summary's digest and parses
    none of them; its shard's first use parses that shard's entry only; `manifest` parses
    the whole when asked."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "s"
    write_synthetic_store(path, [[5, 9], [3, 4], [7, 2]]).close()
    summaries = Summaries([path])
    load_meta(path, summaries)  # read, and kept in the summary
    summaries.save()
    meta = load_meta(path, Summaries([path]))
    assert meta.checked is not None and meta.__dict__.get("_read") is None
    reference = TokenStore(path)
    store = TokenStore(path, known=meta)
    np.testing.assert_array_equal(
        store.read_shard_tokens(1, 0, 7).tokens, reference.read_shard_tokens(1, 0, 7).tokens
    )
    assert store._text.data is not None and store._text._manifest is None  # one entry parsed
    assert [e is not None for e in store._text._entries] == [False, True, False]
    assert store.manifest == reference.manifest == json.loads((path / "manifest.json").read_text())
    store.close()
    reference.close()


def summarised(tmp_path: Path, monkeypatch) -> tuple[Path, StoreMeta]:
    """A store of three shards and its metadata as a restart plans it: from the summary."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "s"
    write_synthetic_store(path, [[5, 9], [3, 4], [7, 2]]).close()
    summaries = Summaries([path])
    load_meta(path, summaries)
    summaries.save()
    return path, load_meta(path, Summaries([path]))


def test_a_summary_records_where_the_entries_are_and_an_open_takes_them(
    tmp_path: Path, monkeypatch
) -> None:
    """The summary (version 3) keeps each entry's position in the checked bytes: the open of
    a store planned from it starts with them, and each entry cut there is the whole parse's."""
    path, meta = summarised(tmp_path, monkeypatch)
    data = (path / "manifest.json").read_bytes()
    assert meta.spans == entry_spans(data, 3) != []
    store = TokenStore(path, known=meta)
    assert [store._text.entry(k) for k in range(3)] == json.loads(data)["shards"]
    assert store._text._spans == meta.spans
    store.close()


def test_recorded_positions_that_hold_no_entry_are_looked_for_again(
    tmp_path: Path, monkeypatch
) -> None:
    """Positions that do not bound an object in the bytes (a summary of a bug's, its checksum
    redone) are not parsed as entries: the entries are found in the bytes, as without them."""
    path, meta = summarised(tmp_path, monkeypatch)
    data = (path / "manifest.json").read_bytes()
    for wrong in (np.zeros(6, np.int64), np.array([1, 40, 2, 9, 0, len(data)], np.int64)):
        object.__setattr__(meta, "_spans", (wrong, 0))
        store = TokenStore(path, known=meta)
        assert [store._text.entry(k) for k in range(3)] == json.loads(data)["shards"]
        assert store._text._spans == entry_spans(data, 3)
        store.close()


TRICKY = [  # (manifest bytes, its shards): layouts a cut by brackets alone would misread
    # a nested "shards" list laid out as the top-level one is
    b'{"created": {"shards": [\n  {"tokens": 1}\n  ]}, "shards": [{"tokens": 5}], "t": {}}',
    # the top-level list's end written as `write_manifest` writes it, a brace in a string
    b'{"shards": [\n{"file": "}{", "tokens": 2}\n  ], "tokenizer": {"a": [1]}}',
    # a nested list inside an entry
    b'{"shards": [\n{"tokens": 3, "x": [\n  ]}\n  ]}',
]


def test_layouts_that_look_like_the_writers_are_parsed_as_json_parses_them() -> None:
    for data in TRICKY:
        shards = json.loads(data)["shards"]
        text = text_of(data, len(shards))
        assert [text.entry(k) for k in range(len(shards))] == shards, data


def _answer(parse, data: bytes) -> object:
    try:
        return ("value", parse(data))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        return ("error", type(error), str(error))


@settings(max_examples=300, deadline=None)
@given(
    VALUE,
    st.sampled_from(["", " ", "\n", "\ufeff", " x", "]", "\t\r\n "]),
    st.sampled_from(["", " ", "\n  "]),
    st.sampled_from(["utf-8", "utf-16", "utf-8-sig"]),
    st.integers(0, 12),
)
def test_a_parse_by_the_scanner_alone_gives_json_loads_value_or_error(
    value: object, tail: str, head: str, encoding: str, cut: int
) -> None:
    """`loads` is `json.loads` of any bytes: a value, text after it, whitespace or a BOM
    before it, other encodings, bytes cut short."""
    text = (head + json.dumps(value, indent=2, ensure_ascii=False) + tail).encode(encoding)
    for data in (text, text[: len(text) - cut]):
        assert _answer(loads, data) == _answer(json.loads, data)


def test_an_open_and_a_first_use_read_each_small_file_in_one_read(
    tmp_path: Path, monkeypatch
) -> None:
    """Bytes that are then hashed and compared with a digest (the manifest at the open, a
    shard's indexes and block checksums at its first use) are read by one `read` a file: a
    short read is the file's end, not confirmed by another; what it reads is what a read to
    the end gives (the tokens served, equal)."""
    path, meta = summarised(tmp_path, monkeypatch)
    reference = TokenStore(path)
    expected = reference.read_shard_tokens(1, 0, 7).tokens
    reads: list[int] = []
    real = os.read

    def counted(fd: int, size: int) -> bytes:
        data = real(fd, size)
        reads.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counted)
    store = TokenStore(path, known=meta)
    assert store._text._entries[1] is None  # nothing of shard 1 read yet
    store.shard_view(1)
    files = 1 + len([key for key in ("index", "docs", "flat_blocks", "untrained")
                     if key in store._text.entry(1)])  # fmt: skip
    assert len(reads) == files and 0 not in reads
    monkeypatch.undo()
    np.testing.assert_array_equal(store.read_shard_tokens(1, 0, 7).tokens, expected)
    store.close()
    reference.close()
