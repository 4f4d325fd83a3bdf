"""TokenStore: random corpora prepared into real stores read back exactly, by any token range."""

from __future__ import annotations

import io
import json
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib import format as npy_format

from pipeline.errors import PrepareError, StoreError
from pipeline.ingest.doc_order import Placement, place
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.store import piece_reads, shard_check
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore, is_store, read_pieces

EOD = 256
# Any text that is valid UTF-8: no lone surrogates. Empty texts are included on purpose.
TEXTS = st.lists(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    min_size=1,
    max_size=30,
)


def _prepare_jsonl(
    directory: Path, texts: list[str], num_shards: int, seed: int, record_tokens: int = 2048
) -> Path:
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = directory / "store"
    prepare(
        PrepareOptions(
            inputs=[str(corpus)],
            out=out,
            num_shards=num_shards,
            seed=seed,
            record_tokens=record_tokens,
            progress=False,
        )
    )
    return out


def _expected_shards(texts: list[str], num_shards: int, seed: int) -> list[list[np.ndarray]]:
    """Each shard's documents (bytes + eod) in store order, derived from the keys alone."""
    placed = []
    for line, text in enumerate(texts, start=1):
        if not text:
            continue
        key = f"corpus.jsonl:{line}"
        where = place(key, seed, num_shards, 0.0)
        tokens = np.array([*text.encode("utf-8"), EOD], dtype=np.int64)
        placed.append((where.shard, where.order, key, tokens))
    placed.sort(key=lambda p: p[:3])
    shards: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for shard, _, _, tokens in placed:
        shards[shard].append(tokens)
    return shards


