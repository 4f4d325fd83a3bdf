"""`pipeline prepare`: text in, token stores out (the local runner).

Documents stream from the inputs, are tokenized (optionally by a pool of worker processes),
placed by `doc_order.place`, and spilled to one temporary file per (split, shard). Each shard is
then sorted and written with `store_writer`. Memory is bounded by one shard, not the corpus.
The Beam runner (`prepare_beam`) performs the same steps with the same functions.
"""

from __future__ import annotations

import itertools
import multiprocessing
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from pipeline.errors import PrepareError
from pipeline.progress import progress_bar
from pipeline.store.corpora import Document, InputSpec, iter_documents, resolve_inputs
from pipeline.store.doc_order import EVAL, TRAIN, place
from pipeline.store.tokenizers import Tokenizer, load_tokenizer
from pipeline.store.writer import (
    DEFAULT_RECORD_TOKENS,
    ShardInfo,
    check_destination,
    commit,
    staging_dir,
    token_dtype,
    write_manifest,
    write_shard,
)
from pipeline.urls import location, remove_tree

_SPILL_HEADER = struct.Struct("<QII")  # order hash, key bytes, token count
T = TypeVar("T")


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
    destinations: dict[str, Path] = field(init=False)

    def __post_init__(self) -> None:
        self.out = location(self.out)
        if self.record_tokens < 1:
            raise PrepareError(f"--record-tokens must be at least 1, got {self.record_tokens}")
        if self.num_shards < 1:
            raise PrepareError(f"--num-shards must be at least 1, got {self.num_shards}")
        if self.workers < 1:
            raise PrepareError(f"--workers must be at least 1, got {self.workers}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise PrepareError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        self.destinations = {TRAIN: self.out}
        if self.eval_fraction > 0:
            eval_out = self.eval_out or self.out.with_name(self.out.name + "-eval")
            self.destinations[EVAL] = location(eval_out)


def tokenize_document(tokenizer: Tokenizer, dtype: np.dtype, text: str) -> np.ndarray:
    """A document's tokens with the end-of-document id appended, in the store's dtype."""
    ids = tokenizer.encode(text)
    tokens = np.empty(len(ids) + 1, dtype=dtype)
    tokens[:-1] = ids
    tokens[-1] = tokenizer.eod_id
    return tokens


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "name": tokenizer.name,
        "kind": tokenizer.kind,
        "model_sha256": tokenizer.model_sha256,
        "spec": tokenizer.spec,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
    }


def creation_record(options: PrepareOptions, split: str, empty: int) -> dict[str, Any]:
    """What made the store; identical for identical inputs, so stores compare byte for byte."""
    return {
        "inputs": list(options.inputs),
        "text_field": options.text_field,
        "seed": options.seed,
        "num_shards": options.num_shards,
        "record_tokens": options.record_tokens,
        "eval_fraction": options.eval_fraction,
        "split": split,
        "empty_documents_dropped": empty,
    }


def validate(options: PrepareOptions) -> tuple[list[InputSpec], Tokenizer, np.dtype]:
    """Everything a runner checks before any work: inputs, tokenizer, destinations."""
    specs = resolve_inputs(options.inputs, options.text_field, options.tfds_data_dir)
    tokenizer = load_tokenizer(options.tokenizer)
    for destination in options.destinations.values():
        check_destination(destination, options.overwrite)
    return specs, tokenizer, token_dtype(tokenizer.vocab_size)


def finish(
    options: PrepareOptions,
    stagings: dict[str, Path],
    shards: dict[str, list[ShardInfo]],
    empty: dict[str, int],
    tokenizer: dict[str, Any],
    dtype: np.dtype,
) -> None:
    """Both runners' last step: every manifest, then the atomic renames (train first)."""
    for split, staging in stagings.items():
        _require_documents(shards[split], options, split)
        record = creation_record(options, split, empty[split])
        write_manifest(staging, shards[split], tokenizer, dtype, record)
    for split, staging in stagings.items():
        commit(staging, options.destinations[split], options.overwrite)


