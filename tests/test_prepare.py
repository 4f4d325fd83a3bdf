"""`prepare` end to end: determinism, every input kind and tokenizer, eval split, failures."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from pipeline.commands.cli import main
from pipeline.errors import PrepareError, StoreError
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.ingest.tokenizers import load_tokenizer
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import token_dtype

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _prepare(inputs: list[str], out: Path, **options: object) -> TokenStore:
    prepare(PrepareOptions(inputs=inputs, out=out, progress=False, **options))
    return TokenStore(out, verify=True)


def _records(store: TokenStore) -> list[tuple[int, ...]]:
    """Every document of the store, in store order, as token tuples without the eod."""
    documents = []
    for shard in range(store.num_shards):
        for record in range(int(store.shard_documents[shard])):
            tokens = store.document(shard, record)
            assert tokens[-1] == store.eod_id
            documents.append(tuple(int(t) for t in tokens[:-1]))
    return documents


def _texts(store: TokenStore) -> list[str]:
    """The documents of a bytes-tokenizer store, in store order."""
    return [bytes(d).decode("utf-8") for d in _records(store)]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def _write_corpus(root: Path, count: int) -> list[str]:
    """A directory of `count` distinct text files (some unicode, one empty); returns the texts."""
    texts = [f"file {i}: " + "héllo ✓ " * (i % 5) + "line\n" * (i % 3) for i in range(count)]
    texts[3] = ""
    for i, text in enumerate(texts):
        path = root / f"sub{i % 4}" / f"doc{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return texts


def test_deterministic_across_runs_and_workers_seed_reorders(tmp_path: Path) -> None:
    texts = _write_corpus(tmp_path / "corpus", 80)
    inputs = [str(tmp_path / "corpus")]
    first = _prepare(inputs, tmp_path / "one", num_shards=3, seed=5)
    _prepare(inputs, tmp_path / "two", num_shards=3, seed=5)
    _prepare(inputs, tmp_path / "pool", num_shards=3, seed=5, workers=2)
    reference = _files(tmp_path / "one")
    assert "manifest.json" in reference and len(reference) == 1 + 3 * 5  # 5 files per shard
    assert _files(tmp_path / "two") == reference
    assert _files(tmp_path / "pool") == reference
    assert Counter(_texts(first)) == Counter(t for t in texts if t)
    assert first.manifest["created"]["empty_documents_dropped"] == 1

    other = _prepare(inputs, tmp_path / "reseeded", num_shards=3, seed=6)
    assert _texts(other) != _texts(first)
    assert Counter(_texts(other)) == Counter(_texts(first))
    assert other.fingerprint != first.fingerprint


def _dir_input(tmp_path: Path) -> tuple[list[str], list[str], dict[str, object]]:
    texts = _write_corpus(tmp_path / "dir", 12)
    return [str(tmp_path / "dir")], texts, {}


def _glob_input(tmp_path: Path) -> tuple[list[str], list[str], dict[str, object]]:
    texts = _write_corpus(tmp_path / "g", 12)
    (tmp_path / "g" / "sub0" / "skip.md").write_text("not matched")
    return [f"{tmp_path}/g/**/*.txt"], texts, {}


def _jsonl_input(tmp_path: Path) -> tuple[list[str], list[str], dict[str, object]]:
    texts = [f"row {i} — ✓\nsecond line" for i in range(20)] + [""]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return [str(path)], texts, {"text_field": "body"}


def _parquet_input(tmp_path: Path) -> tuple[list[str], list[str], dict[str, object]]:
    texts = [f"parquet row {i} ünï" for i in range(50)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(50)), "text": texts}), path, row_group_size=16)
    return [str(path)], texts, {}


def _tfds_input(data_dir: str, texts: list[str]) -> tuple[list[str], list[str], dict[str, object]]:
    return ["tfds:store_text:train"], texts, {"tfds_data_dir": data_dir}


def _docs_input(tmp_path: Path) -> tuple[list[str], list[str], dict[str, object]]:
    return ["builtin:python-docs"], list(topics.values()), {}


@pytest.mark.parametrize("kind", ["dir", "glob", "jsonl", "parquet", "tfds", "python-docs"])
def test_each_input_kind_end_to_end(tmp_path: Path, kind: str, request) -> None:
    if kind == "tfds":
        inputs, texts, extra = _tfds_input(
            request.getfixturevalue("tfds_text_dir"), request.getfixturevalue("tfds_texts")
        )
    else:
        make = {
            "dir": _dir_input,
            "glob": _glob_input,
            "jsonl": _jsonl_input,
            "parquet": _parquet_input,
            "python-docs": _docs_input,
        }[kind]
        inputs, texts, extra = make(tmp_path)
    store = _prepare(inputs, tmp_path / "store", num_shards=2, **extra)
    assert Counter(_texts(store)) == Counter(t for t in texts if t)
    assert store.num_tokens == sum(len(t.encode()) + 1 for t in texts if t)
    assert store.manifest["created"]["empty_documents_dropped"] == texts.count("")
    assert store.manifest["created"]["inputs"] == inputs


def _check_tokenizer_store(store: TokenStore, spec: str, texts: list[str]) -> None:
    tokenizer = load_tokenizer(spec)
    record = store.manifest["tokenizer"]
    assert record == {
        "name": tokenizer.name,
        "kind": spec.split(":")[0],
        "model_sha256": hashlib.sha256(Path(spec.split(":", 1)[1]).read_bytes()).hexdigest(),
        "spec": spec,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
    }
    assert store.manifest["dtype"] == token_dtype(tokenizer.vocab_size).name
    expected = Counter(tuple(int(i) for i in tokenizer.encode(t)) for t in texts)
    assert Counter(_records(store)) == expected
    assert all(max(d, default=0) < tokenizer.vocab_size for d in _records(store))


def test_sentencepiece_and_hf_tokenizers(
    tmp_path: Path, sentencepiece_model: Path, hf_tokenizer_json: Path
) -> None:
    texts = [topics[t][:400] for t in sorted(topics)[:30]]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = f"sentencepiece:{sentencepiece_model}"
    store = _prepare([str(path)], tmp_path / "sp", num_shards=2, tokenizer=spec)
    assert store.manifest["tokenizer"]["name"].startswith("sentencepiece:sp.model@")
    assert (store.vocab_size, store.eod_id, store.dtype) == (200, 2, np.uint16)
    _check_tokenizer_store(store, spec, texts)

    spec = f"hf:{hf_tokenizer_json}"
    store = _prepare([str(path)], tmp_path / "hf", num_shards=2, tokenizer=spec, workers=2)
    assert store.manifest["tokenizer"]["name"].startswith("hf:tokenizer.json@")
    assert (store.vocab_size, store.eod_id, store.dtype) == (300, 1, np.uint16)
    _check_tokenizer_store(store, spec, texts)


def test_vocab_over_65536_is_stored_as_uint32(tmp_path: Path) -> None:
    from tokenizers import models, pre_tokenizers

    size = 70_000
    vocab = {f"w{i}": i for i in range(size)}
    vocab["<|endoftext|>"] = size
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    texts = ["w1 w65535 w65536", "w69999 w2", "w12345"]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = f"hf:{tmp_path / 'big.json'}"
    store = _prepare([str(path)], tmp_path / "store", num_shards=1, tokenizer=spec)
    assert (store.vocab_size, store.eod_id, store.dtype) == (size + 1, size, np.uint32)
    assert Counter(_records(store)) == Counter([(1, 65535, 65536), (69999, 2), (12345,)])
    assert store.read_tokens(0, store.num_tokens).tokens.max() == size
    # The boundary: 65536 ids (0..65535) still fit uint16.
    assert token_dtype(257) == token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_eval_split_partitions_the_corpus(tmp_path: Path) -> None:
    texts = [f"document {i} ✓" for i in range(200)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "store"
    paths = prepare(
        PrepareOptions([str(path)], out, num_shards=3, eval_fraction=0.3, progress=False)
    )
    assert paths == {"train": out, "eval": tmp_path / "store-eval"}
    train, held_out = TokenStore(out, verify=True), TokenStore(paths["eval"], verify=True)
    train_texts, eval_texts = set(_texts(train)), set(_texts(held_out))
    assert not train_texts & eval_texts
    assert sorted(train_texts | eval_texts) == sorted(texts)
    assert 0.15 * len(texts) < len(eval_texts) < 0.45 * len(texts)
    assert (train.manifest["created"]["split"], held_out.manifest["created"]["split"]) == (
        "train",
        "eval",
    )
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("fraction", "message"),
    [
        (0.01, "--eval-fraction 0.01 held out none of the 3 documents (about 0.03 expected); "),
        (0.999, "--eval-fraction 0.999 held out all 3 documents, none is left for training"),
    ],
)
def test_an_empty_split_says_which_way_the_eval_fraction_is_off(
    tmp_path: Path, fraction: float, message: str
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    options = PrepareOptions([str(path)], tmp_path / "s", eval_fraction=fraction, progress=False)
    with pytest.raises(PrepareError) as error:
        prepare(options)
    assert str(error.value).startswith(message)
    assert _leftovers(tmp_path) == [] and not (tmp_path / "s").exists()


def test_killed_prepare_leaves_no_store_and_reruns(tmp_path: Path) -> None:
    stdlib_tests = Path(sysconfig.get_paths()["stdlib"]) / "test"
    inputs = ["builtin:python-code"] + (["builtin:python-tests"] if stdlib_tests.is_dir() else [])
    out = tmp_path / "store"
    args = ["prepare", *inputs, "--out", str(out), "--num-shards", "4", "--no-progress"]
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    try:
        while not any(p.stat().st_size for p in tmp_path.glob(".store.partial-*/.spill/*.bin")):
            assert process.poll() is None, "prepare ended before it could be interrupted"
            assert time.monotonic() < deadline, "prepare never started writing"
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not out.exists()
    with pytest.raises(StoreError, match="no such store directory"):
        TokenStore(out)
    [partial] = _leftovers(tmp_path)  # hidden, never a store: no manifest in it.
    assert partial.startswith(".store.partial-")
    assert not (tmp_path / partial / "manifest.json").exists()

    rerun = _cli(*args, "--verify")
    assert rerun.returncode == 0, rerun.stderr
    store = TokenStore(out, verify=True)
    assert store.num_documents > 500 and store.num_shards == 4


def test_error_mid_prepare_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": \n{"text": "four"}\n')
    out = tmp_path / "store"
    with pytest.raises(PrepareError, match=f"{path} line 3 is not JSON"):
        prepare(PrepareOptions([str(path)], out, eval_fraction=0.5, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_corrupt_shards_are_detected(tmp_path: Path) -> None:
    texts = [f"document {i} " * 20 for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    store = _prepare([str(path)], tmp_path / "store", num_shards=2)

    truncated = store.shard_file(0)
    data = truncated.read_bytes()
    truncated.write_bytes(data[:-100])
    opened = TokenStore(store.path)  # an open reads the manifest: a shard is checked at first use
    with pytest.raises(StoreError, match=f"{truncated}: {len(data) - 100} bytes, the manifest"):
        opened.doc_offsets(0)
    truncated.write_bytes(data)
    assert TokenStore(store.path, verify=True).num_documents == 40

    flipped = store.shard_file(1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    TokenStore(store.path)  # the size still matches: opening the store checks sizes only,
    with pytest.raises(StoreError, match=f"{flipped}: "):  # the shard's first use more
        TokenStore(store.path, verify=True)
    result = _cli("verify-store", str(store.path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {flipped}: ")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def _bad_input_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (prepare arguments, text the one error line must contain)."""
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_text("fine")
    (tmp_path / "latin1" / "b.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "good.txt").write_text("good text")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("mine")
    good = str(tmp_path / "good.txt")
    return {
        "missing": (
            [str(tmp_path / "nope.txt")],
            f"input '{tmp_path / 'nope.txt'}' does not exist",
        ),
        "not utf-8": ([str(tmp_path / "latin1")], f"{tmp_path / 'latin1' / 'b.txt'} is not valid"),
        "empty corpus": ([str(tmp_path / "blank")], "no non-empty documents (1 empty); nothing"),
        "tokenizer": ([good, "--tokenizer", "wordpiece"], "unknown tokenizer 'wordpiece'"),
        "text field": ([str(tmp_path / "rows.jsonl")], "line 1 has no field 'text' (keys: body)"),
        "exists": ([good, "--out", str(tmp_path / "existing")], "output directory exists"),
    }


def test_bad_inputs_exit_2_with_one_error_line(tmp_path: Path) -> None:
    cases = _bad_input_cases(tmp_path)
    running = {}
    for name, (args, _) in cases.items():  # in parallel: each is a fresh interpreter.
        out = [] if "--out" in args else ["--out", str(tmp_path / f"out-{name}")]
        running[name] = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "prepare", *args, *out, "--no-progress"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        expected = cases[name][1]
        assert process.returncode == 2, (name, stderr)
        assert len(stderr.splitlines()) == 1, (name, stderr)
        assert stderr.startswith("error: ") and expected in stderr, (name, stderr)
        assert "Traceback" not in stderr and stdout == "", (name, stdout)
    assert _leftovers(tmp_path) == []
    assert not any(tmp_path.glob("out-*"))
    assert [p.name for p in (tmp_path / "existing").iterdir()] == ["keep.txt"]

    replaced = _cli("prepare", *cases["exists"][0], "--overwrite", "--no-progress")
    assert replaced.returncode == 0, replaced.stderr
    assert replaced.stdout.startswith(f"train: {tmp_path / 'existing'}: 1 document, ")
    assert _texts(TokenStore(tmp_path / "existing", verify=True)) == ["good text"]
    assert not (tmp_path / "existing" / "keep.txt").exists()
    assert _leftovers(tmp_path) == [] and not any(tmp_path.glob(".existing.retired-*"))


def test_a_store_of_one_document_and_one_shard_is_described_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "one.txt").write_text("x")  # one byte and the eod: 2 tokens
    out = tmp_path / "s"
    assert main(["prepare", str(tmp_path / "one.txt"), "--out", str(out), "--num-shards", "1",
                 "--no-progress"]) == 0  # fmt: skip
    assert capsys.readouterr().out == f"train: {out}: 1 document, 2 tokens, 1 shard, " + (
        "tokenizer bytes, uint16\n"
    )


