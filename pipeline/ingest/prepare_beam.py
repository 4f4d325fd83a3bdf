"""`pipeline prepare --runner beam`: the same token store, built by an Apache Beam pipeline.

The graph, one box per step; every box calls the function the local runner calls::

    Create(units of work)            one element per input file (per whole TFDS split / docs corpus)
      | Reshuffle                    spread the units over the workers
      | FlatMap(read batches)        corpora.iter_documents on a one-file InputSpec, in the
                                     local runner's batches (prepare.document_batches)
      | ParDo(tokenize and place)    prepare.DocumentEncoder.many (one encode_batch), place
      + Create(every (split, shard)) so a shard without documents is still written
      | GroupByKey((split, shard))
      | ParDo(write shard)           prepare.sort_shard, writer.write_shard -> ShardInfo
      | ToList | Map(commit)         writer.write_manifest, then the atomic commit

Placement is a keyed hash of each document's key, and a shard is sorted by (order, key), so
neither bundle order nor worker count reaches the output: both runners write byte-identical
stores. Inputs, tokenizer and destinations are checked before the pipeline is built; a failed
pipeline removes its staging directories, so nothing that opens as a store is left behind.

Shards are written by the workers into a staging directory that the launching process creates
beside `--out`: the destination must be a `gs://` prefix or a filesystem that the launcher and
every worker share (local disk with the DirectRunner; NFS elsewhere). With `gs://`, the staging
is a hidden prefix beside `--out`, and the commit copies it into place with the manifest last.
See docs/prepare-at-scale.md.

The runner is Beam's `--runner`, checked before anything runs (`resolve_runner`): `DirectRunner`,
the default, is pinned to Beam's Python direct runner (see `DIRECT_RUNNER`), `DaskRunner` may be
named without its module path, and a name Beam does not know is one line, not a traceback.
"""

from __future__ import annotations

import importlib
import logging
import re
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from pipeline.errors import PrepareError
from pipeline.extras import require
from pipeline.ingest.corpora import Document, InputSpec, iter_documents
from pipeline.ingest.doc_order import place
from pipeline.ingest.prepare import (
    PrepareOptions,
    Validated,
    document_batches,
    finish,
    sort_shard,
    validate,
)
from pipeline.store.token_store import is_store
from pipeline.store.writer import (
    ShardInfo,
    staging_dir,
    write_shard,
)
from pipeline.urls import location, remove_tree


def _import_beam() -> Any:
    """Beam, without the two warnings its import logs about BigQuery's client libraries (which
    prepare never uses): on the command line they were the first lines of every run."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return require("apache_beam", "beam", "--runner beam")
    finally:
        logging.disable(previous)


beam = _import_beam()
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions  # noqa: E402

# Our modules use `from __future__ import annotations`, so Beam finds every DoFn's hints as
# strings and logs one "Converting string literal type hint to Any" line per hint, per use.
logging.getLogger("apache_beam.typehints.native_type_compatibility").setLevel(logging.WARNING)

__all__ = [
    "DIRECT_RUNNER",
    "RUNNER_PATHS",
    "pipeline_flags",
    "prepare_beam",
    "resolve_runner",
    "units_of_work",
]

_log = logging.getLogger(__name__)

DIRECT_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
"""What `--runner=DirectRunner` (the default) runs: Beam's Python direct runner, the one that
`--direct_num_workers` and `--direct_running_mode` configure. Since Beam 2.68 Beam's own
DirectRunner first hands a pipeline to PrismRunner, a Go binary it downloads from GitHub (and,
offline, falls back after a failed download); Beam's advice for keeping the Python runner is to
name FnApiRunner. Prism stays available as `--runner=PrismRunner`."""

RUNNER_PATHS = {"DaskRunner": "apache_beam.runners.dask.dask_runner.DaskRunner"}
"""Runners Beam ships but does not know by short name (its `--runner` wants the module path)."""

SCHEDULER_TIMEOUT_S = 5.0

_RUNNER_NEEDS = {"DaskRunner": ("dask.distributed", "dask")}
"""Runner class -> a package it needs that is not Beam's, and the extra that installs it."""