def prepare(options: PrepareOptions) -> dict[str, Path]:
    """Prepare the train (and eval) store; returns split -> store path. Validates first."""
    specs, tokenizer, dtype = validate(options)
    stagings = {split: staging_dir(path) for split, path in options.destinations.items()}
    try:
        spills, empty = _tokenize_and_spill(options, specs, tokenizer, dtype, stagings)
        shards = {}
        for split, staging in stagings.items():
            shards[split] = [
                write_shard(
                    staging,
                    shard,
                    options.num_shards,
                    _sorted_spill(path, dtype),
                    dtype,
                    options.record_tokens,
                    options.flat_tokens,
                )
                for shard, path in enumerate(spills[split])
            ]
            shutil.rmtree(staging / ".spill")
        finish(options, stagings, shards, empty, tokenizer_record(tokenizer), dtype)
    finally:
        for staging in stagings.values():
            remove_tree(staging)
    return dict(options.destinations)


def _tokenize_and_spill(
    options: PrepareOptions,
    specs: list[InputSpec],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    stagings: dict[str, Path],
) -> tuple[dict[str, list[Path]], dict[str, int]]:
    spills = {}
    for split, staging in stagings.items():
        (staging / ".spill").mkdir()
        spills[split] = [staging / ".spill" / f"{s:05d}.bin" for s in range(options.num_shards)]
    handles: dict[Path, BinaryIO] = {}
    empty = dict.fromkeys(stagings, 0)
    tokens_total = 0
    documents = _all_documents(specs)
    encode = partial(_encode, tokenizer, dtype, options.seed, options.num_shards)
    encode_with_eval = partial(encode, options.eval_fraction)
    bar = progress_bar(desc="prepare", unit=" doc", enabled=options.progress)
    with _mapper(options.workers) as imap:
        try:
            for key, placement, tokens in imap(encode_with_eval, documents):
                if len(tokens) == 1:  # only the eod: an empty text is dropped and counted
                    empty[placement.split] += 1
                    continue
                path = spills[placement.split][placement.shard]
                handle = handles.get(path) or handles.setdefault(path, open(path, "ab"))  # noqa: SIM115
                raw_key = key.encode()
                handle.write(_SPILL_HEADER.pack(placement.order, len(raw_key), len(tokens)))
                handle.write(raw_key)
                handle.write(tokens.tobytes())
                tokens_total += len(tokens)
                bar.update(1)
                bar.set_postfix_str(  # drawn with the bar's next redraw, not one per document
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
    return spills, empty


def _all_documents(specs: list[InputSpec]) -> Iterator[Document]:
    for spec in specs:
        yield from iter_documents(spec)


def _encode(
    tokenizer: Tokenizer,
    dtype: np.dtype,
    seed: int,
    num_shards: int,
    eval_fraction: float,
    document: Document,
) -> tuple[str, Any, np.ndarray]:
    placement = place(document.key, seed, num_shards, eval_fraction)
    return document.key, placement, tokenize_document(tokenizer, dtype, document.text)


class _mapper:
    """`map` in this process, or an ordered `imap` over a spawned pool (safe beside JAX)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool = None

    def __enter__(self):
        if self.workers == 1:
            return map
        self.pool = multiprocessing.get_context("spawn").Pool(self.workers)
        return partial(self.pool.imap, chunksize=32)

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _sorted_spill(path: Path, dtype: np.dtype) -> Iterator[np.ndarray]:
    """A shard's documents in (order hash, key) order; a repeated key is an error."""
    entries = []
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        order, key_len, count = _SPILL_HEADER.unpack_from(data, pos)
        pos += _SPILL_HEADER.size
        key = data[pos : pos + key_len].decode()
        pos += key_len
        nbytes = count * dtype.itemsize
        entries.append((order, key, (pos, nbytes)))
        pos += nbytes
    for start, nbytes in sort_shard(entries):
        yield np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start)


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


def _require_documents(shards: list[ShardInfo], options: PrepareOptions, split: str) -> None:
    if sum(s.documents for s in shards) == 0:
        raise PrepareError(
            f"{', '.join(options.inputs)}: no non-empty documents for the {split} split "
            "(empty corpus, or --eval-fraction too large)"
        )