class _CountedUnpickles:
    """A callable that, like a tokenizer, does work each time it is unpickled: here it takes a
    new tag, so the tags a worker process reports count its unpickles."""

    def __init__(self) -> None:
        self.tag = ""

    def __setstate__(self, state: dict) -> None:
        self.tag = os.urandom(8).hex()

    def __call__(self, item: int) -> tuple[int, str, int]:
        return os.getpid(), self.tag, item * 2


def test_worker_processes_receive_the_encoder_once_not_with_every_chunk() -> None:
    # The encoder sent with every task was unpickled per chunk of 32 documents, and a tokenizer
    # unpickles by loading its file again: 2 workers spent 4.6x the CPU of 1 with a 32k BPE.
    from pipeline.ingest.worker_pool import WorkerPool

    with WorkerPool(2, _CountedUnpickles()) as workers:
        results = list(workers.imap(range(400)))
    assert [doubled for _, _, doubled in results] == [2 * i for i in range(400)]
    tags: dict[int, set[str]] = {}
    for pid, tag, _ in results:
        tags.setdefault(pid, set()).add(tag)
    assert pid != os.getpid() and all(len(seen) == 1 for seen in tags.values()), tags


def test_stores_are_identical_across_worker_counts_and_batch_sizes(
    tmp_path: Path, hf_tokenizer_json: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Documents go to the tokenizer and to the workers in batches; many small batches, more
    # than the workers hold in flight, must make the store that one batch makes.
    import pipeline.ingest.prepare as prepare_module

    texts = [topics[t][: 50 + 37 * i] for i, t in enumerate(sorted(topics)[:120])] + [""]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = f"hf:{hf_tokenizer_json}"
    one_batch = _prepare([str(path)], tmp_path / "one", num_shards=3, tokenizer=spec)
    monkeypatch.setattr(prepare_module, "BATCH_CHARACTERS", 2000)
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        _prepare([str(path)], out, num_shards=3, tokenizer=spec, workers=workers)
        assert _files(out) == _files(tmp_path / "one"), workers
    _check_tokenizer_store(one_batch, spec, [t for t in texts if t])
    assert one_batch.manifest["created"]["empty_documents_dropped"] == 1


def _refuse_in_this_process(*args: object, **kwargs: object) -> None:
    raise AssertionError("with workers, the shards are written in the worker processes")


def test_shards_written_by_the_workers_match_one_process_with_eval_ids_and_masks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --workers N >= 2 the pool that tokenized also sorts and writes the shards (train
    # and eval, with the loss mask and the ids files), in parallel: the stores must be those
    # one process writes.
    import pipeline.ingest.prepare as prepare_module
    from pipeline.ingest.chat import RowFields

    rows = [{"id": f"row-{i}", "prompt": f"question {i}? " * (i % 4 + 1), "completion": f"a{i}"}
            for i in range(90)]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = {"num_shards": 3, "eval_fraction": 0.3, "id_field": "id",
               "fields": RowFields("prompt-completion")}  # fmt: skip
    store = _prepare([str(path)], tmp_path / "w1", **options)
    assert store.manifest["created"]["document_ids"] == "id"
    assert any(name.endswith(".untrained.npy") for name in _files(tmp_path / "w1"))
    monkeypatch.setattr(prepare_module, "write_shard", _refuse_in_this_process)
    for workers in (2, 3):
        out = tmp_path / f"w{workers}"
        _prepare([str(path)], out, workers=workers, **options)
        for suffix in ("", "-eval"):
            assert _files(out.with_name(out.name + suffix)) == _files(tmp_path / f"w1{suffix}"), (
                workers,
                suffix,
            )


def test_a_failed_shard_write_in_a_worker_is_the_error_one_process_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OSError in a pool worker reaches the main process without its file name (pickling
    # drops it): a shard write that fails must name the store, the shard and the file, as
    # with one process, and leave nothing behind.
    import pipeline.ingest.prepare as prepare_module

    spill_and_lose_one = prepare_module._tokenize_and_spill

    def lose_a_spill_file(*args: object) -> object:
        spills, empty, bad = spill_and_lose_one(*args)
        spills["train"][1].unlink()
        return spills, empty, bad

    monkeypatch.setattr(prepare_module, "_tokenize_and_spill", lose_a_spill_file)
    _write_corpus(tmp_path / "corpus", 30)
    messages = set()
    for workers in (1, 2):
        out = tmp_path / "out"
        with pytest.raises(PrepareError) as raised:
            _prepare([str(tmp_path / "corpus")], out, num_shards=3, workers=workers)
        message = str(raised.value)
        assert message.startswith(f"{out}: writing shard-00001-of-00003 failed: [Errno 2]")
        assert message.endswith("/.spill/00001.bin'"), message
        messages.add(message.split(" '")[0])  # the staging directory's name differs by run
        assert not out.exists() and _leftovers(tmp_path) == []
    assert len(messages) == 1


def _threads_started_by_encoding(spec: str) -> int:
    """In a pool worker: the threads this process gained while the tokenizer encoded a batch."""
    tokenizer = load_tokenizer(spec)
    before = len(os.listdir("/proc/self/task"))
    tokenizer.encode_batch([f"text number {i} " * 50 for i in range(64)])
    return len(os.listdir("/proc/self/task")) - before


def test_worker_processes_share_the_cpus_among_their_tokenizers_threads(
    hf_tokenizer_json: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each worker's encode_batch started a thread per CPU: with 2 workers on 2 CPUs, 4 threads
    # of tokenizing where 2 fit. A worker now gets its share of the CPUs (one thread: it
    # starts none, it encodes on its own).
    from pipeline.ingest.worker_pool import WorkerPool, tokenizer_threads

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    workers = max(2, len(os.sched_getaffinity(0)))  # one tokenizer thread each
    assert tokenizer_threads(workers) == 1
    with WorkerPool(workers, _threads_started_by_encoding) as pool:
        started = list(pool.imap([f"hf:{hf_tokenizer_json}"] * workers))
    assert started == [0] * workers
    assert tokenizer_threads(1) == len(os.sched_getaffinity(0))


def test_a_damaged_parquet_row_group_is_one_line(tmp_path, capsys):
    """A file whose footer reads but whose third row group's pages are overwritten: prepare
    stops with one line naming the file, nothing stored."""
    table = pa.table({"text": [f"document number {i} " * 20 for i in range(2000)]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=500, compression="NONE")
    offset = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    out = tmp_path / "store"
    assert main(["prepare", str(path), "--text-field", "text", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: cannot read rows from row "), err
    assert err.rstrip().endswith("the file is damaged, write it again") and err.count("\n") == 1
    assert not (out / "manifest.json").exists()