def prepare_beam(options: PrepareOptions, beam_args: Sequence[str] = ()) -> dict[str, Path]:
    """Prepare the train (and eval) store with Beam; returns split -> store path.

    `beam_args` are Beam's own flags (`--runner=DataflowRunner --project=...`), passed to
    `PipelineOptions` after our defaults, so they win. Validates everything first.
    """
    validated = validate(options)
    pipeline_options = PipelineOptions(pipeline_flags(options.workers, beam_args))
    check_scheduler(pipeline_options)
    stagings = {
        split: staging_dir(path, shared=True) for split, path in options.destinations.items()
    }
    try:
        pipeline = _pipeline(pipeline_options)
        _log.info("prepare: Beam pipeline on %s", type(pipeline.runner).__name__)
        _build(pipeline, options, validated, stagings)
        try:
            result = pipeline.run()
            state = result.wait_until_finish()
        except Exception as error:
            prepare_error = _find_prepare_error(error)
            if prepare_error is None:
                raise  # not bad input: a bug or a runner failure keeps its traceback
            raise prepare_error from error
        if str(state) not in ("DONE", "PipelineState.DONE"):
            raise PrepareError(f"the Beam pipeline ended in state {state}; see the runner's log")
        missing = [str(p) for p in options.destinations.values() if not is_store(p)]
        if missing:
            raise PrepareError(f"the Beam pipeline finished but did not commit {missing}")
    finally:
        for staging in stagings.values():
            remove_tree(staging)
    return dict(options.destinations)


def pipeline_flags(workers: int, beam_args: Sequence[str] = ()) -> list[str]:
    """Our defaults (DirectRunner, `--workers` as its worker count), then the user's flags,
    then `--runner` again as `resolve_runner` names it (the last `--runner` wins)."""
    mode = "multi_processing" if workers > 1 else "in_memory"
    flags = [
        "--runner=DirectRunner",
        f"--direct_num_workers={workers}",
        f"--direct_running_mode={mode}",
        *beam_args,
    ]
    runner = resolve_runner(PipelineOptions(flags).view_as(StandardOptions).runner)
    if runner == RUNNER_PATHS["DaskRunner"] and not any(
        flag.startswith(("--dask_npartitions", "--dask_partition_size")) for flag in beam_args
    ):  # one task per unit of work (Dask's default puts up to 128 units, all, in one task)
        flags.append("--dask_partition_size=1")
    return [*flags, f"--runner={runner}"]


def check_scheduler(pipeline_options: PipelineOptions) -> None:
    """A Dask scheduler (`--dask_client_address`) that cannot be connected to stops in seconds
    with one line, before Dask's client retries and ends in a traceback of its internals."""
    if pipeline_options.view_as(StandardOptions).runner != RUNNER_PATHS["DaskRunner"]:
        return
    address = pipeline_options.get_all_options().get("address")
    if not address:  # none given: the runner starts a LocalCluster of its own
        return
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname or "", parts.port or 8786  # Dask's default port
        socket.create_connection((host, port), timeout=SCHEDULER_TIMEOUT_S).close()
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise PrepareError(
            f"--dask_client_address={address}: cannot connect to the Dask scheduler ({reason}); "
            "start it, or check the address"
        ) from None