def _stream(documents: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated tokens and the offsets where documents start."""
    if not documents:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    lengths = np.array([len(d) for d in documents])
    return np.concatenate(documents), np.concatenate([[0], np.cumsum(lengths)[:-1]])


def _check_range(span_tokens: np.ndarray, span_starts: np.ndarray, stream, a: int, b: int) -> None:
    tokens, starts = stream
    np.testing.assert_array_equal(span_tokens.astype(np.int64), tokens[a:b])
    inside = starts[(starts >= a) & (starts < b)] - a
    np.testing.assert_array_equal(span_starts, inside)


@settings(max_examples=25, deadline=None)
@given(
    texts=TEXTS,
    num_shards=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    record_tokens=st.sampled_from([1, 3, 16, 2048]),  # long documents span several records
    data=st.data(),
)
def test_round_trip_any_range(
    texts: list[str], num_shards: int, seed: int, record_tokens: int, data
) -> None:
    non_empty = [t for t in texts if t]
    with tempfile.TemporaryDirectory() as tmp:
        if not non_empty:  # an all-empty corpus is refused, never written as an empty store.
            with pytest.raises(PrepareError, match="no non-empty documents"):
                _prepare_jsonl(Path(tmp), texts, num_shards, seed, record_tokens)
            assert not any(Path(tmp).glob("store*")) and not any(Path(tmp).glob(".store*"))
            return
        path = _prepare_jsonl(Path(tmp), texts, num_shards, seed, record_tokens)
        with TokenStore(path, verify=True) as store:
            shards = _expected_shards(texts, num_shards, seed)
            documents = [d for shard in shards for d in shard]
            stream = _stream(documents)
            assert store.num_shards == num_shards
            assert store.num_documents == len(non_empty) == len(documents)
            assert store.num_tokens == len(stream[0])
            lengths = [len(d) for d in documents]
            records = sum(-(-length // record_tokens) for length in lengths)
            assert store.manifest["num_records"] == records
            assert store.manifest["created"]["empty_documents_dropped"] == texts.count("")
            assert (store.dtype, store.eod_id, store.vocab_size) == (np.uint16, EOD, 257)

            # Every document comes back whole: the store holds exactly the non-empty texts.
            stored = []
            for shard in range(store.num_shards):
                offsets = store.doc_offsets(shard)
                assert offsets[0] == 0 and len(offsets) == store.shard_documents[shard] + 1
                for record in range(int(store.shard_documents[shard])):
                    doc = store.document(shard, record)
                    assert len(doc) == offsets[record + 1] - offsets[record]
                    assert doc[-1] == EOD
                    stored.append(bytes(doc[:-1].astype(np.uint8)).decode("utf-8"))
            assert Counter(stored) == Counter(non_empty)

            # Whole stream, then random ranges of it (including empty ones and the ends).
            n = store.num_tokens
            whole = store.read_tokens(0, n)
            _check_range(whole.tokens, whole.doc_starts, stream, 0, n)
            assert whole.tokens.dtype == np.uint16
            for _ in range(8):
                a = data.draw(st.integers(0, n), label="a")
                b = data.draw(st.integers(a, n), label="b")
                span = store.read_tokens(a, b)
                _check_range(span.tokens, span.doc_starts, stream, a, b)

            # Ranges of single shards, across record boundaries.
            for shard, docs in enumerate(shards):
                shard_stream = _stream(docs)
                size = int(store.shard_tokens[shard])
                assert size == len(shard_stream[0])
                for _ in range(3):
                    a = data.draw(st.integers(0, size), label="shard a")
                    b = data.draw(st.integers(a, size), label="shard b")
                    span = store.read_shard_tokens(shard, a, b)
                    _check_range(span.tokens, span.doc_starts, shard_stream, a, b)

            # Out of range: a clear StoreError, never a short read or another shard's data.
            for a, b in [(-1, 1), (0, n + 1), (n, n + 1), (min(2, n), min(1, n - 1))]:
                with pytest.raises(StoreError, match="outside the stream"):
                    store.read_tokens(a, b)
            size = int(store.shard_tokens[0])
            with pytest.raises(StoreError, match="outside the shard"):
                store.read_shard_tokens(0, 0, size + 1)
            with pytest.raises(StoreError, match="outside the shard"):
                store.read_shard_tokens(0, -1, 0)
            for shard in (-1, num_shards):
                with pytest.raises(StoreError, match=f"shard {shard} does not exist"):
                    store.read_shard_tokens(shard, 0, 0)


def test_reads_cross_records_and_shards(tmp_path: Path) -> None:
    """A fixed corpus: a window spanning many documents and a shard boundary, doc by doc."""
    texts = [f"document number {i}: " + "é" * (i % 7) for i in range(60)]
    path = _prepare_jsonl(tmp_path, texts, num_shards=3, seed=7)
    store = TokenStore(path)
    documents = [d for shard in _expected_shards(texts, 3, 7) for d in shard]
    stream = _stream(documents)
    boundary = int(store.shard_starts[1])
    assert 0 < boundary < store.num_tokens
    for a, b in [(boundary - 50, boundary + 50), (1, store.num_tokens - 1), (5, 6)]:
        span = store.read_tokens(a, b)
        _check_range(span.tokens, span.doc_starts, stream, a, b)
    # A range that starts exactly on a document start reports that start at 0.
    start = int(stream[1][10])
    assert store.read_tokens(start, start + 3).doc_starts.tolist() == [0]
    # A range that ends exactly on a document start does not report it.
    assert store.read_tokens(start - 3, start).doc_starts.tolist() == []


def test_fingerprint_is_content_not_location(tmp_path: Path) -> None:
    texts = ["alpha", "beta", "gamma", "delta"]
    stores = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        (tmp_path / name).mkdir()
        stores[name] = TokenStore(_prepare_jsonl(tmp_path / name, texts, 2, seed))
    assert stores["a"].fingerprint == stores["b"].fingerprint
    assert len(stores["a"].fingerprint) == 16
    assert stores["c"].fingerprint != stores["a"].fingerprint  # another order, another stream.


def test_opening_something_that_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store directory"):
        TokenStore(tmp_path / "absent")
    (tmp_path / "data.txt").write_text("a file")
    with pytest.raises(StoreError, match=r"data\.txt: a file, not a store directory"):
        TokenStore(tmp_path / "data.txt")
    (tmp_path / "empty").mkdir()
    assert not is_store(tmp_path / "empty")
    with pytest.raises(StoreError, match=r"not a token store \(manifest.json is missing"):
        TokenStore(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="unreadable manifest"):
        TokenStore(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(StoreError, match="not a pipeline-token-store manifest"):
        TokenStore(tmp_path / "bad")
    old = '{"format": "pipeline-token-store", "format_version": 1}'
    (tmp_path / "bad" / "manifest.json").write_text(old)
    assert not is_store(tmp_path / "bad")  # an older format is prepared again, not misread
    with pytest.raises(StoreError, match="format version 1, this version of pipeline reads 3"):
        TokenStore(tmp_path / "bad")


def test_missing_shard_or_index_is_named(tmp_path: Path) -> None:
    path = _prepare_jsonl(tmp_path, ["one", "two", "three"], num_shards=2, seed=0)
    entry = TokenStore(path).manifest["shards"][1]
    named = (("docs", "document index"), ("index", "record index"))
    # the block checksums: read by a shard's first use when reads are checked, else only asked
    # for (the first use skips asking for what it reads: the read refuses it in these words)
    for key, kind in (*named, ("flat_blocks", "block checksum file")):
        index = path / entry[key]
        kept = index.read_bytes()
        index.unlink()
        for check_reads in (True, False):
            store = TokenStore(path, check_reads=check_reads)  # reads the manifest alone
            missing = f"{index}: {kind} listed in the manifest is missing"
            with pytest.raises(StoreError, match=missing):
                store.read_shard_tokens(1, 0, 1)
            store.read_shard_tokens(0, 0, 1)  # the other shard is whole
        index.write_bytes(kept)
    shard = path / "shard-00000-of-00002.array_record"
    shard.unlink()
    with pytest.raises(StoreError, match=f"{shard}: shard listed in the manifest is missing"):
        TokenStore(path).read_shard_tokens(0, 0, 1)


def test_document_placement_is_pinned() -> None:
    """Placement is BLAKE2b of (seed, purpose, key), no RNG stream: a change fails here, as a
    change of every prepared store's bytes (docs/token-store.md, "How documents are placed")."""
    assert [
        place(key, seed, 8, 0.5) for key, seed in [("corpus.jsonl:1", 0), ("sub/file.txt", 3)]
    ] == [
        Placement(split="train", shard=6, order=9789340571358237163),
        Placement(split="eval", shard=3, order=5742358741697071248),
    ]


def test_store_metadata_reads_the_manifest_alone(tmp_path):
    out = _prepare_jsonl(tmp_path, [f"text {i} " * i for i in range(1, 30)], 3, seed=1)
    store = TokenStore(out)
    meta = StoreMeta.load(out)
    assert (meta.fingerprint, meta.num_tokens, meta.num_shards) == (
        store.fingerprint, store.num_tokens, store.num_shards
    )  # fmt: skip
    np.testing.assert_array_equal(meta.shard_starts, store.shard_starts)
    store.close()
    for shard in out.glob("shard-*"):
        shard.unlink()  # planning needs none of them; reading does
    assert StoreMeta.load(out).fingerprint == meta.fingerprint
    with pytest.raises(StoreError, match="missing"):
        TokenStore(out).read_tokens(0, 1)
    with pytest.raises(StoreError, match="not a token store"):
        StoreMeta.load(tmp_path)


def test_flat_sidecar_reads_equal_arrayrecord_reads(tmp_path: Path) -> None:
    """The feed's copy path: pieces through the sidecar and through ArrayRecord are equal."""
    texts = [f"doc {i} " + "x" * (i * 7 % 90) for i in range(80)]
    path = _prepare_jsonl(tmp_path, texts, num_shards=3, seed=2, record_tokens=5)
    flat, records = TokenStore(path), TokenStore(path, flat=False)
    assert all("flat" in entry for entry in flat.manifest["shards"])
    rng = np.random.default_rng(0)
    for shard in range(3):
        size = int(flat.shard_tokens[shard])
        lo = rng.integers(0, size - 1, 12)
        hi = np.minimum(lo + rng.integers(1, 40, 12), size)
        rows, cols = np.arange(12), rng.integers(0, 5, 12)
        outs, docs = [], []
        for store in (flat, records):
            out = np.full((12, 50), -1, np.int32)
            docs.append(
                read_pieces([store], np.zeros(12, int), np.full(12, shard), lo, hi, out, rows, cols)
            )
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])
        for a, b in zip(*docs):
            np.testing.assert_array_equal(a, b)
        for i in range(12):  # and both equal the per-range reader
            span = records.read_shard_tokens(shard, int(lo[i]), int(hi[i]))
            np.testing.assert_array_equal(
                outs[0][i, cols[i] : cols[i] + hi[i] - lo[i]], span.tokens
            )


