"""Corpora: every input kind on real files, real Parquet, a real TFDS dataset, builtin corpora."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from pipeline.errors import PrepareError
from pipeline.ingest.chat import RowFields
from pipeline.ingest.corpora import (
    BUILTIN_CORPORA,
    Document,
    InputSpec,
    check_fields_read,
    iter_documents,
    resolve_inputs,
)
from pipeline.ingest.formats import FORMATS


def _docs(inputs: list[str], **kwargs: object) -> list[Document]:
    return [doc for spec in resolve_inputs(inputs, **kwargs) for doc in iter_documents(spec)]


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    _write(root / "b.txt", "bee")
    _write(root / "a" / "z.py", "print('z')\n")
    _write(root / "a" / "y.md", "")
    _write(root / ".hidden", "secret")
    _write(root / ".git" / "config", "secret")
    _write(root / "data.jsonl", '{"text": "raw"}\n')
    return root


def test_directory_sorted_relative_keys_hidden_ignored(corpus: Path) -> None:
    docs = _docs([str(corpus)])
    assert docs == [
        Document("a/y.md", ""),  # empty texts are yielded; the caller decides.
        Document("a/z.py", "print('z')\n"),
        Document("b.txt", "bee"),
        Document("data.jsonl", '{"text": "raw"}\n'),  # a directory is read as plain text.
    ]
    [spec] = resolve_inputs([str(corpus)])
    assert isinstance(spec, InputSpec) and spec.kind == "dir" and spec.key_prefix == ""


def test_keys_do_not_depend_on_where_the_corpus_lives(corpus: Path, tmp_path: Path) -> None:
    moved = shutil.copytree(corpus, tmp_path / "elsewhere" / "deeper")
    assert _docs([str(corpus)]) == _docs([str(moved)])


def test_glob_reads_each_file_by_its_kind(tmp_path: Path) -> None:
    _write(tmp_path / "in" / "x.txt", "ex")
    _write(tmp_path / "in" / "sub" / "w.txt", "double-u")
    _write(tmp_path / "in" / "rows.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    _write(tmp_path / "in" / "skip.md", "not matched")
    docs = _docs([f"{tmp_path}/in/*.txt", f"{tmp_path}/in/*.jsonl"])
    assert docs == [
        Document("x.txt", "ex"),
        Document("rows.jsonl:1", "one"),
        Document("rows.jsonl:2", "two"),
    ]
    recursive = _docs([f"{tmp_path}/in/**/*.txt"])
    assert [d.key for d in recursive] == ["sub/w.txt", "x.txt"]


def test_single_text_file_key_is_its_name(tmp_path: Path) -> None:
    path = _write(tmp_path / "deep" / "notes.txt", "héllo\n")
    assert _docs([str(path)]) == [Document("notes.txt", "héllo\n")]


def test_jsonl_lines_keys_and_blank_lines(tmp_path: Path) -> None:
    rows = [{"text": "first", "id": 1}, {"text": ""}, {"body": "x", "text": "third ✓"}]
    lines = [json.dumps(r) for r in rows]
    path = _write(tmp_path / "d.jsonl", "\n".join([lines[0], "", lines[1], lines[2]]) + "\n")
    assert _docs([str(path)]) == [
        Document("d.jsonl:1", "first"),
        Document("d.jsonl:3", ""),
        Document("d.jsonl:4", "third ✓"),
    ]
    other = _write(tmp_path / "e.json", json.dumps({"body": "b"}) + "\n")
    assert _docs([str(other)], text_field="body") == [Document("e.json:1", "b")]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"text": "ok"}\n{"text": \n', r"line 2 is not JSON"),
        (
            b'{"text": "ok"}\n{"body": "x", "id": 3}\n',
            r"line 2 has no field 'text' \(keys: body, id\)",
        ),
        (b'["text"]\n', r"line 1 is a list, not an object"),
        (b'{"text": null}\n', r"line 1: field 'text' is null, not a string"),
        (b'{"text": 7}\n', r"line 1: field 'text' is a number, not a string"),
        (b'{"text": "caf\xe9"}\n', r"line 1 is not valid UTF-8"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path: Path, content: bytes, match: str) -> None:
    path = _write(tmp_path / "bad.jsonl", content)
    [spec] = resolve_inputs([str(path)])
    with pytest.raises(PrepareError, match=match) as error:
        list(iter_documents(spec))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text_field", [None, "messages"])
def test_chat_rows_read_as_text_name_the_row_formats(tmp_path: Path, text_field) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = _write(tmp_path / "chat.jsonl", json.dumps(chat).encode() + b"\n")
    [spec] = resolve_inputs([str(path)], **({"text_field": text_field} if text_field else {}))
    with pytest.raises(PrepareError) as error:
        list(iter_documents(spec))
    assert "--format messages or --format prompt-completion" in str(error.value)


def test_parquet_rows_read_as_text_name_the_row_formats(tmp_path: Path) -> None:
    path = tmp_path / "pc.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "completion": ["a"]}), path)
    with pytest.raises(PrepareError, match="--format messages or --format prompt-completion"):
        resolve_inputs([str(path)])


def test_parquet_in_record_batches(tmp_path: Path) -> None:
    texts = [f"row {i}" for i in range(2500)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(2500)), "text": texts}), path, row_group_size=700)
    docs = _docs([str(path)])
    assert [d.text for d in docs] == texts
    assert docs[0].key == "t.parquet:row 0" and docs[-1].key == "t.parquet:row 2499"


def test_parquet_binary_column_and_custom_field(tmp_path: Path) -> None:
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": pa.array([b"caf\xc3\xa9"], pa.binary())}), path)
    assert _docs([str(path)], text_field="content") == [Document("b.parquet:row 0", "café")]


def test_parquet_errors(tmp_path: Path) -> None:
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"body": ["x", None], "id": [1, 2], "tags": [["a"], ["b"]]}), path)
    with pytest.raises(
        PrepareError, match=r"has no column 'text' \(columns: body, id, tags\)"
    ) as error:
        resolve_inputs([str(path)])
    assert str(path) in str(error.value)
    [spec] = resolve_inputs([str(path)], text_field="body")
    with pytest.raises(PrepareError, match=r"row 1 column 'body' is null, not text"):
        list(iter_documents(spec))
    for field, kind in (("id", "a number"), ("tags", "a list")):
        [spec] = resolve_inputs([str(path)], text_field=field)
        with pytest.raises(PrepareError, match=rf"row 0 column '{field}' is {kind}, not text"):
            list(iter_documents(spec))
    fake = _write(tmp_path / "fake.parquet", b"not parquet at all")
    with pytest.raises(PrepareError, match=f"{fake} is not a readable Parquet file"):
        resolve_inputs([str(fake)])


def test_text_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "dir" / "latin1.txt", "café".encode("latin-1"))
    [spec] = resolve_inputs([str(tmp_path / "dir")])
    with pytest.raises(PrepareError, match=f"{path} is not valid UTF-8"):
        list(iter_documents(spec))


def test_missing_inputs_fail_up_front(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.txt", "fine")
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(PrepareError, match=f"input '{missing}' does not exist"):
        resolve_inputs([str(good), missing])
    with pytest.raises(PrepareError, match="the glob matches no files"):
        resolve_inputs([f"{tmp_path}/*.nothing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="directory has no"):
        resolve_inputs([str(tmp_path / "empty")])
    with pytest.raises(PrepareError, match="no inputs"):
        resolve_inputs([])


def test_unknown_builtin_lists_valid_names() -> None:
    with pytest.raises(
        PrepareError,
        match="builtin:python-code, builtin:python-tests, builtin:python-docs",
    ):
        resolve_inputs(["builtin:python-cod"])


def test_duplicates_and_overlaps_are_refused(corpus: Path) -> None:
    with pytest.raises(PrepareError, match="given twice"):
        resolve_inputs([str(corpus), str(corpus)])
    with pytest.raises(PrepareError, match=r"b.txt is read by both input"):
        resolve_inputs([str(corpus), f"{corpus}/*.txt"])


def test_colliding_keys_get_the_input_as_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "one" / "README", "1")
    _write(tmp_path / "one" / "only_one", "o")
    _write(tmp_path / "two" / "README", "2")
    _write(tmp_path / "three" / "other", "3")
    monkeypatch.chdir(tmp_path)  # relative arguments keep the prefixes machine-independent.
    docs = _docs(["one", "two", "three"])
    assert [d.key for d in docs] == ["one|README", "one|only_one", "two|README", "other"]
    # A text file named like a JSONL line key collides too.
    _write(tmp_path / "four" / "d.jsonl", '{"text": "x"}\n')
    _write(tmp_path / "five" / "d.jsonl:1", "y")
    keys = [d.key for d in _docs(["four", "five"])]
    assert keys == ["four|d.jsonl", "five|d.jsonl:1"]
    keys = [d.key for d in _docs(["four/d.jsonl", "five"])]
    assert keys == ["four/d.jsonl|d.jsonl:1", "five|d.jsonl:1"]


class TinyText(tfds.core.GeneratorBasedBuilder):
    """A real TFDS dataset, prepared in array_record format, read back without TensorFlow."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager: object) -> dict[str, object]:
        return {"train": self._generate_examples(7)}

    def _generate_examples(self, count: int) -> Iterator[tuple[int, dict[str, str]]]:
        for i in range(count):
            yield i, {"text": f"document {i} — ünïcode"}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    TinyText(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return data_dir


def test_tfds_dataset_reads_back(tfds_dir: str) -> None:
    [spec] = resolve_inputs(["tfds:tiny_text:train"], tfds_data_dir=tfds_dir)
    docs = list(iter_documents(spec))
    assert sorted(d.text for d in docs) == sorted(f"document {i} — ünïcode" for i in range(7))
    assert [d.key for d in docs] == [f"tfds:tiny_text:train:index {i}" for i in range(7)]
    assert docs == list(iter_documents(spec))  # deterministic order.


def test_tfds_data_dir_from_environment(tfds_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFDS_DATA_DIR", tfds_dir)
    [spec] = resolve_inputs(["tfds:tiny_text:train"])
    assert spec.data_dir == tfds_dir


@pytest.mark.parametrize(
    ("argument", "match"),
    [
        ("tfds:tiny_text", "not of the form tfds:NAME"),
        ("tfds::train", "not of the form tfds:NAME"),
        ("tfds:tiny_text:test", r"has no split 'test' \(splits: train\)"),
        ("tfds:no_such_dataset_here:train", "cannot open TFDS dataset no_such_dataset_here"),
        ("tfds:mnist:train", "dataset mnist is not prepared in"),
    ],
)
def test_tfds_bad_inputs(
    tfds_dir: str, argument: str, match: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(PrepareError, match=match) as error:
        resolve_inputs([argument], tfds_data_dir=tfds_dir)
    assert argument in str(error.value) and "\n" not in str(error.value)
    assert [record.getMessage() for record in caplog.records] == []  # the error line alone


def test_tfds_missing_feature_lists_features(tfds_dir: str) -> None:
    with pytest.raises(PrepareError, match=r"no feature 'body' \(features: text\)"):
        resolve_inputs(["tfds:tiny_text:train"], text_field="body", tfds_data_dir=tfds_dir)


def _check_builtin_keys(docs: list[Document], name: str) -> None:
    keys = [d.key for d in docs]
    assert len(set(keys)) == len(keys)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(k.startswith(f"builtin:{name}:") and stdlib not in k for k in keys)


def test_builtin_python_code() -> None:
    docs = _docs(["builtin:python-code"])
    assert len(docs) > 100
    _check_builtin_keys(docs, "python-code")
    keys = {d.key for d in docs}
    assert "builtin:python-code:json/decoder.py" in keys
    assert not any("/test/" in k or k.startswith("builtin:python-code:test/") for k in keys)
    assert not any("/tests/" in k or "idle_test" in k or "site-packages" in k for k in keys)


def test_builtin_python_tests() -> None:
    test_dir = os.path.join(sysconfig.get_paths()["stdlib"], "test")
    if not os.path.isdir(test_dir):
        with pytest.raises(PrepareError, match="no test suite"):
            resolve_inputs(["builtin:python-tests"])
        return
    docs = _docs(["builtin:python-tests"])
    assert len(docs) > 50
    _check_builtin_keys(docs, "python-tests")
    assert all(d.key.startswith("builtin:python-tests:test/") for d in docs)


def test_builtin_python_docs() -> None:
    from pydoc_data.topics import topics

    docs = _docs(["builtin:python-docs"])
    assert len(docs) > 50
    assert [d.key for d in docs] == [f"builtin:python-docs:{t}" for t in sorted(topics)]
    assert all(d.text == topics[d.key.rsplit(":", 1)[1]] for d in docs)


def test_builtin_descriptions() -> None:
    assert set(BUILTIN_CORPORA) == {
        "python-code",
        "python-tests",
        "python-docs",
        "python-docstrings",
        "python-docstrings-chat",
    }
    assert all(isinstance(v, str) and "\n" not in v for v in BUILTIN_CORPORA.values())


def test_mixed_inputs_have_unique_keys(tfds_dir: str, corpus: Path) -> None:
    docs = _docs(
        [str(corpus), "builtin:python-docs", "tfds:tiny_text:train"], tfds_data_dir=tfds_dir
    )
    keys = [d.key for d in docs]
    assert len(keys) == len(set(keys))


def test_a_new_input_format_is_one_module_and_one_registry_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FORMATS, "lines", "tests.lines_format")
    path = _write(tmp_path / "a.lines", "first\nsecond\n")
    docs = _docs([str(path)])
    assert [(d.key, d.text) for d in docs] == [("a.lines:1", "first"), ("a.lines:2", "second")]
    glob_docs = _docs([str(tmp_path / "*.lines")])  # a glob's files go by their format too
    assert [d.text for d in glob_docs] == ["first", "second"]
    specs = resolve_inputs([str(path)])
    with pytest.raises(PrepareError, match=r"is lines of text \(one document per line\)"):
        check_fields_read(specs, ["--text-field"], "text")
    with pytest.raises(PrepareError, match="is not JSONL or Parquet rows"):
        resolve_inputs([str(path)], fields=RowFields("messages"))