def resolve_runner(name: str) -> str:
    """The module path of the Beam runner `name` (Beam's short names, in any case and with or
    without `Runner`, `DaskRunner`, or a module path), imported to check it is there.

    `DirectRunner` is `DIRECT_RUNNER`. An unknown name, or a runner whose package is not
    installed, is a PrepareError of one line."""
    if "." in name:
        path = name
    else:
        known = {
            full.rsplit(".", 1)[1].lower(): full
            for full in (*StandardOptions.ALL_KNOWN_RUNNERS, *RUNNER_PATHS.values())
        }
        known["directrunner"] = DIRECT_RUNNER
        key = name.lower() if name.lower() in known else f"{name.lower()}runner"
        if key not in known:
            names = sorted({full.rsplit(".", 1)[1] for full in known.values()} | {"DirectRunner"})
            raise PrepareError(
                f"unknown Beam runner {name!r}; give one of {', '.join(names)}, or a runner "
                "class's module path (package.module.Class)"
            )
        path = known[key]
    module, _, attribute = path.rpartition(".")
    if attribute in _RUNNER_NEEDS:
        package, extra = _RUNNER_NEEDS[attribute]
        require(package, extra, f"Beam's {attribute}")
    try:
        found = getattr(importlib.import_module(module), attribute, None)
    except (ImportError, ValueError, TypeError) as error:  # also an empty or relative module
        raise PrepareError(
            f"Beam runner {name!r} cannot be imported from {module} ({error}); install what "
            "it needs (docs/prepare-at-scale.md)"
        ) from None
    if not isinstance(found, type):
        raise PrepareError(f"Beam runner {name!r}: {module} has no runner class {attribute!r}")
    return path


def _pipeline(pipeline_options: PipelineOptions) -> Any:
    """A Beam pipeline; options that the runner refuses (Dataflow without `--project`) are one
    PrepareError listing Beam's reasons."""
    try:
        return beam.Pipeline(options=pipeline_options)
    except ValueError as error:
        reasons = str(error).splitlines()
        if not reasons or not reasons[0].startswith("Pipeline has validations errors"):
            raise
        raise PrepareError(
            f"Beam refused the options after --: {' '.join(r.strip() for r in reasons[1:])}"
        ) from None


def units_of_work(specs: Iterable[InputSpec]) -> list[InputSpec]:
    """One InputSpec per file of a file input; a TFDS split or python-docs stays whole."""
    units = []
    for spec in specs:
        if spec.files:
            units.extend(replace(spec, files=(file,)) for file in spec.files)
        else:
            units.append(spec)
    return units


def _build(
    pipeline: Any, options: PrepareOptions, validated: Validated, stagings: dict[str, Path]
) -> None:
    every_shard = [
        ((split, shard), None) for split in stagings for shard in range(options.num_shards)
    ]
    documents = (
        pipeline
        | "Units" >> beam.Create(units_of_work(validated.specs), reshuffle=False)
        | "Spread" >> beam.Reshuffle()
        | "Read" >> beam.FlatMap(_read_batches)
        | "Tokenize" >> beam.ParDo(_TokenizeAndPlace(options, validated))
    )
    placeholders = pipeline | "EveryShard" >> beam.Create(every_shard, reshuffle=False)
    staged = {split: str(path) for split, path in stagings.items()}  # local or URL, as text
    _ = (
        (documents, placeholders)
        | "Flatten" >> beam.Flatten()
        | "ByShard" >> beam.GroupByKey()
        | "WriteShard" >> beam.ParDo(_WriteShard(options, validated, stagings))
        | "AllShards" >> beam.combiners.ToList()
        | "Commit" >> beam.Map(_commit, options, validated, staged)
    )


def _read_batches(unit: InputSpec) -> Iterator[list[Document]]:
    """A unit of work's documents in the local runner's batches (`prepare.document_batches`),
    made while reading: with batching across elements (`beam.BatchElements`, whose last batch
    comes from `finish_bundle`) Beam's DaskRunner wrote a store other than the local runner's."""
    return document_batches(iter_documents(unit))


