"""`pipeline prepare`: text in, token stores out (the local runner).

Documents stream from the inputs, are tokenized (optionally by a pool of worker processes),
placed by `doc_order.place`, and spilled to one temporary file per (split, shard). Each shard is
then sorted and written with `writer` (with workers, one shard per worker at a time, on the
pool that tokenized). Memory is bounded by one shard per worker, not the corpus.
The Beam runner (`prepare_beam`) performs the same steps with the same functions.

Instruction and chat rows (`--format`, builtin instruction corpora) are rendered into segments
by `chat.render`, each segment tokenized on its own, and the store records which token ranges
are not trained on (a *masked* store, see docs/instruction-data.md). A bad row stops `prepare`
with its file and line, or with `--skip-bad-rows` is counted in the manifest and left out.
"""

from __future__ import annotations

import itertools
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from pipeline.errors import PrepareError
from pipeline.ingest.chat import (
    TRAIN_ON,
    BadRow,
    ChatTemplate,
    RowFields,
    Segment,
    load_template,
    render,
)
from pipeline.ingest.corpora import (
    Document,
    InputSpec,
    check_fields_read,
    iter_documents,
    resolve_inputs,
)
from pipeline.ingest.doc_order import EVAL, TRAIN, place
from pipeline.ingest.tokenizers import Tokenizer, load_tokenizer
from pipeline.ingest.worker_pool import WorkerPool
from pipeline.progress import progress_bar
from pipeline.store.doc_ids import check_unique
from pipeline.store.writer import (
    DEFAULT_RECORD_TOKENS,
    ShardInfo,
    check_destination,
    commit,
    shard_name,
    staging_dir,
    token_dtype,
    write_manifest,
    write_shard,
)
from pipeline.urls import location, remove_tree

