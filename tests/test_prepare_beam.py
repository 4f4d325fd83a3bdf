"""`prepare --runner beam` on Beam's DirectRunner writes the local runner's store, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import PrepareError, TokenizerError
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.ingest.prepare_beam import (
    pipeline_flags,
    prepare_beam,
    resolve_runner,
    units_of_work,
)
from pipeline.store.token_store import TokenStore
from tests.test_corpora import TinyText
from tests.test_doc_ids import write_id_corpus
from tests.test_tokenizers import _train_sentencepiece

REPO = Path(__file__).resolve().parents[1]


def _files(store: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(store)): path.read_bytes()
        for path in sorted(store.rglob("*"))
        if path.is_file()
    }


def _assert_same_stores(local: dict[str, Path], beam: dict[str, Path]) -> None:
    assert local.keys() == beam.keys()
    for split in local:
        expected, got = _files(local[split]), _files(beam[split])
        assert sorted(got) == sorted(expected)
        for name in expected:
            assert got[name] == expected[name], f"{split}: {name} differs"
        TokenStore(beam[split], verify=True)


def _both(tmp_path: Path, inputs: list[str], workers: int = 1, **kwargs) -> None:
    local = prepare(PrepareOptions(inputs, tmp_path / "local", progress=False, **kwargs))
    beam = prepare_beam(PrepareOptions(inputs, tmp_path / "beam", workers=workers, **kwargs))
    _assert_same_stores(local, beam)


def _no_leftovers(parent: Path) -> list[str]:
    return sorted(name for name in os.listdir(parent) if ".partial-" in name)


@pytest.fixture
def mixed_corpus(tmp_path: Path) -> list[str]:
    return write_mixed_corpus(tmp_path)


def write_mixed_corpus(tmp_path: Path) -> list[str]:
    """A directory of text files, a JSONL file with an empty text, and a Parquet file."""
    docs = tmp_path / "in" / "docs"
    (docs / "sub").mkdir(parents=True)
    for i in range(6):
        (docs / ("sub" if i % 2 else ".") / f"f{i}.txt").write_text(f"file {i} " * (i + 1))
    lines = [{"text": f"line {i} ü"} for i in range(9)] + [{"text": ""}]
    jsonl = tmp_path / "in" / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    parquet = tmp_path / "in" / "rows.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(11)]}), parquet)
    return [str(docs), str(jsonl), str(parquet)]


def test_python_docs_with_eval_split(tmp_path: Path) -> None:
    _both(tmp_path, ["builtin:python-docs"], eval_fraction=0.2, num_shards=5, seed=3)
    assert (tmp_path / "beam-eval" / "manifest.json").is_file()


def test_python_code(tmp_path: Path) -> None:
    _both(tmp_path, ["builtin:python-code"], num_shards=4)


def test_a_sentencepiece_store_is_the_local_runners(tmp_path: Path, mixed_corpus) -> None:
    # both runners encode batches of documents (encode_batch, on native threads)
    model = _train_sentencepiece(tmp_path, "sp")
    _both(tmp_path, mixed_corpus, num_shards=3, tokenizer=f"sentencepiece:{model}")


def test_files_jsonl_parquet_with_empty_shards_and_documents(
    tmp_path: Path, mixed_corpus: list[str]
) -> None:
    # 64 shards for 26 documents: most shards are empty and must still exist, identically.
    _both(tmp_path, mixed_corpus, num_shards=64, eval_fraction=0.3)
    manifest = json.loads((tmp_path / "beam" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 64
    assert any(shard["documents"] == 0 for shard in manifest["shards"])
    empty = manifest["created"]["empty_documents_dropped"]
    eval_empty = json.loads((tmp_path / "beam-eval" / "manifest.json").read_text())["created"]
    assert empty + eval_empty["empty_documents_dropped"] == 1


def test_document_ids_from_jsonl_parquet_and_keys(tmp_path: Path) -> None:
    inputs, _ = write_id_corpus(tmp_path / "in")
    _both(tmp_path, inputs, num_shards=4, id_field="doc", eval_fraction=0.3)
    assert (tmp_path / "beam" / "shard-00003-of-00004.ids.jsonl").is_file()


def test_a_duplicate_id_is_refused_by_beam_too(tmp_path: Path) -> None:
    jsonl = tmp_path / "dup.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"t{i}", "id": i % 5}) + "\n" for i in range(6)))
    with pytest.raises(PrepareError, match="document id '0' names two documents"):
        prepare_beam(PrepareOptions([str(jsonl)], tmp_path / "beam", num_shards=2, id_field="id"))
    assert not (tmp_path / "beam").exists() and _no_leftovers(tmp_path) == []


def test_tfds_dataset(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "tfds")
    TinyText(data_dir=data_dir, file_format="array_record").download_and_prepare()
    _both(tmp_path, ["tfds:tiny_text:train"], num_shards=3, tfds_data_dir=data_dir)


def test_two_worker_processes_write_the_same_store(tmp_path: Path, mixed_corpus: list[str]) -> None:
    inputs = [*mixed_corpus, "builtin:python-docs"]
    _both(tmp_path, inputs, workers=2, num_shards=6, eval_fraction=0.1)
    one = prepare_beam(PrepareOptions(inputs, tmp_path / "one", num_shards=6, eval_fraction=0.1))
    _assert_same_stores(
        {k: tmp_path / f"beam{s}" for k, s in [("train", ""), ("eval", "-eval")]}, one
    )


def test_failed_pipeline_leaves_no_store_and_no_staging(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\nnot json\n')
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"bad.jsonl line 3 is not JSON"):
        prepare_beam(PrepareOptions([str(bad), "builtin:python-docs"], out, eval_fraction=0.5))
    assert not out.exists() and not (tmp_path / "out-eval").exists()
    assert _no_leftovers(tmp_path) == []


def test_bad_input_is_refused_before_the_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match="does not exist"):
        prepare_beam(PrepareOptions([str(tmp_path / "missing")], out))
    with pytest.raises(PrepareError, match="unknown builtin corpus"):
        prepare_beam(PrepareOptions(["builtin:nope"], out))
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        prepare_beam(PrepareOptions(["builtin:python-docs"], out, tokenizer="nope:x"))
    out.mkdir()
    with pytest.raises(PrepareError, match="output directory exists"):
        prepare_beam(PrepareOptions(["builtin:python-docs"], out))
    assert os.listdir(out) == [] and _no_leftovers(tmp_path) == []


def test_overwrite_replaces_a_store(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_beam(PrepareOptions(["builtin:python-docs"], out, num_shards=2))
    prepare_beam(PrepareOptions(["builtin:python-docs"], out, num_shards=3, overwrite=True))
    assert len(TokenStore(out, verify=True).shard_tokens) == 3
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_units_of_work_and_flags(mixed_corpus: list[str]) -> None:
    from pipeline.ingest.corpora import resolve_inputs

    units = units_of_work(resolve_inputs([*mixed_corpus, "builtin:python-docs"]))
    assert [len(u.files) for u in units] == [1] * 8 + [0]
    direct = [f"--runner={FN_API_RUNNER}"]
    assert pipeline_flags(1)[1:] == [
        "--direct_num_workers=1", "--direct_running_mode=in_memory", *direct
    ]  # fmt: skip
    assert pipeline_flags(1, ["--runner=directrunner"])[-1] == direct[0]
    flags = pipeline_flags(3, ["--runner=DataflowRunner"])
    assert "--direct_running_mode=multi_processing" in flags
    assert flags[-1] == "--runner=apache_beam.runners.dataflow.dataflow_runner.DataflowRunner"


FN_API_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("DirectRunner", FN_API_RUNNER),  # Beam's Python direct runner, never Prism's download
        ("direct", FN_API_RUNNER),
        ("PrismRunner", "apache_beam.runners.portability.prism_runner.PrismRunner"),  # by name
        ("DaskRunner", DASK_RUNNER),  # Beam knows it only by its module path
        ("dask", DASK_RUNNER),
        (DASK_RUNNER, DASK_RUNNER),
    ],
)
def test_runner_names_resolve_to_beams_runner_classes(name: str, path: str) -> None:
    assert resolve_runner(name) == path


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Nope", r"^unknown Beam runner 'Nope'; give one of .*DaskRunner, .*DirectRunner, "),
        ("nosuch.module.Runner", r"^Beam runner 'nosuch.module.Runner' cannot be imported"),
        ("apache_beam.runners.Nope", r"apache_beam.runners has no runner class 'Nope'$"),
        (".Foo", r"^Beam runner '.Foo' cannot be imported from  \("),  # an empty module name
        ("..x.Foo", r"^Beam runner '..x.Foo' cannot be imported from ..x \("),  # relative
    ],
)
def test_an_unknown_runner_is_refused_in_one_line(name: str, message: str) -> None:
    with pytest.raises(PrepareError, match=message) as refused:
        resolve_runner(name)
    assert "\n" not in str(refused.value)


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = (
        f"{prelude}import sys; from pipeline.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, check=False
    )


def test_cli_beam_runner_with_beam_options(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = ["prepare", "builtin:python-docs", "--out", str(out), "--no-progress"]
    run = _cli(*args, "--runner", "beam", "--verify", "--", "--direct_num_workers=1")
    assert run.returncode == 0, run.stderr
    assert "train: " in run.stdout and "79 documents" in run.stdout
    local = prepare(PrepareOptions(["builtin:python-docs"], tmp_path / "local", progress=False))
    _assert_same_stores(local, {"train": out})
    refused = _cli(*args[:3], str(tmp_path / "x"), "--", "--direct_num_workers=1")
    assert refused.returncode == 2 and "add --runner beam" in refused.stderr


def test_cli_runs_the_direct_runner_it_names_without_beams_noise(tmp_path: Path) -> None:
    # Beam 2.68+ made its DirectRunner try PrismRunner first: a download from GitHub that fails
    # offline, a fallback, and with the type-hint lines 33 lines on stderr for this command.
    out = tmp_path / "cli"
    run = _cli("prepare", "builtin:python-docs", "--out", str(out), "--no-progress", "--runner",
               "beam")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == ["prepare: Beam pipeline on FnApiRunner"]
    local = prepare(PrepareOptions(["builtin:python-docs"], tmp_path / "local", progress=False))
    _assert_same_stores(local, {"train": out})


def test_cli_refuses_an_unknown_runner_or_refused_options_in_one_line(tmp_path: Path) -> None:
    args = ["prepare", "builtin:python-docs", "--out", str(tmp_path / "x"), "--runner", "beam"]
    unknown = _cli(*args, "--", "--runner=NoSuchRunner")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.splitlines() == [unknown.stderr.splitlines()[-1]]
    assert unknown.stderr.startswith("error: unknown Beam runner 'NoSuchRunner'; give one of")
    dataflow = _cli(*args, "--", "--runner=DataflowRunner")  # no --project, --region, ...
    assert dataflow.returncode == 2 and "Traceback" not in dataflow.stderr
    assert dataflow.stderr.splitlines()[-1].startswith("error: Beam refused the options after --")
    assert "Missing required option: project." in dataflow.stderr
    assert not (tmp_path / "x").exists() and _no_leftovers(tmp_path) == []


def test_cli_without_beam_says_how_to_install(tmp_path: Path) -> None:
    # Run as if apache_beam were not installed: an import of it fails.
    args = ["prepare", "builtin:python-docs", "--out", str(tmp_path / "x"), "--runner", "beam"]
    run = _cli(*args, prelude="import sys; sys.modules['apache_beam'] = None; ")
    assert run.returncode == 2
    assert "pip install 'pipeline[beam]'" in run.stderr
    assert not (tmp_path / "x").exists()