class _TokenizeAndPlace(beam.DoFn):
    """Documents -> ((split, shard), (order, key, payload)) each, the batch's texts encoded
    in one `encode_batch` (`DocumentEncoder.many`, as the local runner encodes a task). The
    payload is (token bytes, untrained-range bytes, id ("" unless ids are recorded)), EMPTY
    for an empty text or BAD for a skipped bad row."""

    def __init__(self, options: PrepareOptions, validated: Validated) -> None:
        self.seed = options.seed
        self.num_shards = options.num_shards
        self.eval_fraction = options.eval_fraction
        self.ids = options.ids
        self.encode = validated.encoder(options)  # pickles as its settings

    def process(self, documents: list[Document]) -> Iterator[tuple[tuple[str, int], Any]]:
        for document, encoded in zip(documents, self.encode.many(documents), strict=True):
            placement = place(document.key, self.seed, self.num_shards, self.eval_fraction)
            if encoded is None:
                payload: Any = BAD
            elif len(encoded[0]) == 1:  # only the eod: dropped and counted, as the local runner
                payload = EMPTY
            else:
                document_id = document.document_id if self.ids else ""
                payload = (encoded[0].tobytes(), encoded[1].tobytes(), document_id)
            yield (placement.split, placement.shard), (placement.order, document.key, payload)


EMPTY, BAD = "empty", "bad"


class _WriteShard(beam.DoFn):
    """All of one (split, shard) -> its files in the staging directory, and its ShardInfo."""

    def __init__(
        self, options: PrepareOptions, validated: Validated, stagings: dict[str, Path]
    ) -> None:
        self.num_shards = options.num_shards
        self.record_tokens = options.record_tokens
        self.flat_tokens = options.flat_tokens
        self.dtype = np.dtype(validated.dtype)
        self.masked = validated.masked
        self.ids = options.ids
        self.stagings = {split: str(path) for split, path in stagings.items()}

    def process(
        self, group: tuple[tuple[str, int], Iterable[Any]]
    ) -> Iterator[tuple[str, int, ShardInfo, int, int]]:
        (split, shard), values = group
        entries, counts = [], {EMPTY: 0, BAD: 0}
        for value in values:
            if value is None:  # the placeholder that makes every shard exist
                continue
            if isinstance(value[2], str):
                counts[value[2]] += 1
            else:
                entries.append(value)
        documents = (self._document(*payload) for payload in sort_shard(entries))
        info = write_shard(
            location(self.stagings[split]),
            shard,
            self.num_shards,
            documents,
            self.dtype,
            self.record_tokens,
            self.flat_tokens,
            self.masked,
            self.ids,
        )
        yield split, shard, info, counts[EMPTY], counts[BAD]

    def _document(self, tokens: bytes, untrained: bytes, document_id: str) -> Any:
        """`writer.write_shard`'s item of a payload."""
        document: Any = np.frombuffer(tokens, dtype=self.dtype)
        if self.masked:
            document = (document, np.frombuffer(untrained, dtype=np.int64).reshape(-1, 2))
        return (document, document_id) if self.ids else document


def _commit(
    results: list[tuple[str, int, ShardInfo, int, int]],
    options: PrepareOptions,
    validated: Validated,
    stagings: dict[str, str],
) -> None:
    """After every shard: the manifests and the atomic renames, as the local runner does.
    (`stagings` as text, local or URL: Beam checks a side argument against its annotation.)"""
    shards, empty = {}, {}
    for split in stagings:
        mine = sorted((r for r in results if r[0] == split), key=lambda r: r[1])
        if [r[1] for r in mine] != list(range(options.num_shards)):
            raise PrepareError(f"{split}: shards {[r[1] for r in mine]} written, expected all")
        shards[split] = [r[2] for r in mine]
        empty[split] = sum(r[3] for r in mine)
    bad = sum(r[4] for r in results)
    paths = {split: location(staging) for split, staging in stagings.items()}
    finish(options, paths, shards, empty, bad, validated)


def _find_prepare_error(error: BaseException) -> PrepareError | None:
    """A worker's PrepareError, which runners re-raise wrapped or only as text."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, PrepareError):
            return seen
        seen = seen.__cause__ or seen.__context__
    found = re.findall(r"PrepareError: (.+)", str(error))
    return PrepareError(found[-1].strip()) if found else None
