"""`prepare` of instruction and chat rows: the loss mask, templates, bad rows, builtin corpora."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.commands.cli import main
from pipeline.errors import PrepareError, StoreError
from pipeline.ingest.chat import RowFields
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.ingest.prepare_beam import prepare_beam
from pipeline.store.token_store import TokenStore, file_sha256
from tests.test_faults import cli, edit_manifest
from tests.test_prepare_beam import _assert_same_stores

REPO = Path(__file__).resolve().parents[1]
MESSAGES = RowFields("messages")
PROMPTS = RowFields("prompt-completion")
ROBOT = {"role": "robot", "content": "x"}  # a message of no known role
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _chat(*turns: str) -> dict:
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns)]}


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _prepare(inputs: list[str], out: Path, **options: object) -> TokenStore:
    prepare(PrepareOptions(inputs=inputs, out=out, progress=False, **options))
    return TokenStore(out, verify=True)


def _documents(store: TokenStore) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document as (tokens, trained flags), in store order."""
    found = []
    for shard in range(store.num_shards):
        offsets = store.doc_offsets(shard)
        for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            tokens = store.read_shard_tokens(shard, start, stop).tokens
            found.append((tokens, store.trained(shard, start, stop)))
    return found


def _trained_text(store: TokenStore) -> list[str]:
    """Per document of a bytes store: its trained bytes (eod as '$'), sorted."""
    return sorted(
        "".join("$" if t == store.eod_id else chr(t) for t in tokens[mask].tolist())
        for tokens, mask in _documents(store)
    )


def test_messages_train_on_assistant_completion_and_all(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("hi", "hello", "more", "ok!"), _chat("x", "y")])
    store = _prepare([path], tmp_path / "a", fields=MESSAGES, num_shards=2)
    assert store.masked and store.manifest["format_version"] == 4
    assert _trained_text(store) == ["hello<|end|>\nok!<|end|>\n$", "y<|end|>\n$"]
    store = _prepare([path], tmp_path / "c", fields=MESSAGES, train_on="completion")
    assert _trained_text(store) == ["ok!<|end|>\n$", "y<|end|>\n$"]
    store = _prepare([path], tmp_path / "all", fields=MESSAGES, train_on="all")
    assert all(mask.all() for _, mask in _documents(store))
    whole = "<|user|>\nx\n<|assistant|>\ny<|end|>\n$"
    assert whole in _trained_text(store)


def test_prompt_completion_in_jsonl_and_parquet_with_own_field_names(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}? ", "a": f"answer {i}"} for i in range(5)]
    jsonl = _jsonl(tmp_path / "pc.jsonl", rows)
    parquet = tmp_path / "pc.parquet"
    pq.write_table(pa.table({"q": [r["q"] for r in rows], "a": [r["a"] for r in rows]}), parquet)
    fields = RowFields("prompt-completion", prompt="q", completion="a")
    store = _prepare([jsonl, str(parquet)], tmp_path / "s", fields=fields, num_shards=3)
    assert _trained_text(store) == sorted(f"answer {i}$" for i in range(5) for _ in range(2))
    assert store.manifest["created"]["row_format"]["prompt"] == "q"
    inputs = sorted(bytes(t[:-1].tolist()).decode() for t, _ in _documents(store))
    assert inputs == sorted(f"question {i}? answer {i}" for i in range(5) for _ in range(2))


def test_a_parquet_binary_column_is_named_bytes_not_a_list(tmp_path: Path) -> None:
    """A binary column reads as Python bytes, a Sequence: it is neither a string nor a list of
    messages, and the error says what it is."""
    path = tmp_path / "binary.parquet"
    rows = {"prompt": [b"q"], "completion": ["a"], "messages": [b"m"]}
    pq.write_table(pa.table(rows), path)
    for fields, field, wanted in (
        (PROMPTS, "prompt", "a string"),
        (MESSAGES, "messages", "a list"),
    ):
        with pytest.raises(PrepareError, match=rf"field '{field}' is bytes, not {wanted}"):
            _prepare([str(path)], tmp_path / "s", fields=fields)


