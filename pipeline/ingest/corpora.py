"""Where `prepare` gets its documents: files, globs, JSONL, Parquet, TFDS and builtin corpora.

`resolve_inputs` turns what the user typed into `InputSpec` values and checks all of them before
any tokenizing starts (a missing path fails in a second, not after an hour of work).
`iter_documents` then yields `Document(key, text)` in a fixed order; a read error stops with the
file and line instead of skipping anything.

Input forms (each `prepare` argument is one input; each format is a module of the registry
`formats.FORMATS`, and this module asks it what an input is and how to read it):

* ``DIR``: every regular file under it, recursively, sorted by relative path, read as UTF-8
  text, one document per file; hidden files and directories are ignored.
* ``'PATTERN'`` (a quoted glob, ``**`` allowed): the matching regular files, sorted, each read as
  if it were given on its own (so ``'data/*.jsonl'`` reads JSON Lines).
* ``gs://BUCKET/...`` (any URL `pipeline.urls` reads): an object, read as the file it names; a
  prefix, read as a directory; or a quoted glob. Listed once, here (hidden names left out, as
  locally); the objects are then read through `etils.epath` and gcsfs, as stores are, by whoever
  reads the documents (a Beam worker included). Keys are those of local copies of the objects.
* ``FILE.jsonl`` / ``FILE.json``: JSON Lines, one object per line, text in field ``text_field``;
  blank lines carry no data and are passed over.
* ``FILE.parquet``: column ``text_field``, read in record batches.
* any other ``FILE``: one document, the whole file as UTF-8 text.
* ``tfds:NAME[/CONFIG]:SPLIT``: a TFDS dataset prepared in ``array_record`` format, read with
  ``as_data_source`` (no TensorFlow needed); feature ``text_field``.
* ``builtin:NAME``: a corpus that ships with Python (see `BUILTIN_CORPORA`), for demos and tests.
* with ``--format messages|prompt-completion`` (`chat.RowFields`): JSONL and Parquet files are
  read as instruction or chat rows (``Document.row``), rendered when tokenized; the builtin
  instruction corpora (`INSTRUCTION_CORPORA`) are rows whatever the format.

Document keys (stable, used for deterministic hashing, never machine paths):

* a file of a directory or glob: its path relative to the directory, or to the glob's leading
  directory (``pkg/mod.py``); a single file: its base name (``notes.txt``);
* a JSONL line: ``<file key>:<line>``, 1-based (``data.jsonl:17``);
* a Parquet row: ``<file key>:row <index>``, 0-based (``data.parquet:row 5``);
* ``tfds:NAME[/CONFIG]:SPLIT:index <i>``, 0-based, and ``builtin:NAME:<path or topic>``.

Keys are unique across the inputs of one call: when two file inputs could produce the same key
(two directories that both hold ``README``), every key of those inputs is prefixed with the input
argument as typed and a ``|`` (``data/a|README``). The same file reached through two inputs, or the
same input given twice, is refused instead: a document is tokenized once.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator, Sequence
from typing import cast

from pipeline.errors import PrepareError
from pipeline.ingest.builtin import BUILTIN_CORPORA
from pipeline.ingest.chat import RowFields
from pipeline.ingest.formats import (
    Document,
    FileFormat,
    InputSpec,
    SourceFormat,
    file_format,
    input_format,
    is_source,
    source_format,
)
from pipeline.ingest.text import walk_files
from pipeline.urls import is_url, list_files, location

__all__ = [
    "BUILTIN_CORPORA",
    "Document",
    "InputSpec",
    "check_fields_read",
    "iter_documents",
    "resolve_inputs",
]


def resolve_inputs(
    inputs: Sequence[str],
    text_field: str = "text",
    tfds_data_dir: str | None = None,
    fields: RowFields | None = None,
) -> list[InputSpec]:
    """Validates every input up front and returns their specs, in the order given.

    With `fields` of a row format (``messages``, ``prompt-completion``), every file input must
    be JSONL or Parquet (a Parquet file must have the fields' columns); builtin instruction
    corpora carry their own shape.
    """
    rows = fields is not None and fields.format != "text"
    if not inputs:
        raise PrepareError(
            "no inputs given; pass at least one file, directory, glob, tfds: or builtin: input"
        )
    seen: set[str] = set()
    specs: list[InputSpec] = []
    for argument in inputs:
        if argument in seen:
            raise PrepareError(f"input {argument!r} is given twice; give each input once")
        seen.add(argument)
        source = source_format(argument)
        if rows and source is not None and not source.READS_ROWS:
            raise _not_rows(argument, fields)
        spec = _resolve_one(argument, None if rows else text_field, tfds_data_dir)
        specs.append(_as_rows(spec, fields) if rows else spec)
    _refuse_shared_files(specs)
    return _prefix_colliding_keys(specs)


def _as_rows(spec: InputSpec, fields: RowFields) -> InputSpec:
    """A file input read as instruction or chat rows; anything that is not rows is refused."""
    if spec.fields is not None:  # a source of rows of its own (a builtin instruction corpus)
        return spec
    formats = [cast("FileFormat", input_format(kind)) for _, kind, _ in spec.files]
    if is_source(spec.kind) or not all(f.READS_ROWS for f in formats):
        raise _not_rows(spec.argument, fields)
    for (path, _, _), form in zip(spec.files, formats):
        form.check(spec.argument, path, None, fields)
    return dataclasses.replace(spec, fields=fields)


def _not_rows(argument: str, fields: RowFields) -> PrepareError:
    return PrepareError(
        f"input {argument!r} is not JSONL or Parquet rows; --format {fields.format} reads rows "
        "from .jsonl/.json/.parquet files"
    )


def check_fields_read(specs: Sequence[InputSpec], options: Sequence[str], row_format: str) -> None:
    """Refuses field options (`options`, as typed: ``--text-field``) when no input reads a field,
    so a field the user named is never silently not the one trained on."""
    if not options or any(_reads_fields(spec) for spec in specs):
        return
    why = [f"{spec.argument} {_why_no_fields(spec)}" for spec in specs]
    readers = "JSONL/Parquet/TFDS rows" if row_format == "text" else "JSONL/Parquet rows"
    raise PrepareError(
        f"{options[0]} is not read by any input: {', '.join(why[:-1])}"
        f"{' and ' if len(why) > 1 else ''}{why[-1]}; it is read from {readers} with "
        f"--format {row_format}"
    )


def _reads_fields(spec: InputSpec) -> bool:
    """Whether `spec` reads named fields: its source format says, or one of its files' does (a
    directory reads every file as text)."""
    if is_source(spec.kind):
        return input_format(spec.kind).READS_FIELDS
    return any(input_format(kind).READS_FIELDS for _, kind, _ in spec.files)


def _why_no_fields(spec: InputSpec) -> str:
    if spec.fields is not None:
        return "brings its own fields"
    if spec.kind == "dir":
        return "is a directory of plain text (one document per file)"
    if spec.kind == "glob":
        return "matches only plain text (one document per file)"
    return input_format(spec.kind).NO_FIELDS


def _resolve_one(argument: str, text_field: str | None, tfds_data_dir: str | None) -> InputSpec:
    source = source_format(argument)
    if source is not None:
        return source.resolve(argument, text_field, tfds_data_dir)
    if is_url(argument):
        return _resolve_url(argument, text_field)
    path = os.path.expanduser(argument)
    if os.path.isdir(path):
        return _resolve_dir(argument, path, text_field)
    if os.path.isfile(path):
        return _file_spec(argument, path, text_field)
    if glob.has_magic(path):
        return _resolve_glob(argument, path, text_field)
    if os.path.lexists(path):
        raise PrepareError(f"input {argument!r} is neither a regular file nor a directory")
    raise PrepareError(
        f"input {argument!r} does not exist; give a file, directory, quoted glob, "
        "tfds:NAME[/CONFIG]:SPLIT or builtin:NAME"
    )


def _resolve_url(argument: str, text_field: str | None) -> InputSpec:
    """A bucket object, prefix or glob, from one listing (`urls.list_files`)."""
    url = str(location(argument)).rstrip("/")
    found = list_files(url)
    if found is None:
        raise PrepareError(
            f"input {argument!r} does not exist; give an object, a prefix (read like a "
            "directory) or a quoted glob"
        )
    if glob.has_magic(url):
        return _glob_spec(argument, url, found, text_field)
    if found == [url]:
        return _file_spec(argument, url, text_field)
    rels = [name[len(url) + 1 :] for name in found]
    return _dir_spec(argument, url, [rel for rel in rels if not _hidden(rel)], text_field)


def _hidden(rel: str) -> bool:
    """Whether a relative path has a hidden component, which a local walk or glob leaves out."""
    return any(part.startswith(".") for part in rel.split("/"))


def _file_spec(argument: str, path: str, text_field: str | None) -> InputSpec:
    form = file_format(path)
    form.check(argument, path, text_field, None)
    files = ((path, form.NAME, os.path.basename(path)),)
    return InputSpec(form.NAME, argument, files, text_field=text_field or "text")


def _resolve_dir(argument: str, path: str, text_field: str | None) -> InputSpec:
    return _dir_spec(argument, path, walk_files(path), text_field)


def _dir_spec(argument: str, root: str, rels: list[str], text_field: str | None) -> InputSpec:
    if not rels:
        raise PrepareError(f"input {argument!r}: directory has no (non-hidden) files")
    files = tuple((os.path.join(root, rel), "text", rel) for rel in rels)
    return InputSpec("dir", argument, files, text_field=text_field or "text")


def _resolve_glob(argument: str, pattern: str, text_field: str | None) -> InputSpec:
    matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
    return _glob_spec(argument, pattern, matches, text_field)


def _glob_spec(
    argument: str, pattern: str, matches: list[str], text_field: str | None
) -> InputSpec:
    parts = pattern.split("/")
    fixed = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    base = "/".join(fixed) or ("/" if pattern.startswith("/") else ".")
    if is_url(pattern):  # a local glob leaves hidden names out by itself
        matches = [m for m in matches if not _hidden(m[len(base) + 1 :])]
    if not matches:
        raise PrepareError(
            f"input {argument!r}: the glob matches no files; check the pattern and quote it "
            "so the shell does not expand it"
        )
    files = []
    for match in matches:
        form = file_format(match)
        form.check(argument, match, text_field, None)
        files.append((match, form.NAME, os.path.relpath(match, base).replace(os.sep, "/")))
    return InputSpec("glob", argument, tuple(files), text_field=text_field or "text")


def _refuse_shared_files(specs: Sequence[InputSpec]) -> None:
    owner: dict[str, str] = {}
    for spec in specs:
        for path, _, _ in spec.files:
            real = path if is_url(path) else os.path.realpath(path)
            if real in owner and owner[real] != spec.argument:
                raise PrepareError(
                    f"file {path} is read by both input {owner[real]!r} and input "
                    f"{spec.argument!r}; give each file through one input"
                )
            owner[real] = spec.argument


def _prefix_colliding_keys(specs: list[InputSpec]) -> list[InputSpec]:
    """Prefixes the keys of file inputs whose keys could equal another input's keys."""
    file_specs = [i for i, s in enumerate(specs) if not is_source(s.kind)]
    keys_of = {i: {key for _, _, key in specs[i].files} for i in file_specs}
    colliding: set[int] = set()
    for i in file_specs:
        for key in keys_of[i]:
            # A JSONL/Parquet key is "<file key>:..."; a text file may be named like one.
            candidates = [key] + [key[:p] for p, c in enumerate(key) if c == ":"]
            if key.startswith(("tfds:", "builtin:")):
                colliding.add(i)
            for j in file_specs:
                if j != i and any(c in keys_of[j] for c in candidates):
                    colliding.update((i, j))
    return [
        dataclasses.replace(spec, key_prefix=f"{spec.argument}|") if i in colliding else spec
        for i, spec in enumerate(specs)
    ]


def iter_documents(spec: InputSpec) -> Iterator[Document]:
    """Yields the documents of one input in a fixed order; raises PrepareError on bad data."""
    if is_source(spec.kind):
        yield from cast("SourceFormat", input_format(spec.kind)).documents(spec)
        return
    for path, kind, key in spec.files:
        yield from cast("FileFormat", input_format(kind)).read(spec, path, spec.key_prefix + key)