def test_pieces_of_several_stores_read_and_are_checked_in_one_call(tmp_path: Path) -> None:
    """A step of a mixture reads pieces of many stores in one `read_pieces` call: each piece
    from its own store's shard, and a piece outside its own store's shards or tokens refused
    by that store's name (not another store's with more shards or tokens)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    big = TokenStore(_prepare_jsonl(tmp_path / "a", [f"a {i} " + "y" * i for i in range(60)], 4, 0))
    small = TokenStore(_prepare_jsonl(tmp_path / "b", [f"b {i}" for i in range(9)], 2, 1))
    stores = [big, small]
    which, shards, lo, hi = [1, 0, 1, 0], [1, 3, 0, 0], [0, 2, 1, 5], [3, 9, 4, 6]
    out = np.full((4, 10), -1, np.int32)
    rows, cols = np.arange(4), [0, 1, 2, 3]
    doc_rows, doc_cols = read_pieces(stores, which, shards, lo, hi, out, rows, cols)
    for i in range(4):
        span = stores[which[i]].read_shard_tokens(shards[i], lo[i], hi[i])
        np.testing.assert_array_equal(out[i, cols[i] : cols[i] + hi[i] - lo[i]], span.tokens)
        np.testing.assert_array_equal(doc_cols[doc_rows == i], span.doc_starts + cols[i])
    beyond_shards = small.num_shards  # a shard the big store has and the small one does not
    with pytest.raises(StoreError, match=f"{small.path}: shard {beyond_shards} does not exist"):
        read_pieces(
            stores, [0, 1], [beyond_shards, beyond_shards], [0, 0], [1, 1], out, [0, 1], [0, 0]
        )
    size = int(small.shard_tokens[1])  # inside the big store's shard 1, past the small one's
    assert size + 1 <= big.shard_tokens[1]
    with pytest.raises(StoreError, match=f"{small.shard_file(1)}: token range \\[0, {size + 1}\\)"):
        read_pieces(stores, [0, 1], [1, 1], [0, 0], [size + 1, size + 1], out, [0, 1], [0, 0])


@pytest.mark.parametrize("table", [piece_reads.DOC_TABLE, 0])
def test_document_starts_of_a_batch_in_one_table_or_piece_by_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: int
) -> None:
    """`read_pieces` finds the document starts of a batch's pieces in one table of the offsets
    of every shard read (beyond `DOC_TABLE` offsets, piece by piece): each piece's are its
    shard's own, whole shards, their first token and shards read twice included."""
    monkeypatch.setattr(piece_reads, "DOC_TABLE", table)
    texts = [f"doc {i} " + "z" * (i * 11 % 70) for i in range(90)]
    store = TokenStore(_prepare_jsonl(tmp_path, texts, 3, seed=4, record_tokens=7))
    sizes = store.shard_tokens.tolist()
    rng = np.random.default_rng(1)
    shards, lo, hi = [0, 2], [0, 0], [sizes[0], sizes[2]]  # whole shards
    for shard in [1, 0, 2, 1, 0, 2]:  # out of order, more than once
        start = int(rng.integers(0, sizes[shard] - 1))
        (
            shards.append(shard),
            lo.append(start),
            hi.append(int(rng.integers(start + 1, sizes[shard] + 1))),
        )
    count, cols = len(shards), [i % 3 for i in range(len(shards))]
    out = np.full((count, max(sizes) + 3), -1, np.int32)
    rows, columns = read_pieces([store], [0] * count, shards, lo, hi, out, range(count), cols)
    for i in range(count):
        span = store.read_shard_tokens(shards[i], lo[i], hi[i])
        np.testing.assert_array_equal(columns[rows == i], span.doc_starts + cols[i])
        np.testing.assert_array_equal(out[i, cols[i] : cols[i] + hi[i] - lo[i]], span.tokens)


