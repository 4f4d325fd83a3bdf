"""Where `prepare` gets its documents: files, globs, JSONL, Parquet, TFDS and builtin corpora.

`resolve_inputs` turns what the user typed into `InputSpec` values and checks all of them before
any tokenizing starts (a missing path fails in a second, not after an hour of work).
`iter_documents` then yields `Document(key, text)` in a fixed order; a read error stops with the
file and line instead of skipping anything.

Input forms (each `prepare` argument is one input):

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

import contextlib
import dataclasses
import glob
import json
import logging
import os
import re
import sysconfig
import tokenize
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, BinaryIO

from pipeline.errors import PrepareError
from pipeline.extras import require
from pipeline.ingest.chat import RowFields, json_kind
from pipeline.ingest.docstrings import SYSTEM_PROMPT, module_files, pairs
from pipeline.urls import is_url, list_files, location

__all__ = [
    "BUILTIN_CORPORA",
    "Document",
    "InputSpec",
    "check_fields_read",
    "iter_documents",
    "resolve_inputs",
]

BUILTIN_CORPORA: dict[str, str] = {
    "python-code": "the Python standard library's .py sources, without its tests",
    "python-tests": "the Python standard library's test suite (Lib/test/*.py)",
    "python-docs": "the English Python documentation topics (pydoc_data.topics)",
    "python-docstrings": "instruction pairs: a prompt for a stdlib function's docstring, and it",
    "python-docstrings-chat": "the same pairs as chat messages (system, user, assistant)",
}
"""Corpora that need no download: every machine with the same Python has the same documents."""

INSTRUCTION_CORPORA: dict[str, RowFields] = {
    "python-docstrings": RowFields("prompt-completion"),
    "python-docstrings-chat": RowFields("messages"),
}
"""The builtin corpora of instruction rows, and their shape (see `docstrings`)."""

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 1024
TFDS_BATCH = 256
ROWS_HINT = (
    "; chat or instruction rows need --format messages or --format prompt-completion "
    "(docs/instruction-data.md)"
)
"""Appended where a record lacks a text string: a chat file read as text fails exactly there."""
TFDS_PATTERN = re.compile(r"^tfds:([A-Za-z0-9_]+(?:/[A-Za-z0-9_.\-]+)?):(\S+)$")
_EXCLUDED_CODE_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: ``key`` locates it stably (see the module docstring), ``text`` is its text.

    An instruction or chat row has no text yet: ``row`` holds its fields, ``fields`` says their
    shape (rendered by `chat.render`), ``where`` names its file and line for error messages.
    """

    key: str
    text: str
    row: Mapping[str, Any] | None = None
    fields: RowFields | None = None
    where: str = ""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One validated input of `prepare`.

    Attributes:
      kind: ``dir``, ``glob``, ``text``, ``jsonl``, ``parquet``, ``tfds`` or ``builtin``.
      argument: the input as the user typed it (used in messages and key prefixes).
      files: for file kinds, ``(path, file kind, file key)`` in read order, resolved up front so
        the file set cannot change between validation and reading.
      key_prefix: prepended to every key of this input to keep keys unique across inputs.
      text_field: JSONL field, Parquet column or TFDS feature that holds the text.
      fields: for instruction and chat rows (JSONL and Parquet only), their shape and fields.
      name: the TFDS ``NAME[/CONFIG]`` or the builtin corpus name.
      split: the TFDS split.
      data_dir: the TFDS data directory.
    """

    kind: str
    argument: str
    files: tuple[tuple[str, str, str], ...] = ()
    key_prefix: str = ""
    text_field: str = "text"
    fields: RowFields | None = None
    name: str = ""
    split: str = ""
    data_dir: str = ""


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
        if rows and argument.startswith("tfds:"):
            raise _not_rows(argument, fields)
        spec = _resolve_one(argument, None if rows else text_field, tfds_data_dir)
        specs.append(_as_rows(spec, fields) if rows else spec)
    _refuse_shared_files(specs)
    return _prefix_colliding_keys(specs)


def _as_rows(spec: InputSpec, fields: RowFields) -> InputSpec:
    """A file input read as instruction or chat rows; anything that is not rows is refused."""
    if spec.kind == "builtin" and spec.name in INSTRUCTION_CORPORA:
        return spec
    kinds = {kind for _, kind, _ in spec.files}
    if spec.kind in ("tfds", "dir", "builtin") or not kinds <= {"jsonl", "parquet"}:
        raise _not_rows(spec.argument, fields)
    for path, kind, _ in spec.files:
        if kind == "parquet":
            missing = [c for c in fields.columns if c not in _parquet_columns(path)]
            if missing:
                raise PrepareError(
                    f"input {spec.argument!r}: {path} has no column {missing[0]!r} for "
                    f"--format {fields.format} (columns: {', '.join(_parquet_columns(path))})"
                )
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
    """JSONL/Parquet files (given alone or matched by a glob) and TFDS datasets read named
    fields; a directory reads every file as text, a builtin corpus brings its own documents."""
    return spec.kind == "tfds" or any(kind in ("jsonl", "parquet") for _, kind, _ in spec.files)


def _why_no_fields(spec: InputSpec) -> str:
    if spec.kind == "builtin" and spec.name in INSTRUCTION_CORPORA:
        return "brings its own fields"
    if spec.kind == "builtin":
        return "is builtin text (no fields)"
    if spec.kind == "dir":
        return "is a directory of plain text (one document per file)"
    if spec.kind == "glob":
        return "matches only plain text (one document per file)"
    return "is plain text (one document per file)"


def _resolve_one(argument: str, text_field: str | None, tfds_data_dir: str | None) -> InputSpec:
    if argument.startswith("builtin:"):
        return _resolve_builtin(argument)
    if argument.startswith("tfds:"):
        return _resolve_tfds(argument, text_field, tfds_data_dir)
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
    kind = _file_kind(path)
    _check_file(argument, path, kind, text_field)
    files = ((path, kind, os.path.basename(path)),)
    return InputSpec(kind, argument, files, text_field=text_field or "text")


def _file_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _check_file(argument: str, path: str, kind: str, text_field: str | None) -> None:
    """Checks what is cheap to check before reading: a Parquet file's schema has the column
    (`_as_rows` checks the columns of rows, for which `text_field` is None)."""
    if kind != "parquet" or text_field is None:
        return
    columns = _parquet_columns(path)
    if text_field not in columns:
        raise PrepareError(
            f"input {argument!r}: {path} has no column {text_field!r} (columns: "
            f"{', '.join(columns)}); pass --text-field with the column that holds the text"
            f"{ROWS_HINT}"
        )


def _walk_files(root: str, skip_dir: Callable[[str], bool] | None = None) -> list[str]:
    """Relative POSIX paths of the regular, non-hidden files under ``root``, sorted."""
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and not (skip_dir and skip_dir(os.path.normpath(os.path.join(rel_dir, d))))
        ]
        for name in files:
            full = os.path.join(directory, name)
            if not name.startswith(".") and os.path.isfile(full):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)


def _resolve_dir(argument: str, path: str, text_field: str | None) -> InputSpec:
    return _dir_spec(argument, path, _walk_files(path), text_field)


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
        kind = _file_kind(match)
        _check_file(argument, match, kind, text_field)
        files.append((match, kind, os.path.relpath(match, base).replace(os.sep, "/")))
    return InputSpec("glob", argument, tuple(files), text_field=text_field or "text")


def _resolve_builtin(argument: str) -> InputSpec:
    name = argument[len("builtin:") :]
    if name not in BUILTIN_CORPORA:
        raise PrepareError(
            f"unknown builtin corpus {argument!r}; valid: "
            + ", ".join(f"builtin:{n}" for n in BUILTIN_CORPORA)
        )
    if name == "python-docs":
        return InputSpec("builtin", argument, name=name)
    if name in INSTRUCTION_CORPORA:
        files = tuple(
            (path, "docstrings", f"{argument}:{module}") for module, path in module_files()
        )
        return InputSpec("builtin", argument, files, fields=INSTRUCTION_CORPORA[name], name=name)
    stdlib = sysconfig.get_paths()["stdlib"]
    if name == "python-code":
        rels = _walk_files(stdlib, _is_excluded_code_dir)
    else:
        test_dir = os.path.join(stdlib, "test")
        if not os.path.isdir(test_dir):
            raise PrepareError(
                f"input {argument!r}: this Python has no test suite at {test_dir} (Debian-like "
                "systems split it out); install it (e.g. libpython3-testsuite) or use "
                "builtin:python-code"
            )
        rels = ["test/" + rel for rel in _walk_files(test_dir)]
    rels = [rel for rel in rels if rel.endswith(".py")]
    if not rels:
        raise PrepareError(f"input {argument!r}: found no .py files under {stdlib}")
    files = tuple((os.path.join(stdlib, rel), "python", f"{argument}:{rel}") for rel in rels)
    return InputSpec("builtin", argument, files, name=name)


def _is_excluded_code_dir(rel_dir: str) -> bool:
    """Test packages and third-party code are not part of ``builtin:python-code``."""
    rel = rel_dir.replace(os.sep, "/")
    return os.path.basename(rel) in _EXCLUDED_CODE_DIRS or rel == "lib2to3/tests"


def _resolve_tfds(argument: str, text_field: str, tfds_data_dir: str | None) -> InputSpec:
    match = TFDS_PATTERN.match(argument)
    if not match:
        raise PrepareError(
            f"input {argument!r} is not of the form tfds:NAME[/CONFIG]:SPLIT "
            "(for example tfds:wikipedia/20230601.en:train)"
        )
    name, split = match.group(1), match.group(2)
    data_dir = tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    data_dir = os.path.expanduser(data_dir)
    absl = logging.getLogger("absl")  # TFDS's warnings say what the one-line error below says
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        builder = _tfds_builder(argument, name, data_dir)
        prepared = builder.is_prepared()
    finally:
        absl.setLevel(level)
    if not prepared:
        raise PrepareError(
            f"input {argument!r}: dataset {name} is not prepared in {data_dir}; run "
            f"tfds.builder({name!r}, data_dir=...).download_and_prepare("
            "file_format='array_record') or pass --tfds-data-dir"
        )
    file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
    if file_format != "array_record":
        raise PrepareError(
            f"input {argument!r}: dataset {name} in {data_dir} is stored as {file_format}; "
            "prepare it again with file_format='array_record' (random access without TensorFlow)"
        )
    features = list(builder.info.features.keys())
    if text_field not in features:
        raise PrepareError(
            f"input {argument!r}: dataset {name} has no feature {text_field!r} (features: "
            f"{', '.join(features)}); pass --text-field with the text feature"
        )
    splits = list(builder.info.splits.keys())
    base_split = re.split(r"[\[+]", split, maxsplit=1)[0]
    if base_split not in splits:
        raise PrepareError(
            f"input {argument!r}: dataset {name} has no split {base_split!r} "
            f"(splits: {', '.join(sorted(splits))})"
        )
    return InputSpec(
        "tfds", argument, text_field=text_field, name=name, split=split, data_dir=data_dir
    )


def _tfds_builder(argument: str, name: str, data_dir: str) -> Any:
    import tensorflow_datasets as tfds

    try:
        return tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # DatasetNotFoundError, config errors, unreadable metadata.
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise PrepareError(
            f"input {argument!r}: cannot open TFDS dataset {name} in {data_dir} ({first_line}); "
            "check the name and --tfds-data-dir"
        ) from None


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
    file_specs = [
        i for i, s in enumerate(specs) if s.kind in ("dir", "glob", "text", "jsonl", "parquet")
    ]
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
    if spec.kind == "tfds":
        yield from _iter_tfds(spec)
        return
    if spec.kind == "builtin" and spec.name == "python-docs":
        from pydoc_data.topics import topics

        for topic in sorted(topics):
            yield Document(f"{spec.argument}:{topic}", topics[topic])
        return
    for path, kind, key in spec.files:
        key = spec.key_prefix + key
        if kind == "jsonl":
            yield from _iter_jsonl(path, key, spec.text_field, spec.fields)
        elif kind == "parquet":
            yield from _iter_parquet(path, key, spec.text_field, spec.fields)
        elif kind == "docstrings":
            yield from _iter_docstrings(spec, path)
        elif kind == "python":
            text = _read_python_source(path)
            if text is not None:
                yield Document(key, text)
        else:
            yield Document(key, _read_text(path))


def _iter_docstrings(spec: InputSpec, path: str) -> Iterator[Document]:
    module = os.path.basename(path)[: -len(".py")]
    for pair in pairs(module, _read_bytes(path)):
        if spec.fields.format == "messages":
            row: dict[str, Any] = {
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": pair.prompt},
                    {"role": "assistant", "content": pair.docstring},
                ]
            }
        else:
            row = {"prompt": pair.prompt + "\n", "completion": pair.docstring}
        key = f"{spec.argument}:{pair.name}"
        yield Document(key, "", row, spec.fields, f"{path} ({pair.name})")


def _open(path: str) -> BinaryIO:
    """A local file or a bucket object (through etils.epath and gcsfs) opened for reading."""
    try:
        return location(path).open("rb")
    except OSError as error:
        raise _unreadable(path, error) from None


def _unreadable(path: str, error: OSError) -> PrepareError:
    return PrepareError(
        f"cannot read {path} ({error.strerror or error}); check that it exists and is readable"
    )


def _read_bytes(path: str) -> bytes:
    with _open(path) as f:
        try:
            return f.read()
        except OSError as error:
            raise _unreadable(path, error) from None


def _read_text(path: str) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PrepareError(
            f"{path} is not valid UTF-8 (byte {error.start}: {error.reason}); convert it to "
            "UTF-8 or leave it out of the inputs"
        ) from None


def _read_python_source(path: str) -> str | None:
    """Decodes a stdlib source by Python's own rules (PEP 263), as the interpreter would.

    A handful of test fixtures are deliberately undecodable (``badsyntax_pep3120.py``); Python
    cannot read them either, so they are not part of a builtin corpus. That rule depends only on
    the Python version, so the corpus is still the same on every machine with that Python.
    """
    data = _read_bytes(path)
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _iter_jsonl(path: str, key: str, field: str, rows: RowFields | None) -> Iterator[Document]:
    with _open(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PrepareError(
                    f"{path} line {number} is not valid UTF-8 ({error.reason}); convert the "
                    "file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PrepareError(
                    f"{path} line {number} is not JSON ({error.msg} at column {error.colno}); "
                    "JSON Lines need one JSON object per line"
                ) from None
            if rows is not None:  # checked when rendered, so that a bad row can be skipped
                yield Document(f"{key}:{number}", "", record, rows, f"{path} line {number}")
                continue
            if not isinstance(record, dict):
                raise PrepareError(
                    f"{path} line {number} is {json_kind(record)}, not an object; "
                    f"JSON Lines need one object per line with field {field!r}"
                )
            if field not in record:
                raise PrepareError(
                    f"{path} line {number} has no field {field!r} (keys: "
                    f"{', '.join(sorted(record)) or 'none'}); pass --text-field with the text field"
                    f"{ROWS_HINT}"
                )
            text = record[field]
            if not isinstance(text, str):
                raise PrepareError(
                    f"{path} line {number}: field {field!r} is {json_kind(text)}, not a "
                    f"string; store the text as a JSON string{ROWS_HINT}"
                )
            yield Document(f"{key}:{number}", text)


def _parquet(path: str) -> ModuleType:
    return require("pyarrow.parquet", "parquet", f"{path}: reading Parquet")


@contextlib.contextmanager
def _parquet_file(path: str) -> Iterator[Any]:
    """pyarrow's ParquetFile of a local file (by path) or of a bucket object (`_open`)."""
    pq = _parquet(path)
    with _open(path) if is_url(path) else contextlib.nullcontext(path) as source:
        yield pq.ParquetFile(source)