# order hash, key bytes, id bytes, token count, untrained spans
_SPILL_HEADER = struct.Struct("<QIIII")
T = TypeVar("T")
ID_FORMATS = ("jsonl", "parquet")  # the file formats that read `--id-field`


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: Path
    tokenizer: str = "bytes"
    num_shards: int = 8
    seed: int = 0
    workers: int = 1
    eval_fraction: float = 0.0
    record_tokens: int = DEFAULT_RECORD_TOKENS
    flat_tokens: bool = True  # write the flat token sidecar the feed reads (token-store.md)
    eval_out: Path | None = None
    text_field: str = "text"
    tfds_data_dir: str | None = None
    overwrite: bool = False
    progress: bool = True
    fields: RowFields = field(default_factory=RowFields)
    # the field options the user gave (``--text-field``): refused when no input reads a field
    field_options: tuple[str, ...] = ()
    train_on: str = "assistant"
    chat_template: str = "auto"
    skip_bad_rows: bool = False
    # document ids (doc_ids.py): `id_field` of JSONL/Parquet rows, the key of other documents
    id_field: str | None = None
    record_ids: bool = False  # record ids (the keys) without an id field
    destinations: dict[str, Path] = field(init=False)

    @property
    def ids(self) -> bool:
        """Whether the store records document ids."""
        return self.record_ids or self.id_field is not None

    def __post_init__(self) -> None:
        self.out = location(self.out)
        if self.record_tokens < 1:
            raise PrepareError(f"--record-tokens must be at least 1, got {self.record_tokens}")
        if self.num_shards < 1:
            raise PrepareError(f"--num-shards must be at least 1, got {self.num_shards}")
        if self.workers < 1:
            raise PrepareError(f"--workers must be at least 1, got {self.workers}")
        if self.train_on not in TRAIN_ON:
            raise PrepareError(f"--train-on {self.train_on!r}: valid: {', '.join(TRAIN_ON)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise PrepareError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        self.destinations = {TRAIN: self.out}
        if self.eval_fraction > 0:
            eval_out = self.eval_out or self.out.with_name(self.out.name + "-eval")
            self.destinations[EVAL] = location(eval_out)


def tokenize_document(tokenizer: Tokenizer, dtype: np.dtype, text: str) -> np.ndarray:
    """A document's tokens with the end-of-document id appended, in the store's dtype."""
    return tokenize_segments(tokenizer, dtype, [Segment(text, True)])[0]


def tokenize_segments(
    tokenizer: Tokenizer, dtype: np.dtype, segments: list[Segment]
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the segments, each tokenized on its own, then eod; and the untrained ranges
    (int64 `[k, 2]`). The eod is trained when the last segment is (a model learns to stop)."""
    ids = [tokenizer.encode(segment.text) for segment in segments]
    ends = np.cumsum([0, *map(len, ids)])
    tokens = np.empty(int(ends[-1]) + 1, dtype=dtype)
    tokens[:-1] = np.concatenate([np.zeros(0, np.int64), *ids])
    tokens[-1] = tokenizer.eod_id
    untrained = [
        (int(ends[i]), int(ends[i + 1]) + (i == len(segments) - 1))
        for i, segment in enumerate(segments)
        if not segment.trained and ends[i + 1] > ends[i]
    ]
    return tokens, np.array(untrained, dtype=np.int64).reshape(-1, 2)


class DocumentEncoder:
    """Document -> (tokens with eod, untrained ranges), or None for a skipped bad row.

    Both runners call it (in worker processes too: it pickles as its settings, and compiles
    the chat template on first use).
    """

    def __init__(
        self,
        options: PrepareOptions,
        tokenizer: Tokenizer,
        dtype: np.dtype,
        template: ChatTemplate,
    ) -> None:
        self.tokenizer = tokenizer
        self.dtype = np.dtype(dtype)
        self.train_on = options.train_on
        self.skip_bad_rows = options.skip_bad_rows
        self.template = template
        self._render: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_render": None}

    def many(self, documents: list[Document]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Each document as `__call__` returns it; the plain texts in one `encode_batch`."""
        ids = iter(self.tokenizer.encode_batch([d.text for d in documents if d.row is None]))
        return [self._with_eod(next(ids)) if d.row is None else self(d) for d in documents]

    def _with_eod(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.empty(len(ids) + 1, dtype=self.dtype)
        tokens[:-1] = ids
        tokens[-1] = self.tokenizer.eod_id
        return tokens, _NO_SPANS

    def __call__(self, document: Document) -> tuple[np.ndarray, np.ndarray] | None:
        if document.row is None:
            return tokenize_document(self.tokenizer, self.dtype, document.text), _NO_SPANS
        if self._render is None and document.fields.format == "messages":
            self._render = self.template.renderer()
        try:
            segments = render(document.row, document.fields, self.train_on, self._render)
            tokens, untrained = tokenize_segments(self.tokenizer, self.dtype, segments)
            if int(np.sum(untrained[:, 1] - untrained[:, 0])) == len(tokens):
                raise BadRow("every token is outside the trained spans: nothing to train on")
        except BadRow as error:
            if self.skip_bad_rows:
                return None
            raise PrepareError(
                f"{document.where}: {error} (fix the row, or pass --skip-bad-rows to leave "
                "bad rows out and count them)"
            ) from None
        return tokens, untrained


_NO_SPANS = np.zeros((0, 2), np.int64)


def has_rows(specs: list[InputSpec]) -> bool:
    """Whether the inputs hold instruction or chat rows, so the store carries a loss mask."""
    return any(spec.fields is not None for spec in specs)


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "name": tokenizer.name,
        "kind": tokenizer.kind,
        "model_sha256": tokenizer.model_sha256,
        "spec": tokenizer.spec,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
    }


def creation_record(
    options: PrepareOptions, split: str, empty: int, bad: int | None, template: ChatTemplate
) -> dict[str, Any]:
    """What made the store; identical for identical inputs, so stores compare byte for byte.

    `bad` is None for a store without rows; a masked store also records how rows were read.
    """
    rows = {}
    if bad is not None:
        rows = {
            "row_format": asdict(options.fields),
            "train_on": options.train_on,
            "chat_template": {"name": template.name, "sha256": template.sha256},
            "bad_rows_skipped": bad,
        }
    return {
        **rows,
        "inputs": list(options.inputs),
        "text_field": options.text_field,
        "seed": options.seed,
        "num_shards": options.num_shards,
        "record_tokens": options.record_tokens,
        "eval_fraction": options.eval_fraction,
        "split": split,
        "empty_documents_dropped": empty,
        **({"document_ids": options.id_field or "key"} if options.ids else {}),
    }


@dataclass(frozen=True)
class Validated:
    """What `validate` resolved, for the runners."""

    specs: list[InputSpec]
    tokenizer: Tokenizer
    dtype: np.dtype
    template: ChatTemplate
    masked: bool

    def encoder(self, options: PrepareOptions) -> DocumentEncoder:
        return DocumentEncoder(options, self.tokenizer, self.dtype, self.template)


def validate(options: PrepareOptions) -> Validated:
    """Everything a runner checks before any work: inputs, tokenizer, template, destinations."""
    specs = resolve_inputs(
        options.inputs, options.text_field, options.tfds_data_dir, options.fields
    )
    if options.id_field is not None:
        if not any(kind in ID_FORMATS for spec in specs for _, kind, _ in spec.files):
            raise PrepareError(
                f"--id-field {options.id_field}: no input is a JSONL or Parquet file, which is "
                "where it is read; pass --record-ids to record each document's key as its id"
            )
        specs = [replace(spec, id_field=options.id_field) for spec in specs]
    check_fields_read(specs, options.field_options, options.fields.format)
    tokenizer = load_tokenizer(options.tokenizer)
    masked = has_rows(specs)
    template = load_template(options.chat_template, options.tokenizer)
    if masked and any(s.fields.format == "messages" for s in specs if s.fields):
        template.renderer()  # a template that does not compile fails now, not in a worker
    for destination in options.destinations.values():
        check_destination(destination, options.overwrite)
    return Validated(specs, tokenizer, token_dtype(tokenizer.vocab_size), template, masked)


def finish(
    options: PrepareOptions,
    stagings: dict[str, Path],
    shards: dict[str, list[ShardInfo]],
    empty: dict[str, int],
    bad: int,
    validated: Validated,
) -> None:
    """Both runners' last step: every manifest, then the atomic renames (train first)."""
    bad_rows = bad if validated.masked else None  # the CLI's summary line names them
    _require_documents(shards, options, sum(empty.values()), bad)
    if options.ids:
        for split, staging in stagings.items():
            check_unique(staging, shards[split], str(options.destinations[split]))
    for split, staging in stagings.items():
        record = creation_record(options, split, empty[split], bad_rows, validated.template)
        tokenizer = tokenizer_record(validated.tokenizer)
        write_manifest(staging, shards[split], tokenizer, validated.dtype, record)
    for split, staging in stagings.items():
        commit(staging, options.destinations[split], options.overwrite)


def prepare(options: PrepareOptions) -> dict[str, Path]:
    """Prepare the train (and eval) store; returns split -> store path. Validates first."""
    validated = validate(options)
    stagings = {split: staging_dir(path) for split, path in options.destinations.items()}
    encode = partial(
        _spill_batch,
        validated.encoder(options),
        options.seed,
        options.num_shards,
        options.eval_fraction,
        options.ids,
    )
    try:
        with WorkerPool(options.workers, encode) as workers:  # one pool for both steps
            spills, empty, bad = _tokenize_and_spill(options, validated, stagings, workers.imap)
            shards = _write_shards(options, validated, stagings, spills, workers.starmap)
        finish(options, stagings, shards, empty, bad, validated)
    finally:
        for staging in stagings.values():
            remove_tree(staging)
    return dict(options.destinations)


def _write_shards(
    options: PrepareOptions,
    validated: Validated,
    stagings: dict[str, Path],
    spills: dict[str, list[Path]],
    starmap: Callable[..., list[Any]],
) -> dict[str, list[ShardInfo]]:
    """Sort and write every (split, shard) from its spill file. The shards are independent,
    so `starmap` writes them on the pool that tokenized, one shard per worker at a time."""
    tasks = [(split, shard) for split in stagings for shard in range(options.num_shards)]
    write = partial(
        _write_spilled_shard,
        num_shards=options.num_shards,
        dtype=validated.dtype,
        record_tokens=options.record_tokens,
        flat=options.flat_tokens,
        masked=validated.masked,
        ids=options.ids,
    )
    arguments = [
        (stagings[split], shard, spills[split][shard], str(options.destinations[split]))
        for split, shard in tasks
    ]
    shards: dict[str, list[ShardInfo]] = {split: [] for split in stagings}
    for (split, _), info in zip(tasks, starmap(write, arguments), strict=True):
        shards[split].append(info)
    for staging in stagings.values():
        shutil.rmtree(staging / ".spill")
    return shards


def _write_spilled_shard(
    staging: Path,
    shard: int,
    spill: Path,
    store: str,
    *,
    num_shards: int,
    dtype: np.dtype,
    record_tokens: int,
    flat: bool,
    masked: bool,
    ids: bool,
) -> ShardInfo:
    """One shard of `store` (its staging directory) from its spill file, in a pool worker too.
    An OSError becomes a `PrepareError` here, where its file is still known: a worker's OSError
    reaches the main process without its file name (pickling drops it)."""
    try:
        return write_shard(
            staging,
            shard,
            num_shards,
            _sorted_spill(spill, dtype, masked, ids),
            dtype,
            record_tokens,
            flat,
            masked,
            ids,
        )
    except OSError as error:
        raise PrepareError(
            f"{store}: writing {shard_name(shard, num_shards)} failed: {error}"
        ) from None


def _tokenize_and_spill(
    options: PrepareOptions,
    validated: Validated,
    stagings: dict[str, Path],
    imap: Callable[[Iterable[list[Document]]], Iterator[_Spilled]],
) -> tuple[dict[str, list[Path]], dict[str, int], int]:
    """Every batch of documents through `imap` (tokenized and placed), its records appended
    to the spill file of their (split, shard); returns the spill files and the counts."""
    spills = {}
    for split, staging in stagings.items():
        (staging / ".spill").mkdir()
        spills[split] = [staging / ".spill" / f"{s:05d}.bin" for s in range(options.num_shards)]
    handles: dict[Path, BinaryIO] = {}
    empty = dict.fromkeys(stagings, 0)
    bad = 0
    tokens_total = 0
    batches = document_batches(_all_documents(validated.specs))
    bar = progress_bar(desc="prepare", unit=" doc", enabled=options.progress)
    try:
        for spilled in imap(batches):
            for (split, shard), data in spilled.records.items():
                path = spills[split][shard]
                handle = handles.get(path) or handles.setdefault(path, open(path, "ab"))  # noqa: SIM115
                handle.write(data)
            bad += spilled.bad
            for split, count in spilled.empty.items():
                empty[split] += count
            tokens_total += spilled.tokens
            bar.update(spilled.documents)
            bar.set_postfix_str(  # drawn with the bar's next redraw, not one per batch
                f"{tokens_total / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s",
                refresh=False,
            )
    finally:
        for handle in handles.values():
            handle.close()
        bar.close()
    for paths in spills.values():
        for path in paths:
            path.touch()
    return spills, empty, bad


def _all_documents(specs: list[InputSpec]) -> Iterator[Document]:
    for spec in specs:
        yield from iter_documents(spec)


BATCH_CHARACTERS = 1 << 20
"""Text per task: one `encode_batch` call, one message to a worker and one back. Large enough
that per-call and per-message costs vanish, small enough that `workers` tasks in flight (each
about 2x its text's bytes in tokens and spill records) stay a few MB."""
BATCH_DOCUMENTS = 4096  # the bound for documents without text (rows, rendered when encoded)


def document_batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    """The documents in batches of at most BATCH_CHARACTERS of text or BATCH_DOCUMENTS
    documents: one `encode_batch` each (the local runner's tasks, Beam's bundles)."""
    batch: list[Document] = []
    characters = 0
    for document in documents:
        batch.append(document)
        characters += len(document.text)
        if characters >= BATCH_CHARACTERS or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


@dataclass(frozen=True)
class _Spilled:
    """A batch's spill records, each (split, shard)'s as one byte string (one write, and one
    string to send from a worker, not an object per document), and what the batch counted."""

    records: dict[tuple[str, int], bytes]
    empty: dict[str, int]  # empty texts, dropped, per split
    bad: int  # bad rows skipped
    documents: int  # documents stored
    tokens: int


def _spill_batch(
    encoder: DocumentEncoder,
    seed: int,
    num_shards: int,
    eval_fraction: float,
    ids: bool,
    documents: list[Document],
) -> _Spilled:
    """Tokenize and place a batch; its spill records in document order per (split, shard),
    each with the document's id when `ids`."""
    records: dict[tuple[str, int], list[bytes]] = {}
    empty: dict[str, int] = {}
    bad = stored = tokens_total = 0
    for document, encoded in zip(documents, encoder.many(documents), strict=True):
        if encoded is None:  # a bad row, skipped with --skip-bad-rows
            bad += 1
            continue
        placement = place(document.key, seed, num_shards, eval_fraction)
        tokens, untrained = encoded
        if len(tokens) == 1:  # only the eod: an empty text is dropped and counted
            empty[placement.split] = empty.get(placement.split, 0) + 1
            continue
        raw_key = document.key.encode()
        raw_id = document.document_id.encode() if ids else b""
        sizes = (len(raw_key), len(raw_id), len(tokens), len(untrained))
        parts = records.setdefault((placement.split, placement.shard), [])
        parts += [_SPILL_HEADER.pack(placement.order, *sizes), raw_key, raw_id]
        parts += [tokens.tobytes(), untrained.tobytes()]
        stored += 1
        tokens_total += len(tokens)
    joined = {where: b"".join(parts) for where, parts in records.items()}
    return _Spilled(joined, empty, bad, stored, tokens_total)


def _sorted_spill(path: Path, dtype: np.dtype, masked: bool, ids: bool) -> Iterator[Any]:
    """A shard's documents in (order hash, key) order (with their untrained ranges when
    `masked`, each `(document, id)` with `ids`: `writer.write_shard`'s items); a repeated key
    is an error."""
    entries = []
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        order, key_len, id_len, count, spans = _SPILL_HEADER.unpack_from(data, pos)
        pos += _SPILL_HEADER.size
        key = data[pos : pos + key_len].decode()
        document_id = data[pos + key_len : pos + key_len + id_len].decode()
        pos += key_len + id_len
        entries.append((order, key, (pos, count, spans, document_id)))
        pos += count * dtype.itemsize + spans * 16
    for start, count, spans, document_id in sort_shard(entries):
        document: Any = np.frombuffer(data, dtype=dtype, count=count, offset=start)
        if masked:
            offset = start + count * dtype.itemsize
            untrained = np.frombuffer(data, np.int64, spans * 2, offset).reshape(-1, 2)
            document = (document, untrained)
        yield (document, document_id) if ids else document


def sort_shard(entries: list[tuple[int, str, T]]) -> list[T]:
    """The payloads of a shard's `(order, key, payload)` entries in (order, key) order.

    The one definition of a shard's document order, shared by both runners; a repeated key is
    an error (the same input given twice).
    """
    entries = sorted(entries, key=lambda entry: (entry[0], entry[1]))
    for (_, key, _), (_, next_key, _) in itertools.pairwise(entries):
        if key == next_key:
            raise PrepareError(f"document key {key!r} occurs twice: the same input is given twice")
    return [payload for _, _, payload in entries]


def _require_documents(
    shards: dict[str, list[ShardInfo]], options: PrepareOptions, empty: int, bad: int
) -> None:
    """Refuse a split without documents, saying why: nothing to store at all, or
    --eval-fraction held out all documents (train) or none of them (eval)."""
    counts = {split: sum(s.documents for s in infos) for split, infos in shards.items()}
    total = sum(counts.values())
    if total == 0:
        skipped = f", {bad} bad rows skipped" if bad else ""
        raise PrepareError(
            f"{', '.join(options.inputs)}: no non-empty documents ({empty} empty{skipped}); "
            "nothing to store"
        )
    fraction = options.eval_fraction
    if counts[TRAIN] == 0:
        raise PrepareError(
            f"--eval-fraction {fraction} held out all {total} documents, none is left for "
            "training; lower it"
        )
    if counts.get(EVAL) == 0:
        raise PrepareError(
            f"--eval-fraction {fraction} held out none of the {total} documents (about "
            f"{fraction * total:.2g} expected); raise it, or leave it out on a corpus this small"
        )