def test_a_store_without_sidecars_reads_through_arrayrecord(tmp_path: Path) -> None:
    texts = ["alpha beta", "gamma", "delta epsilon zeta"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "store"
    prepare(PrepareOptions([str(corpus)], out, num_shards=2, flat_tokens=False, progress=False))
    store = TokenStore(out, verify=True)
    assert not any("flat" in entry for entry in store.manifest["shards"])
    assert not list(out.glob("*.flat.bin"))
    tokens = np.full((1, store.num_tokens), -1, np.int32)
    starts = [0, int(store.shard_tokens[0])]
    for shard in range(2):
        size = int(store.shard_tokens[shard])
        read_pieces([store], [0], [shard], [0], [size], tokens, [0], [starts[shard]])
    expected = np.concatenate([d for shard in _expected_shards(texts, 2, 0) for d in shard])
    np.testing.assert_array_equal(tokens[0], expected)


def test_a_stale_missing_or_altered_sidecar_is_refused_by_name(tmp_path: Path) -> None:
    path = _prepare_jsonl(tmp_path, [f"text number {i}" for i in range(30)], 2, seed=0)
    entry = TokenStore(path).manifest["shards"][0]
    sidecar = path / entry["flat"]
    data = sidecar.read_bytes()
    out = np.empty((1, 4), np.int32)

    sidecar.write_bytes(data[:-2])  # found by the shard's first use (an open reads no shard)
    with pytest.raises(StoreError, match=f"{sidecar}: flat token sidecar .* missing or not"):
        read_pieces([TokenStore(path)], [0], [0], [0], [4], out, [0], [0])
    sidecar.unlink()
    with pytest.raises(StoreError, match=f"{sidecar}: flat token sidecar .* missing or not"):
        read_pieces([TokenStore(path)], [0], [0], [0], [4], out, [0], [0])

    # Same size, other tokens (another store's or an older prepare's): the shard's first use
    # hashes the sidecar's sampled records against the manifest's sample_sha256.
    sidecar.write_bytes(data[2:] + data[:2])
    with pytest.raises(StoreError, match=f"{sidecar}: its sampled records do not match"):
        read_pieces([TokenStore(path)], [0], [0], [0], [4], out, [0], [0])
    read_pieces([TokenStore(path, flat=False)], [0], [0], [0], [4], out, [0], [0])  # still readable

    # A change in the middle passes the spot check; the block checksums of checked reads (the
    # default) find it on the first read of its block, the full checksum finds it anyway.
    altered = bytearray(data)
    altered[len(altered) // 2] ^= 0xFF
    sidecar.write_bytes(bytes(altered))
    read_pieces([TokenStore(path, check_reads=False)], [0], [0], [0], [4], out, [0], [0])
    with pytest.raises(StoreError, match=f"{sidecar}: bytes 0..{len(data) - 1} do not match"):
        read_pieces([TokenStore(path)], [0], [0], [0], [4], out, [0], [0])
    with pytest.raises(StoreError, match=f"{sidecar}: content checksum does not match"):
        TokenStore(path, verify=True)


class _CloseOtherOnRelease:
    """A shard's lock whose first `with` exit lets `close_other` run just after the release,
    as another thread's read might: the interleaving in which the shard is closed between its
    first use and the caller's look at what that use loaded."""

    def __init__(self, lock: threading.Lock, close_other: Callable[[], None] | None) -> None:
        self.lock, self.close_other = lock, close_other

    def acquire(self, blocking: bool = True) -> bool:
        return self.lock.acquire(blocking)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        close_other, self.close_other = self.close_other, None
        if close_other is not None:
            close_other()


def test_a_twin_sidecar_is_refused_by_its_sampled_records_before_a_byte_is_served(tmp_path):
    """With checked reads a shard's first use maps its sidecar without hashing its sample
    (every byte served is checked against its block checksums first): the first read of a
    twin store's sidecar is refused, naming its sampled records. Without checked reads, and
    before `flat_tokens` hands out the unchecked map, the sample is checked as before."""
    path = _prepare_jsonl(tmp_path, [f"text number {i}" for i in range(30)], 2, seed=0)
    sidecar = path / TokenStore(path).manifest["shards"][0]["flat"]
    data = sidecar.read_bytes()
    sidecar.write_bytes(data[4:] + data[:4])  # same size, other tokens
    blocks = TokenStore(path).flat_blocks(0)  # the first use: sizes and indexes
    with pytest.raises(StoreError, match=f"{sidecar}: its sampled records do not match"):
        blocks.read(0, 4)
    for first_use in (
        lambda: TokenStore(path, check_reads=False).flat_blocks(0),
        lambda: TokenStore(path).flat_tokens(0),
    ):
        with pytest.raises(StoreError, match=f"{sidecar}: its sampled records do not match"):
            first_use()


@pytest.mark.parametrize("read", ["flat_tokens", "doc_offsets"])
def test_a_shard_closed_right_after_its_first_use_still_serves_that_read(tmp_path, read) -> None:
    """With one open shard allowed, another thread reading shard 1 just after shard 0's first
    use released its lock closes shard 0; the read that opened it still gets what it loaded
    (not None: no fall back to ArrayRecord, no missing index)."""
    path = _prepare_jsonl(tmp_path, [f"text number {i}" for i in range(30)], 2, seed=0)
    expected = getattr(TokenStore(path), read)(0)
    store = TokenStore(path, max_open_shards=1)
    readers = store._readers
    readers.locks[0] = _CloseOtherOnRelease(readers.locks[0], lambda: readers.touch(1))
    np.testing.assert_array_equal(getattr(store, read)(0), expected)
    assert store._loaded["flat"][0] is None  # the interleaving happened: shard 0 was closed


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["<i8", "<u4", "<u2", ">i4", "<f8", "|u1"]),
    st.lists(st.integers(0, 5), max_size=3),
    st.booleans(),
    st.sampled_from([(1, 0), (2, 0), None]),
    st.integers(0, 100),
)
def test_an_npy_file_reads_as_numpy_reads_it(dtype, shape, fortran, version, first):
    """A shard's index bytes parse to what `np.load` reads, whether its header is the plain
    one `shard_check` parses itself (kept per header: files of one header and other contents,
    `first`, each read as theirs) or one it leaves to numpy (another version)."""
    order = "F" if fortran else "C"
    array = np.arange(first, first + int(np.prod(shape)), dtype=dtype).reshape(shape, order=order)
    stream = io.BytesIO()
    if version is None:
        np.save(stream, array)
    else:
        npy_format.write_array(stream, array, version=version)
    data = stream.getvalue()
    parsed = shard_check._npy_array(data)
    expected = np.load(io.BytesIO(data))
    assert parsed.dtype == expected.dtype and parsed.shape == expected.shape
    np.testing.assert_array_equal(parsed, expected)
    assert parsed.flags.f_contiguous == expected.flags.f_contiguous
    if array.size:  # a truncated one is refused, not read short
        with pytest.raises(ValueError):
            shard_check._npy_array(data[:-1])