def _parquet_columns(path: str) -> list[str]:
    try:
        with _parquet_file(path) as parquet:
            return list(parquet.schema_arrow.names)
    except PrepareError:
        raise
    except Exception as error:  # ArrowInvalid / OSError for a file that is not Parquet.
        raise PrepareError(
            f"{path} is not a readable Parquet file ({str(error).splitlines()[0]}); "
            "check the file or give it a different extension"
        ) from None


def _iter_parquet(path: str, key: str, field: str, rows: RowFields | None) -> Iterator[Document]:
    columns = _parquet_columns(path)
    if rows is not None:
        yield from _iter_parquet_rows(path, key, rows)
        return
    if field not in columns:
        raise PrepareError(
            f"{path} has no column {field!r} (columns: {', '.join(columns)}); "
            f"pass --text-field with the column that holds the text{ROWS_HINT}"
        )
    row = 0
    try:
        with _parquet_file(path) as parquet:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
                for value in batch.column(0).to_pylist():
                    yield Document(
                        f"{key}:row {row}", _as_text(value, f"{path} row {row} column {field!r}")
                    )
                    row += 1
    except PrepareError:
        raise
    except Exception as error:  # a truncated or corrupt row group.
        raise PrepareError(
            f"{path}: cannot read rows from row {row} ({str(error).splitlines()[0]}); "
            "the file is damaged, write it again"
        ) from None


