"""Document ids: `prepare --id-field/--record-ids` records them beside the shards, checked;
`inspect` shows a row's ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import PrepareError, StoreError
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.store.doc_ids import locate
from pipeline.store.token_store import TokenStore

REPO = Path(__file__).resolve().parents[1]


def write_id_corpus(root: Path) -> tuple[list[str], dict[str, str]]:
    """A JSONL file (string and integer ids), a Parquet file (string ids) and a text file;
    returns the inputs and each document's text -> the id it must be recorded with."""
    root.mkdir(parents=True, exist_ok=True)
    jsonl = root / "lines.jsonl"
    rows = [{"text": f"line {i} of the file", "doc": f"L-{i}" if i % 2 else i} for i in range(7)]
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    parquet = root / "rows.parquet"
    texts = [f"parquet row {i}" for i in range(5)]
    pq.write_table(pa.table({"text": texts, "doc": [f"P/{i}" for i in range(5)]}), parquet)
    text = root / "note.txt"
    text.write_text("a plain text file")
    expected = {row["text"]: str(row["doc"]) for row in rows}
    expected.update({t: f"P/{i}" for i, t in enumerate(texts)})
    expected["a plain text file"] = "note.txt"  # no field: its key is its id
    return [str(jsonl), str(parquet), str(text)], expected


def _recorded(store: TokenStore) -> dict[str, str]:
    """Each document's text -> its recorded id."""
    out = {}
    for shard in range(store.num_shards):
        ids = store.document_ids(shard)
        for index, document_id in enumerate(ids):
            text = bytes(store.document(shard, index)[:-1].tolist()).decode()
            out[text] = document_id
    return out


def test_id_field_from_jsonl_and_parquet_and_keys_of_other_inputs(tmp_path: Path) -> None:
    inputs, expected = write_id_corpus(tmp_path / "in")
    out = prepare(
        PrepareOptions(inputs, tmp_path / "s", num_shards=3, id_field="doc", progress=False)
    )
    store = TokenStore(out["train"], verify=True)
    assert store.has_ids and _recorded(store) == expected
    assert store.manifest["created"]["document_ids"] == "doc"
    found = locate(store.path, store.manifest, ["P/3", "0", "note.txt", "absent"])
    assert set(found) == {"P/3", "0", "note.txt"}
    for document_id, (shard, index) in found.items():
        assert store.document_ids(shard)[index] == document_id


def test_record_ids_records_keys_and_a_store_without_ids_is_unchanged(tmp_path: Path) -> None:
    inputs, _ = write_id_corpus(tmp_path / "in")
    plain = prepare(PrepareOptions(inputs, tmp_path / "plain", num_shards=2, progress=False))
    keyed = prepare(
        PrepareOptions(inputs, tmp_path / "keyed", num_shards=2, record_ids=True, progress=False)
    )
    store = TokenStore(keyed["train"])
    ids = sorted(i for s in range(2) for i in store.document_ids(s))
    assert ids == sorted(
        [f"lines.jsonl:{n}" for n in range(1, 8)]
        + [f"rows.parquet:row {n}" for n in range(5)]
        + ["note.txt"]
    )
    assert not any(p.name.endswith("ids.jsonl") for p in plain["train"].iterdir())
    manifest = json.loads((plain["train"] / "manifest.json").read_text())
    assert "document_ids" not in manifest["created"]
    assert all("ids" not in shard for shard in manifest["shards"])
    with pytest.raises(StoreError, match="records no document ids"):
        TokenStore(plain["train"]).document_ids(0)
    # the ids add files, never change the shards' bytes
    for name in ("shard-00000-of-00002.array_record", "shard-00001-of-00002.flat.bin"):
        assert (plain["train"] / name).read_bytes() == (keyed["train"] / name).read_bytes()


def test_a_duplicate_id_is_refused_naming_it(tmp_path: Path) -> None:
    jsonl = tmp_path / "dup.jsonl"
    rows = [{"text": f"text {i}", "id": "same" if i in (2, 5) else f"x{i}"} for i in range(8)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PrepareError, match="document id 'same' names two documents"):
        prepare(PrepareOptions([str(jsonl)], tmp_path / "s", num_shards=3, id_field="id",
                               progress=False))  # fmt: skip
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "t"}, r"dup.jsonl line 2 has no id field 'id'"),
        ({"text": "t", "id": ""}, r"dup.jsonl line 2: id field 'id' is an empty string"),
        ({"text": "t", "id": [1]}, r"dup.jsonl line 2: id field 'id' is a list"),
    ],
)
def test_a_bad_id_is_one_line_naming_file_and_line(tmp_path: Path, row: dict, message: str) -> None:
    jsonl = tmp_path / "dup.jsonl"
    jsonl.write_text(json.dumps({"text": "ok", "id": 1}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(PrepareError, match=message):
        prepare(PrepareOptions([str(jsonl)], tmp_path / "s", id_field="id", progress=False))


def test_id_field_without_a_jsonl_or_parquet_input_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(PrepareError, match="--id-field doc: no input is a JSONL or Parquet"):
        prepare(PrepareOptions([str(tmp_path / "a.txt")], tmp_path / "s", id_field="doc"))
    parquet = tmp_path / "r.parquet"
    pq.write_table(pa.table({"text": ["a"]}), parquet)
    with pytest.raises(PrepareError, match=r"r\.parquet has no column 'doc' for --id-field"):
        prepare(PrepareOptions([str(parquet)], tmp_path / "s", id_field="doc", progress=False))


def test_an_altered_id_file_is_refused_where_it_is_read(tmp_path: Path) -> None:
    inputs, _ = write_id_corpus(tmp_path / "in")
    out = prepare(PrepareOptions(inputs, tmp_path / "s", num_shards=1, id_field="doc",
                                 progress=False))["train"]  # fmt: skip
    ids = out / "shard-00000-of-00001.ids.jsonl"
    ids.write_bytes(ids.read_bytes().replace(b'"P/3"', b'"P/9"'))
    store = TokenStore(out)
    with pytest.raises(StoreError, match=r"ids\.jsonl: content checksum does not match"):
        store.document_ids(0)
    with pytest.raises(StoreError, match=r"ids\.jsonl: content checksum does not match"):
        locate(out, store.manifest, ["P/9"])
    with pytest.raises(StoreError, match=r"ids\.jsonl: content checksum"):
        TokenStore(out, verify=True)


def test_inspect_shows_a_rows_document_ids(tmp_path: Path) -> None:
    inputs, _ = write_id_corpus(tmp_path / "in")
    prepare(PrepareOptions(inputs, tmp_path / "s", num_shards=2, id_field="doc", progress=False))
    config = tmp_path / "c.yaml"
    for packing in ("concat", "best_fit"):
        config.write_text(
            "seed: 1\nseq_len: 64\nglobal_batch_size: 2\n"
            f"sources: {{a: {{path: s, packing: {packing}}}}}\nmix: {{a: 1}}\n"
        )
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", "inspect", str(config), "--step", "0"],
            capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
        )  # fmt: skip
        lines = [line.strip() for line in result.stdout.splitlines()]
        shown = [line for line in lines if line.startswith(("id ", "ids "))]
        assert shown, result.stdout
        for line in shown:  # every id shown is one the store recorded
            for document_id in line.split(" ", 1)[1].split(", "):
                assert document_id.strip("'") in {"note.txt", *(f"P/{i}" for i in range(5)),
                                                  *(f"L-{i}" for i in range(7)),
                                                  *map(str, range(7))}  # fmt: skip