def test_hf_tokenizer_uses_the_chat_template_of_its_config(
    tmp_path: Path, hf_tokenizer_json: Path
) -> None:
    tok = tokenizers.Tokenizer.from_file(str(hf_tokenizer_json))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": {"content": "<|endoftext|>"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [_chat("What is a list?", "A mutable sequence."), _chat("a", "b", "c", "d")]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    spec = f"hf:{directory / 'tokenizer.json'}"
    store = _prepare([path], tmp_path / "s", fields=MESSAGES, tokenizer=spec, workers=2)
    assert store.manifest["created"]["chat_template"]["name"] == "tokenizer_config.json"
    trained = sorted(
        tok.decode(tokens[mask][:-1].tolist(), skip_special_tokens=False)
        for tokens, mask in _documents(store)
    )
    assert trained == ["A mutable sequence.<|im_end|>\n", "b<|im_end|>\nd<|im_end|>\n"]
    im_start = tok.token_to_id("<|im_start|>")
    assert all(im_start in tokens.tolist() for tokens, _ in _documents(store))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "no messages"}, "has no field 'messages'"),
        ({"messages": []}, "empty conversation"),
        (
            {"messages": [*_chat("q")["messages"], ROBOT]},
            "message 2 has unknown role 'robot'",
        ),
        ({"messages": [*_chat("q")["messages"], "hi"]}, "message 2 is not an object with 'role'"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "nothing to train on"),
        ({"messages": "hello"}, "field 'messages' is a string, not a list of messages"),
        ([1, 2], "is a list, not an object"),
        ({"messages": [{"role": "user", "content": 3}]}, "message 1: content is a number, not"),
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, "content is an object, not"),
    ],
)
def test_a_bad_row_stops_with_file_and_line_or_is_skipped(
    tmp_path: Path, row: object, reason: str
) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a"), row, _chat("q2", "a2")])
    with pytest.raises(PrepareError, match=rf"chat\.jsonl line 2: .*{reason}"):
        _prepare([path], tmp_path / "s", fields=MESSAGES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]  # nothing half-written
    store = _prepare([path], tmp_path / "s", fields=MESSAGES, skip_bad_rows=True)
    assert store.num_documents == 2
    assert store.manifest["created"]["bad_rows_skipped"] == 1