def _iter_parquet_rows(path: str, key: str, rows: RowFields) -> Iterator[Document]:
    row = 0
    try:
        with _parquet_file(path) as parquet:
            columns = list(rows.columns)
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                for record in batch.to_pylist():
                    yield Document(f"{key}:row {row}", "", record, rows, f"{path} row {row}")
                    row += 1
    except PrepareError:
        raise
    except Exception as error:  # a truncated or corrupt row group.
        raise PrepareError(
            f"{path}: cannot read rows from row {row} ({str(error).splitlines()[0]}); "
            "the file is damaged, write it again"
        ) from None


def _as_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PrepareError(
                f"{where} is not valid UTF-8 ({error.reason}); store UTF-8 text"
            ) from None
    raise PrepareError(f"{where} is {json_kind(value)}, not text; store a string in every row")


def _iter_tfds(spec: InputSpec) -> Iterator[Document]:
    builder = _tfds_builder(spec.argument, spec.name, spec.data_dir)
    try:
        source = builder.as_data_source(split=spec.split)
    except Exception as error:
        raise PrepareError(
            f"input {spec.argument!r}: cannot read split {spec.split!r} "
            f"({(str(error).splitlines() or [type(error).__name__])[0]})"
        ) from None
    count = len(source)
    for start in range(0, count, TFDS_BATCH):
        indices = list(range(start, min(start + TFDS_BATCH, count)))
        records = (
            source.__getitems__(indices)
            if hasattr(source, "__getitems__")
            else [source[i] for i in indices]
        )
        for index, record in zip(indices, records, strict=True):
            where = f"{spec.argument} index {index} feature {spec.text_field!r}"
            text = _as_text(record[spec.text_field], where)
            yield Document(f"{spec.argument}:index {index}", text)