def test_a_template_that_fails_names_the_row(tmp_path: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    rows = [
        _chat("q", "a"),
        {"messages": [{"role": "system", "content": "s"}, *_chat("q", "a")["messages"]]},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(
        PrepareError, match=r"chat\.jsonl line 2: the chat template fails.*no system"
    ):
        _prepare([path], tmp_path / "s", fields=MESSAGES, chat_template=str(template))


def test_a_template_that_renders_the_assistant_as_nothing_names_the_message(
    tmp_path: Path,
) -> None:
    template = tmp_path / "mute.jinja"
    template.write_text(
        "{% for m in messages if m.role != 'assistant' %}{{ m.content }}{% endfor %}"
    )
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a")])
    with pytest.raises(
        PrepareError, match=r"chat\.jsonl line 1: the template renders message 2 as nothing"
    ):
        _prepare([path], tmp_path / "s", fields=MESSAGES, chat_template=str(template))


@pytest.mark.parametrize(
    ("form", "rows", "reason"),
    [
        (
            "prompt-completion",
            [{"prompt": "p", "completion": "c"}, {"prompt": "p"}],
            "line 2: has no field 'completion' (fields: prompt)",
        ),
        (  # docs/instruction-data.md's example: the second message is message 2
            "messages",
            [_chat("q", "a")] * 6 + [{"messages": [*_chat("q")["messages"], ROBOT]}],
            "line 7: message 2 has unknown role 'robot' (roles: assistant, system, tool, user)",
        ),
    ],
    ids=["prompt-completion", "messages"],
)
def test_cli_bad_row_is_one_line_and_exit_2(
    tmp_path: Path, form: str, rows: list, reason: str
) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", path, "--out", str(tmp_path / "s"),
         "--format", form, "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {path} {reason} (fix the row, or pass --skip-bad-rows to leave bad rows out and "
        "count them)"
    ]


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        (["--train-on", "completion"], "--train-on is not read with --format text"),
        (["--skip-bad-rows"], "--skip-bad-rows is not read with --format text"),
        (
            ["--format", "messages", "--prompt-field", "q"],
            "--prompt-field is not read with --format messages",
        ),
        (
            ["--format", "prompt-completion", "--chat-template", "builtin"],
            "--chat-template is not read with --format prompt-completion",
        ),
        (
            ["--format", "messages", "--text-field", "text"],
            "--text-field is not read with --format messages",
        ),
        (
            ["--format", "prompt-completion", "--text-field", "body"],
            "--text-field is not read with --format prompt-completion",
        ),
    ],
)
def test_cli_refuses_a_row_option_its_format_does_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], refused: str
) -> None:
    """A forgotten --format must not turn chat rows into an unmasked store without a word."""
    path = _jsonl(tmp_path / "chat.jsonl", [{**_chat("q", "a"), "text": "t"}])
    out = tmp_path / "s"
    assert main(["prepare", path, "--out", str(out), "--no-progress", *options]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {refused}; it is for --format ")
    assert not out.exists()


@pytest.mark.parametrize(
    ("options", "text_field"),
    [(["--format", "messages"], "text"), (["--text-field", "body"], "body")],
)
def test_cli_takes_text_field_with_format_text_and_its_default_with_any(
    tmp_path: Path, options: list[str], text_field: str
) -> None:
    """Only a --text-field the user gives is checked: its default is no reason to refuse."""
    path = _jsonl(tmp_path / "chat.jsonl", [{**_chat("q", "a"), "body": "b"}])
    out = tmp_path / "s"
    assert main(["prepare", path, "--out", str(out), "--no-progress", *options]) == 0
    assert TokenStore(out).manifest["created"]["text_field"] == text_field


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        (["--prompt-field", "q"], "--prompt-field is not read with --format text"),
        (["--chat-template", "builtin"], "--chat-template is not read with --format text"),
    ],
)
def test_cli_refuses_for_a_builtin_corpus_what_its_format_does_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], refused: str
) -> None:
    """The prompt-completion corpus keeps its own fields and renders no chat template."""
    out = tmp_path / "s"
    argv = ["prepare", "builtin:python-docstrings", "--out", str(out), "--no-progress"]
    assert main([*argv, *options]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {refused}; it is for --format ")
    assert not out.exists()


TEXT_READERS = "it is read from JSONL/Parquet/TFDS rows with --format text"


@pytest.mark.parametrize(
    ("inputs", "options", "refused"),
    [
        (
            ["notes.txt", "builtin:python-docstrings"],
            ["--text-field", "body"],
            "--text-field is not read by any input: notes.txt is plain text (one document per "
            "file) and builtin:python-docstrings brings its own fields; " + TEXT_READERS,
        ),
        (
            ["docs", "notes/*.txt", "builtin:python-docs"],
            ["--text-field", "text"],  # given as its default value, still given
            "--text-field is not read by any input: docs is a directory of plain text (one "
            "document per file), notes/*.txt matches only plain text (one document per file) "
            "and builtin:python-docs is builtin text (no fields); " + TEXT_READERS,
        ),
        (
            ["builtin:python-docstrings-chat"],
            ["--format", "messages", "--messages-field", "conversation"],
            "--messages-field is not read by any input: builtin:python-docstrings-chat brings "
            "its own fields; it is read from JSONL/Parquet rows with --format messages",
        ),
        (
            ["builtin:python-docstrings"],
            ["--format", "prompt-completion", "--completion-field", "answer"],
            "--completion-field is not read by any input: builtin:python-docstrings brings its "
            "own fields; it is read from JSONL/Parquet rows with --format prompt-completion",
        ),
    ],
    ids=["text-and-instruction-corpus", "dir-glob-builtin", "chat-corpus", "prompt-corpus"],
)
def test_cli_refuses_a_field_option_no_input_reads(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    inputs: list[str],
    options: list[str],
    refused: str,
) -> None:
    """A field the user names must select what is trained on, not be passed over."""
    monkeypatch.chdir(tmp_path)  # relative inputs: the message names them as typed
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("plain text")
    (tmp_path / "notes.txt").write_text("plain text")
    shutil.copytree(tmp_path / "notes", tmp_path / "docs")
    argv = ["prepare", *inputs, "--out", "s", "--no-progress", *options]
    assert cli(capsys, *argv) == (2, f"error: {refused}\n")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("inputs", "options", "recorded"),
    [
        (
            ["notes.txt", "rows.jsonl", "builtin:python-docstrings"],
            ["--text-field", "body"],
            ("text_field", "body"),
        ),
        (
            ["notes.txt", "tfds:store_text:train"],
            ["--text-field", "text"],
            ("text_field", "text"),
        ),
        (["notes.txt", "builtin:python-docstrings"], [], ("text_field", "text")),
        (
            ["builtin:python-docstrings-chat", "rows.jsonl"],
            ["--format", "messages", "--messages-field", "conversation"],
            ("row_format", asdict(RowFields("messages", messages="conversation"))),
        ),
    ],
    ids=["jsonl-among-others", "tfds-among-others", "not-given", "chat-jsonl-and-corpus"],
)
def test_cli_takes_a_field_option_one_input_reads(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    inputs: list[str],
    options: list[str],
    recorded: tuple[str, object],
) -> None:
    """Mixed inputs: those with fields read it, the others need none; not given, no check."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("plain text")
    _jsonl(tmp_path / "rows.jsonl", [{"body": "b", "conversation": _chat("q", "a")["messages"]}])
    if "tfds:store_text:train" in inputs:
        options = [*options, "--tfds-data-dir", request.getfixturevalue("tfds_text_dir")]
    argv = ["prepare", *inputs, "--out", "s", "--no-progress", "--num-shards", "1", *options]
    assert cli(capsys, *argv)[0] == 0
    key, value = recorded
    assert TokenStore(tmp_path / "s").manifest["created"][key] == value


def test_cli_train_on_reaches_a_builtin_corpus_of_its_own_format(tmp_path: Path) -> None:
    """builtin:python-docstrings is prompt-completion rows under the default --format text."""
    argv = ["prepare", "builtin:python-docstrings", "--no-progress", "--num-shards", "1"]
    assert main([*argv, "--out", str(tmp_path / "default")]) == 0
    assert main([*argv, "--out", str(tmp_path / "all"), "--train-on", "all"]) == 0
    default, every = TokenStore(tmp_path / "default"), TokenStore(tmp_path / "all")
    assert every.manifest["created"]["train_on"] == "all"
    assert not all(mask.all() for _, mask in _documents(default))
    assert all(mask.all() for _, mask in _documents(every))


@pytest.mark.parametrize("template", ["builtin", "chatml.jinja"])
def test_cli_chat_template_reaches_the_builtin_chat_corpus(tmp_path: Path, template: str) -> None:
    """builtin:python-docstrings-chat is messages rows under the default --format text."""
    (tmp_path / "chatml.jinja").write_text(CHATML)
    choice = template if template == "builtin" else str(tmp_path / template)
    out = tmp_path / "s"
    argv = ["prepare", "builtin:python-docstrings-chat", "--out", str(out), "--no-progress"]
    assert main([*argv, "--num-shards", "1", "--chat-template", choice]) == 0
    store = TokenStore(out)
    assert store.manifest["created"]["chat_template"]["name"] == template
    tokens, _ = _documents(store)[0]
    assert (b"<|im_start|>" in bytes(tokens[:-1].tolist())) == (template == "chatml.jinja")


def test_cli_names_skipped_bad_rows_even_without_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a"), {"messages": []}, _chat("r", "b")])
    out = tmp_path / "s"
    argv = ["prepare", path, "--out", str(out), "--format", "messages", "--skip-bad-rows"]
    assert main([*argv, "--no-progress"]) == 0
    summary = ", with a loss mask, 1 bad row left out (--skip-bad-rows)"
    assert capsys.readouterr().out == f"train: {out}: 2 documents, " + (
        f"{TokenStore(out).num_tokens} tokens, 8 shards, tokenizer bytes, uint16{summary}\n"
    )
    assert main(["store-info", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"{summary}\n")


def test_rows_need_jsonl_or_parquet_inputs(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("plain text")
    with pytest.raises(PrepareError, match="not JSONL or Parquet rows; --format messages"):
        _prepare([str(tmp_path / "notes.txt")], tmp_path / "s", fields=MESSAGES)
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["p"]}), parquet)
    with pytest.raises(PrepareError, match="has no column 'completion'"):
        _prepare([str(parquet)], tmp_path / "s", fields=PROMPTS)


def test_pretraining_stores_are_unchanged_and_fully_trained(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    store = _prepare([path], tmp_path / "s", num_shards=2)
    assert not store.masked and store.manifest["format_version"] == 3
    assert not list((tmp_path / "s").glob("*.untrained.npy"))
    assert "untrained" not in store.manifest["shards"][0]
    assert all(mask.all() for _, mask in _documents(store))


def test_the_mask_is_checked_at_open_first_use_and_verify(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(6)])
    _prepare([path], tmp_path / "s", fields=MESSAGES, num_shards=1)
    spans = tmp_path / "s" / "shard-00000-of-00001.untrained.npy"
    array = np.load(spans)
    array[0, 1] -= 1
    np.save(spans, array)  # same size: open's cheap facts pass, the shard's first use does not
    store = TokenStore(tmp_path / "s")
    with pytest.raises(StoreError, match=r"untrained\.npy: does not match its checksum"):
        store.trained(0, 0, 10)
    with pytest.raises(StoreError, match=r"untrained\.npy: does not match its checksum"):
        TokenStore(tmp_path / "s", verify=True)
    spans.unlink()
    with pytest.raises(
        StoreError, match=r"untrained\.npy: loss mask listed in the manifest is missing"
    ):
        TokenStore(tmp_path / "s").trained(0, 0, 10)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (np.zeros((2, 3), np.int64), r"int64\[2, 3\], a loss mask is int64\[k, 2\]"),
        (np.array([[5, 9], [0, 3]], np.int64), "not ordered ranges inside the shard"),
        (np.array([[0, 10**9]], np.int64), "not ordered ranges inside the shard"),
    ],
)
def test_a_mask_that_matches_its_checksum_must_still_be_ranges(
    tmp_path: Path, mask: np.ndarray, message: str
) -> None:
    """A writer's bug, not damage: the checksums agree, the spans' shape and order do not."""
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a")])
    _prepare([path], tmp_path / "s", fields=MESSAGES, num_shards=1)
    spans = tmp_path / "s" / "shard-00000-of-00001.untrained.npy"
    np.save(spans, mask)

    def rehash(manifest: dict) -> None:
        manifest["shards"][0]["untrained_sha256"] = file_sha256(spans)

    edit_manifest(tmp_path / "s", rehash, redo_checksum=True)
    with pytest.raises(StoreError, match=message):
        TokenStore(tmp_path / "s").trained(0, 0, 1)


@pytest.mark.parametrize("version", [3, 4])
def test_a_mask_is_in_every_shard_of_format_4_and_in_none_of_format_3(
    tmp_path: Path, version: int
) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(6)])
    _prepare([path], tmp_path / "s", fields=MESSAGES, num_shards=2)

    def edit(manifest: dict) -> None:  # format 3 listing a mask; format 4 with one shard's gone
        manifest["format_version"] = version
        if version == 4:
            del manifest["shards"][1]["untrained_sha256"]

    edit_manifest(tmp_path / "s", edit, redo_checksum=True)
    key = "shards[0].untrained" if version == 3 else "shards[1].untrained_sha256"
    with pytest.raises(StoreError, match=rf"manifest field '{re.escape(key)}' must be"):
        TokenStore(tmp_path / "s")


def test_mask_changes_the_fingerprint(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a", "q2", "a2")])
    one = _prepare([path], tmp_path / "a", fields=MESSAGES)
    other = _prepare([path], tmp_path / "b", fields=MESSAGES, train_on="completion")
    assert one.fingerprint != other.fingerprint


def test_beam_writes_the_same_masked_store(tmp_path: Path) -> None:
    chat = _jsonl(tmp_path / "chat.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(9)] + [{}])
    kwargs = {"fields": MESSAGES, "num_shards": 3, "eval_fraction": 0.3, "skip_bad_rows": True}
    inputs = [chat, "builtin:python-docstrings"]
    local = prepare(PrepareOptions(inputs, tmp_path / "local", progress=False, **kwargs))
    beam = prepare_beam(PrepareOptions(inputs, tmp_path / "beam", **kwargs))
    _assert_same_stores(local, beam)
    assert TokenStore(local["train"]).manifest["created"]["bad_rows_skipped"] == 1


def test_builtin_docstrings_corpus(tmp_path: Path) -> None:
    store = _prepare(["builtin:python-docstrings"], tmp_path / "a", num_shards=2)
    again = _prepare(["builtin:python-docstrings"], tmp_path / "b", num_shards=2)
    assert store.fingerprint == again.fingerprint
    assert 1000 <= store.num_documents <= 20000
    wanted = b"`textwrap.dedent("
    tokens, mask = next(d for d in _documents(store) if wanted in bytes(d[0][:-1].tolist()))
    text = bytes(tokens[:-1].tolist()).decode()
    assert text.startswith("Write the docstring of the function `textwrap.dedent(text)`.\n")
    assert bytes(tokens[mask][:-1].tolist()).decode().startswith("Remove any common leading")
    chat = _prepare(["builtin:python-docstrings-chat"], tmp_path / "c", num_shards=2)
    assert chat.num_documents == store.num_documents
    assert all(b"<|assistant|>\n" in bytes(t[~m].tolist()) for t, m in _documents(chat)[:50])


_text = st.text(alphabet="ab\n é", max_size=12)


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _text),
        min_size=1,
        max_size=6,
    ).filter(lambda turns: any(role == "assistant" for role, _ in turns))
)
def test_trained_tokens_are_exactly_the_assistant_turns(turns: list[tuple[str, str]]) -> None:
    """Property: with the builtin template, the trained bytes are each assistant message with
    its `<|end|>\\n`, in order, then the eod; everything else keeps its place untrained."""
    from pipeline.ingest.chat import BUILTIN_TEMPLATE, ChatTemplate
    from pipeline.ingest.corpora import Document
    from pipeline.ingest.prepare import DocumentEncoder
    from pipeline.ingest.tokenizers import BytesTokenizer

    options = PrepareOptions(["unused"], Path("unused"))
    encoder = DocumentEncoder(
        options, BytesTokenizer(), np.dtype(np.uint16), ChatTemplate(BUILTIN_TEMPLATE, "builtin")
    )
    row = {"messages": [{"role": r, "content": c} for r, c in turns]}
    tokens, untrained = encoder(Document("k", "", row, MESSAGES, "here"))
    mask = np.ones(len(tokens), bool)
    for lo, hi in untrained.tolist():
        mask[lo:hi] = False
    assert (np.diff(untrained.reshape(-1)) > 0).all()  # sorted, disjoint, non-empty
    expected = "".join(c + "<|end|>\n" for r, c in turns if r == "assistant").encode()
    trained = tokens[mask]
    assert bytes(trained[trained != 256].tolist()) == expected  # the eod aside
    assert mask[-1] == (turns[-1][0] == "assistant")
    rendered = "".join(
        f"<|{r}|>\n{c}" + ("<|end|>" if r == "assistant" else "") + "\n" for r, c in turns
    )
    assert bytes(tokens[:-1].tolist()).decode() == rendered


def test_skip_rows_cleanup_when_every_row_is_bad(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": []}])
    with pytest.raises(PrepareError, match="no non-empty documents"):
        _prepare([path], tmp_path / "s", fields=MESSAGES, skip_bad_rows=True)
    assert not (tmp_path / "s").exists()
    shutil.rmtree(tmp_path / "s", ignore_errors=True)


def test_verify_store_cli_names_the_mask(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [_chat("q", "a")])
    _prepare([path], tmp_path / "s", fields=MESSAGES)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "verify-store", str(tmp_path / "s")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and "with a loss mask" in result.stdout
