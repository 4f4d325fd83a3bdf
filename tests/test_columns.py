"""Parquet/Arrow token columns read in place (docs/in-place-corpora.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, StoreError
from pipeline.in_place import default_index_dir
from pipeline.plan.ledger import Ledger
from pipeline.plan.rows import host_rows
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from pipeline.store.columns import ColumnStore
from pipeline.store.columns_index import build_columns_index
from pipeline.store.formats import open_store
from pipeline.store.identity import MANIFEST_CHECKSUM, manifest_digest
from pipeline.store.megatron_format import write_megatron
from pipeline.store.megatron_index import build_index
from tests.test_megatron import config_for, plan_of, run_cli


def positional_files(lengths: list[list[int]]) -> tuple[list[list[list[int]]], set[int]]:
    """Documents per file whose ids are their positions in the natural stream (every id
    distinct), and the positions where documents start."""
    files, at, starts = [], 0, set()
    for file in lengths:
        docs = []
        for length in file:
            starts.add(at)
            docs.append(list(range(at, at + length)))
            at += length
        files.append(docs)
    return files, starts


def write_parquet(directory: Path, files: list, row_group_size: int = 5, **extra) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for number, docs in enumerate(files):
        table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32())), **extra})
        pq.write_table(
            table, directory / f"part-{number:05d}.parquet", row_group_size=row_group_size
        )


def write_saved_dataset(directory: Path, files: list, batch: int = 4) -> None:
    """Arrow IPC streams in `datasets.save_to_disk`'s layout (data-0000N-of-0000M.arrow and
    its JSON files), written with pyarrow (`datasets` is not a dependency)."""
    directory.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("input_ids", pa.list_(pa.int64()))])
    names = [f"data-{number:05d}-of-{len(files):05d}.arrow" for number in range(len(files))]
    for name, docs in zip(names, files):
        name = directory / name
        with pa.OSFile(str(name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for at in range(0, len(docs), batch):
                writer.write_batch(
                    pa.record_batch([pa.array(docs[at : at + batch], pa.list_(pa.int64()))], schema)
                )
    state = {"_data_files": [{"filename": name} for name in names]}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text("{}")


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=12), min_size=1, max_size=4),
    arrow=st.booleans(),
    lanes=st.sampled_from([1, 2]),
)
def test_every_token_is_an_input_once_per_epoch_and_positions_restart_at_rows(
    tmp_path_factory, lengths, arrow, lanes
):
    tmp = tmp_path_factory.mktemp("cols")
    files, starts = positional_files(lengths)
    total = sum(map(sum, lengths))
    assume(total >= lanes * 10)
    (write_saved_dataset if arrow else write_parquet)(tmp / "corpus", files)
    build_columns_index(tmp / "corpus")
    raw = config_for(tmp, {"c": {"path": "corpus", "format": "parquet"}}, lanes=lanes)
    raw["global_batch_size"] = 2 * lanes
    plan = plan_of(tmp, raw)
    per_lane = plan.segment_plan(0).layouts["c"].windows_per_lane
    seen = np.zeros(total, dtype=np.int64)
    for step in range(-(-per_lane // 2)):
        draws = plan.draws(step)
        batch = plan.read(draws)
        for r in np.flatnonzero(draws.epoch == 0).tolist():
            ids = np.append(batch["inputs"][r], batch["targets"][r][-1])
            segment = position = 0
            for j, token in enumerate(ids.tolist()):
                if j == 0 or token in starts:
                    segment, position = segment + 1, 0
                if j < 8:
                    assert batch["inputs_segmentation"][r][j] == segment
                    assert batch["inputs_position"][r][j] == position
                position += 1
            seen[batch["inputs"][r]] += 1
    assert seen.max() == 1 and seen.sum() == per_lane * lanes * 8


def test_hosts_resume_mixing_with_megatron_and_a_prepared_style_store(tmp_path):
    files, _ = positional_files([[12, 30, 7, 19] * 5, [25, 3, 40] * 6])
    write_parquet(tmp_path / "corpus", files)
    build_columns_index(tmp_path / "corpus")
    write_megatron(tmp_path / "meg", [[[5, 6, 7, 0]], [[8, 9, 0]]] * 100)
    build_index(tmp_path / "meg")
    sources = {
        "c": {"path": "corpus", "format": "parquet", "column": "input_ids"},
        "m": {"path": "meg", "format": "megatron"},
    }
    plan = plan_of(tmp_path, config_for(tmp_path, sources, shared_vocabulary=True))
    resumed = Plan(Ledger.from_json(json.loads(json.dumps(plan.ledger.to_json()))))
    for step in (0, 5, 33):
        whole = plan.batch(step)
        halves = [plan.batch(step, host_rows(8, i, 2)) for i in range(2)]
        for name, value in whole.items():
            assert np.array_equal(np.concatenate([h[name] for h in halves]), value)
            assert np.array_equal(resumed.batch(step)[name], value)
    report = audit(plan, 0, 60, process_counts=[1, 2])
    assert report.ok, report.violations
    assert report.epochs_completed["m"] >= 1


def test_a_changed_file_is_refused_at_open_or_at_its_first_read(tmp_path):
    docs = [[7] * 3000 for _ in range(60)]
    docs[30] = [7] * 1000 + [123456789] + [7] * 1999  # a marker deep in the middle
    write_saved_dataset(tmp_path / "corpus", [docs], batch=10)
    index = build_columns_index(tmp_path / "corpus")
    arrow = next((tmp_path / "corpus").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    at = data.find(np.int64(123456789).tobytes())
    assert 5 * 65536 < at < len(data) - 5 * 65536  # not in a sampled block
    data[at] ^= 1
    arrow.write_bytes(bytes(data))
    store = ColumnStore(index)  # the samples are unchanged
    with pytest.raises(StoreError, match=r"chunk 3 .* does not match its size and checksum"):
        store.read_shard_tokens(0, 0, 180_000)
    with pytest.raises(StoreError, match="its content is not as indexed"):
        store.verify()
    arrow.write_bytes(bytes(data[:-8]))
    with pytest.raises(StoreError, match=r"data-00000-of-00001\.arrow: the dataset changed"):
        ColumnStore(index)


def test_a_file_added_or_removed_after_indexing_is_refused_by_name(tmp_path):
    files, _ = positional_files([[10, 20, 30] * 4, [5, 6] * 9, [7] * 5])
    write_parquet(tmp_path / "all", files)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    parts = [f"part-0000{n}.parquet" for n in range(3)]
    for name in parts[:2]:
        (corpus / name).write_bytes((tmp_path / "all" / name).read_bytes())
    build_columns_index(corpus)
    source = {"c": {"path": "corpus", "format": "parquet"}}
    plan_of(tmp_path, config_for(tmp_path, source))
    (corpus / parts[2]).write_bytes((tmp_path / "all" / parts[2]).read_bytes())
    with pytest.raises(ConfigError, match=r"sources\.c\.path: .*02\.parquet: not in the index"):
        plan_of(tmp_path, config_for(tmp_path, source))
    (corpus / parts[2]).unlink()
    (corpus / parts[1]).unlink()
    with pytest.raises(ConfigError, match=r"sources\.c\.path: .*01\.parquet: indexed in"):
        plan_of(tmp_path, config_for(tmp_path, source))


def test_an_index_of_other_files_is_refused(tmp_path):
    files, _ = positional_files([[10, 20, 30] * 4])
    write_parquet(tmp_path / "corpus", files)
    write_parquet(tmp_path / "other", files)
    build_columns_index(tmp_path / "other", tmp_path / "ix")
    source = {"c": {"path": "corpus", "format": "parquet", "index": "ix"}}
    with pytest.raises(ConfigError, match=r"corpus/part-00000\.parquet: not in the index"):
        plan_of(tmp_path, config_for(tmp_path, source))


def test_a_saved_dataset_is_the_files_its_state_json_lists(tmp_path):
    """`datasets.save_to_disk` over an earlier save leaves the earlier shards in place;
    `load_from_disk` reads only the files `state.json` lists, and so does the index."""
    import datasets  # the dev extra's: the layout written by its own code

    rows = [[k, k + 1, k + 2] for k in range(0, 120, 3)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "d", num_shards=4)
    kept = datasets.Dataset.from_dict({"input_ids": rows[:10]})
    kept.save_to_disk(tmp_path / "d", num_shards=2)
    assert len(list((tmp_path / "d").glob("*.arrow"))) == 6
    store = ColumnStore(build_columns_index(tmp_path / "d"))
    assert store.num_shards == 2 and store.num_documents == 10
    assert store.read_tokens(0, 30).tokens.tolist() == [t for row in rows[:10] for t in row]
    (tmp_path / "d" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(StoreError, match=r"data-00001-of-00002\.arrow: listed in .*state\.json"):
        build_columns_index(tmp_path / "d", tmp_path / "again")


def test_the_files_are_left_as_they_were(tmp_path):
    files, _ = positional_files([[10, 20, 30] * 4, [5, 6] * 9])
    write_parquet(tmp_path / "corpus", files)
    parts = sorted((tmp_path / "corpus").iterdir())
    before = [(p.read_bytes(), os.stat(p).st_mtime_ns) for p in parts]
    build_columns_index(tmp_path / "corpus")
    plan = plan_of(tmp_path, config_for(tmp_path, {"c": {"path": "corpus", "format": "parquet"}}))
    for step in range(20):
        plan.batch(step)
    open_store(default_index_dir(tmp_path / "corpus"), verify=True)
    assert [(p.read_bytes(), os.stat(p).st_mtime_ns) for p in parts] == before
    assert sorted((tmp_path / "corpus").iterdir()) == parts


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"text": ["a"]}), r"no column 'input_ids' \(columns: text\)"),
        (pa.table({"input_ids": [1, 2]}), "is int64, not a list of integers"),
        (pa.table({"input_ids": pa.array([[1], None], pa.list_(pa.int32()))}), "has nulls"),
        (pa.table({"input_ids": pa.array([[1, -2]], pa.list_(pa.int32()))}), "not all whole ids"),
    ],
)
def test_a_column_that_is_not_token_ids_is_one_line(tmp_path, table, message):
    (tmp_path / "corpus").mkdir()
    pq.write_table(table, tmp_path / "corpus" / "a.parquet")
    with pytest.raises(StoreError, match=message):
        build_columns_index(tmp_path / "corpus")


def test_an_arrow_file_without_record_batches_is_an_empty_shard(tmp_path):
    files, _ = positional_files([[], [4, 5, 6] * 3])
    write_saved_dataset(tmp_path / "saved", files)
    store = ColumnStore(build_columns_index(tmp_path / "saved"))
    assert store.shard_tokens.tolist() == [0, 45] and store.num_documents == 9


def test_config_keys_of_a_parquet_source(tmp_path):
    files, _ = positional_files([[10, 20, 30] * 4])
    write_parquet(tmp_path / "corpus", files, labels=pa.array([[1]] * 12))
    with pytest.raises(ConfigError, match=r"sources\.c\.index: a glob's index directory"):
        parse_config(
            config_for(tmp_path, {"c": {"path": "corpus/*.parquet", "format": "parquet"}}),
            "c",
            tmp_path,
        )
    build_columns_index(str(tmp_path / "corpus" / "*.parquet"), tmp_path / "ix")
    glob = {"path": "corpus/*.parquet", "format": "parquet", "index": "ix"}
    assert plan_of(tmp_path, config_for(tmp_path, {"c": glob})).batch(0)["inputs"].shape == (8, 8)
    config = parse_config(config_for(tmp_path, {"c": glob}), "c", tmp_path)
    again = parse_config(config_for(tmp_path, {"c": config.source("c").to_json()}), "c", tmp_path)
    assert again.source("c") == config.source("c")
    with pytest.raises(ConfigError, match=r"sources\.c\.path: .*indexes column 'input_ids'"):
        plan_of(tmp_path, config_for(tmp_path, {"c": {**glob, "column": "labels"}}))
    with pytest.raises(ConfigError, match=r"sources\.c\.column: only a format: parquet"):
        parse_config(config_for(tmp_path, {"c": {"path": "x", "column": "y"}}), "c", tmp_path)


def test_pipeline_index_format_parquet_on_the_command_line(tmp_path):
    files, _ = positional_files([[4, 5, 6] * 3])
    write_saved_dataset(tmp_path / "saved", files)
    done = run_cli("index", str(tmp_path / "saved"), "--format", "parquet")
    assert done.returncode == 0, done.stderr
    assert "9 documents" in done.stdout and "eod id: none" in done.stdout
    glob = run_cli("index", str(tmp_path / "saved" / "*.arrow"), "--format", "parquet")
    assert glob.returncode == 2 and "needs a directory: --out DIR" in glob.stderr
    wrong = run_cli("index", str(tmp_path / "saved"), "--column", "ids")
    assert wrong.returncode == 2 and "--column, --labels and --loss-mask are for" in wrong.stderr


def test_pipeline_index_loss_mask_on_the_command_line(tmp_path):
    files, _ = positional_files([[4, 5, 6] * 3])
    trained = [[np.arange(len(doc)) > 0 for doc in docs] for docs in files]
    write_columns(tmp_path / "c", loss_columns(files, trained, pa.bool_()), chunk=4)
    done = run_cli("index", str(tmp_path / "c"), "--format", "parquet", "--loss-mask", "mask")
    assert done.returncode == 0, done.stderr
    assert "9 documents" in done.stdout and "with a loss mask" in done.stdout
    assert ColumnStore(default_index_dir(tmp_path / "c")).trained(0, 0, 4).tolist() == [
        False, True, True, True
    ]  # fmt: skip
    refusals = {
        "--labels labels and --loss-mask mask: give one": ["mask", "--labels", "labels"],
        "0.parquet: chunk 0, row 0: 'labels' holds -100, not 0 or 1": ["labels"],
        "--column, --labels and --loss-mask are for --format parquet": [
            "mask",
            "--format",
            "megatron",
        ],
    }
    for message, more in refusals.items():
        refused = run_cli("index", str(tmp_path / "c"), "--format", "parquet", "--loss-mask", *more)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert refused.stderr.startswith("error: ") and message in refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr


INT8 = pa.int8()
LOSS_COLUMNS = {"labels": "labels", "loss_mask": "mask"}  # build_columns_index's keyword: column


def loss_columns(files: list, trained: list, mask_type: pa.DataType = INT8) -> list[dict]:
    """Per file, its ids and the same loss twice: as labels (-100: no loss) and as a mask
    column (0: no loss), from `trained` (per document, a bool per token)."""
    return [
        {
            "input_ids": pa.array(docs, pa.list_(pa.int32())),
            "labels": pa.array(
                [np.where(bits, doc, -100).tolist() for doc, bits in zip(docs, marks)],
                pa.list_(pa.int64()),
            ),
            "mask": pa.array([np.asarray(bits, int).tolist() for bits in marks]).cast(
                pa.list_(mask_type)
            ),
        }
        for docs, marks in zip(files, trained)
    ]


def write_columns(directory: Path, tables: list[dict], chunk: int, arrow: bool = False) -> None:
    """Each table as a Parquet file of `chunk`-row row groups, or an Arrow IPC file of
    `chunk`-row record batches."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, columns in enumerate(tables):
        table = pa.table(columns)
        if not arrow:
            pq.write_table(table, directory / f"{number}.parquet", row_group_size=chunk)
            continue
        name = str(directory / f"{number}.arrow")
        with pa.OSFile(name, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=chunk):
                writer.write_batch(batch)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.lists(st.integers(1, 20), min_size=1, max_size=8), min_size=1, max_size=3),
    seed=st.integers(0, 2**32 - 1),
    mask_type=st.sampled_from([pa.bool_(), pa.uint8(), pa.int64()]),
    chunk=st.integers(1, 5),
    arrow=st.booleans(),
)
def test_a_mask_column_is_the_same_loss_as_the_labels_it_stands_for(
    tmp_path_factory, lengths, seed, mask_type, chunk, arrow
):
    """One random corpus and loss, written as labels and as a 0/1 mask: both indexes give each
    token the loss the corpus says, the same fingerprint and the same batches."""
    tmp = tmp_path_factory.mktemp("loss")
    files, _ = positional_files(lengths)
    assume(sum(map(sum, lengths)) >= 24)
    rng = np.random.default_rng(seed)
    trained = [[rng.random(len(doc)) < 0.6 for doc in docs] for docs in files]
    write_columns(tmp / "corpus", loss_columns(files, trained, mask_type), chunk, arrow)
    stores, batches = [], []
    for keyword, column in LOSS_COLUMNS.items():
        index = build_columns_index(tmp / "corpus", tmp / column, **{keyword: column})
        stores.append(ColumnStore(index, verify=True))
        source = {"c": {"path": "corpus", "format": "parquet", "index": column}}
        plan = plan_of(tmp, config_for(tmp, source, lanes=1, global_batch_size=2))
        batches.append([plan.batch(step) for step in range(6)])
    by_position = np.concatenate([bits for marks in trained for bits in marks])
    for store in stores:
        assert store.masked
        for shard, marks in enumerate(trained):
            expected = np.concatenate(marks)
            assert store.trained(shard, 0, expected.size).tolist() == expected.tolist()
    assert stores[0].fingerprint == stores[1].fingerprint
    for labelled, masked in zip(*batches):
        assert labelled.keys() == masked.keys()
        for name, value in labelled.items():
            assert np.array_equal(masked[name], value), name
        targets = labelled["targets"]  # ids are positions: each target's loss is known
        assert ((labelled["targets_segmentation"] != 0) == by_position[targets]).all()


@pytest.mark.parametrize("keyword", LOSS_COLUMNS)
def test_a_loss_column_masks_the_targets_it_marks(tmp_path, keyword):
    files, _ = positional_files([[12, 30, 7, 19] * 4, [25, 3, 40] * 5])
    trained = [[np.arange(len(doc)) >= len(doc) // 2 for doc in docs] for docs in files]
    untrained = {t for docs in files for doc in docs for t in doc[: len(doc) // 2]}
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=6)
    build_columns_index(tmp_path / "corpus", **{keyword: LOSS_COLUMNS[keyword]})
    store = ColumnStore(default_index_dir(tmp_path / "corpus"), verify=True)
    assert store.masked and store.trained(1, 0, 25).tolist() == [False] * 12 + [True] * 13
    plan = plan_of(tmp_path, config_for(tmp_path, {"c": {"path": "corpus", "format": "parquet"}}))
    for step in range(12):
        batch = plan.batch(step)
        for row in range(8):
            targets = batch["targets"][row].tolist()
            expected = [t not in untrained for t in targets]
            assert (batch["targets_segmentation"][row] != 0).tolist() == expected
    packed = {"c": {"path": "corpus", "format": "parquet", "packing": "best_fit"}}
    report = audit(plan_of(tmp_path, config_for(tmp_path, packed)), 0, 10, process_counts=[2])
    assert report.ok, report.violations
    unmasked = build_columns_index(tmp_path / "corpus", tmp_path / "plain")
    assert ColumnStore(unmasked).fingerprint != store.fingerprint  # other loss, other data


@pytest.mark.parametrize(
    "keyword, rows, message",
    [
        ("labels", [[1, 2, 3], [1, 2]], r"chunk 1, row 1: 'labels' and 'input_ids' differ in len"),
        ("loss_mask", [[1, 0, 1], [1, 0]], r"chunk 1, row 1: 'mask' and 'input_ids' differ in len"),
        (
            "labels",
            [[1, 2, 3], [-100, 3, 4]],
            r"chunk 1, row 1: 'labels' holds 3 where the id is 2",
        ),
        ("loss_mask", [[1, 0, 1], [0, 2, 1]], r"chunk 1, row 1: 'mask' holds 2, not 0 or 1"),
        ("loss_mask", [[1, 0, 1], [0, -1, 1]], r"chunk 1, row 1: 'mask' holds -1, not 0 or 1"),
        ("loss_mask", [[1, 0, 1], [0, None, 1]], r"chunk 1, row 1: column 'mask' has nulls"),
        ("loss_mask", [[1, 0, 1], None], r"chunk 1, row 1: column 'mask' has nulls"),
        (
            "loss_mask",
            [[1.0] * 3] * 2,
            r"column 'mask' is list<.*double>, not a list of 0/1 integers or",
        ),
        ("labels", [[True] * 3] * 2, r"column 'labels' is list<.*bool>, not a list of integers$"),
    ],
)
def test_a_loss_column_that_does_not_fit_the_ids_is_one_line(tmp_path, keyword, rows, message):
    """Rows of one row group each, the second one bad: the file, chunk, row and column are
    named."""
    column = LOSS_COLUMNS[keyword]
    write_columns(tmp_path / "corpus", [{"input_ids": [[1, 2, 3]] * 2, column: rows}], chunk=1)
    with pytest.raises(StoreError, match=r"0\.parquet: " + message) as refused:
        build_columns_index(tmp_path / "corpus", **{keyword: column})
    assert "\n" not in str(refused.value)


def test_labels_and_a_mask_together_or_a_missing_one_are_refused(tmp_path):
    files, _ = positional_files([[3, 4]])
    trained = [[np.ones(3, bool), np.ones(4, bool)]]
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=1)
    with pytest.raises(StoreError, match=r"^--labels labels and --loss-mask mask: give one of"):
        build_columns_index(tmp_path / "corpus", labels="labels", loss_mask="mask")
    with pytest.raises(StoreError, match=r"0\.parquet: no column 'weights' \(columns: input_ids,"):
        build_columns_index(tmp_path / "corpus", loss_mask="weights")


@pytest.mark.parametrize("keyword", LOSS_COLUMNS)
def test_a_loss_column_changed_after_indexing_is_refused(tmp_path, keyword):
    """The open compares the file's size and sampled blocks (all of a small file's); a store
    already open finds the change when it verifies (reads check the ids' CRCs only: the loss
    served is the index's, which the fingerprint covers)."""
    files, _ = positional_files([[5, 6, 7] * 3])
    trained = [[np.arange(len(doc)) % 2 == 0 for doc in docs] for docs in files]
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=4)
    index = build_columns_index(tmp_path / "corpus", **{keyword: LOSS_COLUMNS[keyword]})
    store = ColumnStore(index, verify=True)
    trained[0][4] = ~trained[0][4]
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=4)
    with pytest.raises(StoreError, match=r"0\.parquet: the dataset changed after `pipeline"):
        ColumnStore(index)
    with pytest.raises(StoreError, match=r"0\.parquet: its content is not as indexed"):
        store.verify()


@pytest.mark.parametrize("labels", [None, "labels"])
def test_an_index_written_before_mask_columns_still_opens_and_verifies(tmp_path, labels):
    """Such an index names its labels column as `labels: COLUMN` (or null), not `loss`."""
    files, _ = positional_files([[5, 6, 7] * 3])
    trained = [[np.arange(len(doc)) % 3 != 0 for doc in docs] for docs in files]
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=4)
    index = build_columns_index(tmp_path / "corpus", labels=labels)
    record = json.loads((index / "columns-index.json").read_text())
    assert record.pop("loss") == (labels and {"column": "labels", "kind": "labels"})
    record["labels"] = labels
    record[MANIFEST_CHECKSUM] = manifest_digest(record)
    (index / "columns-index.json").write_text(json.dumps(record))
    store = ColumnStore(index, verify=True)
    expected = np.concatenate(trained[0]) | (labels is None)
    assert store.masked == bool(labels) and store.trained(0, 0, 54).tolist() == expected.tolist()
    trained[0][2] = ~trained[0][2]
    write_columns(tmp_path / "corpus", loss_columns(files, trained), chunk=4)
    if labels is None:  # the ids, all that is indexed, are unchanged
        store.verify()
    else:
        with pytest.raises(StoreError, match=r"0\.parquet: its content is not as indexed"):
            store.verify()


def test_verifying_one_shard_indexes_that_file_only(tmp_path, monkeypatch):
    """The feed's background check asks each process for its shards one at a time
    (`store.verify([shard])`): one file each, not the whole corpus per call (N^2 over N files);
    a damaged file is found by the call for its shard."""
    import pipeline.store.columns as columns

    write_parquet(tmp_path / "corpus", [[[1, 2, 3]] * 4, [[4, 5]] * 4, [[6]] * 4])
    store = ColumnStore(build_columns_index(tmp_path / "corpus"))
    indexed: list[str] = []
    index_file = columns.index_file
    monkeypatch.setattr(
        columns,
        "index_file",
        lambda file, *a: indexed.append(Path(file).name) or index_file(file, *a),
    )
    for shard in range(store.num_shards):
        store.verify([shard])
    assert indexed == [f"part-{n:05d}.parquet" for n in range(3)]
    write_parquet(tmp_path / "corpus", [[[1, 2, 3]] * 4, [[4, 5]] * 3 + [[5, 4]]])
    store.verify([0])  # the damaged file is the second one
    with pytest.raises(StoreError, match=r"part-00001\.parquet: its content is not as indexed"):
        store.verify([1])


def test_the_config_accepts_exactly_the_formats_that_open():
    """`format:` names live in `pipeline.in_place` (the config cannot import the store layer):
    each must open through `store.formats.IN_PLACE`, and each there be accepted."""
    from pipeline.in_place import IN_PLACE_FORMATS
    from pipeline.store.formats import IN_PLACE

    assert tuple(IN_PLACE) == IN_PLACE_FORMATS


def test_a_declared_switch_that_adds_in_place_sources_keeps_every_guarantee(tmp_path):
    """A run on a prepared store alone, switched at step 10 to a mix that adds a Parquet and a
    Megatron source: the steps before are the first plan's, the added sources start at counter
    0, no window repeats in an epoch on 1, 2 or 4 hosts, and the saved ledger passes what
    `pipeline verify --ledger` checks of it."""
    from pipeline.plan import data_state
    from pipeline.plan.resume import reconcile
    from tests.storegen import write_synthetic_store

    files, _ = positional_files([[12, 30, 7, 19] * 3, [25, 3, 40] * 3])
    write_parquet(tmp_path / "corpus", files)
    build_columns_index(tmp_path / "corpus")
    write_megatron(tmp_path / "meg", [[[5, 6, 7, 0]], [[8, 9, 0]]] * 40)
    build_index(tmp_path / "meg")
    write_synthetic_store(tmp_path / "store", [[30, 50, 20], [40, 60]])
    first = plan_of(tmp_path, config_for(tmp_path, {"s": {"path": "store"}}))
    sources = {
        "s": {"path": "store"},
        "c": {"path": "corpus", "format": "parquet"},
        "m": {"path": "meg", "format": "megatron"},
    }
    mixed = parse_config(config_for(tmp_path, sources, shared_vocabulary=True), "b.yaml", tmp_path)
    ledger = reconcile(first, mixed, 10, switch=True)
    switched = Plan(Ledger.from_json(json.loads(json.dumps(ledger.to_json()))))
    assert ledger.segments[1].counters == {"c": 0, "m": 0, **first.segment_plan(0).counters_at(10)}
    for step in (0, 9):
        for name, value in first.batch(step).items():
            assert np.array_equal(switched.batch(step)[name], value)
    drawn = {switched.draws(10).source_names[s] for s in switched.draws(10).source.tolist()}
    assert {"c", "m"} <= drawn
    report = audit(switched, 0, 60, process_counts=[1, 2, 4])
    assert report.ok, report.violations
    assert report.epochs_completed["c"] >= 1 and report.epochs_completed["m"] >= 1
    data_state.verify_ledger(switched.ledger, switched, "<switched>")


def test_in_place_hints_point_the_right_way(tmp_path, capsys):
    """A Megatron prefix or a Parquet directory named as a store, a Parquet directory indexed
    as Megatron, `index X.bin`, a DatasetDict root, one file: each says what to do instead."""
    from pipeline.commands.cli import main
    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from pipeline.store.megatron_format import write_megatron

    def error_of(argv: list[str]) -> str:
        assert main(argv) == 2
        said = capsys.readouterr().err
        assert said.count("\n") == 1, said
        return said

    write_megatron(tmp_path / "meg", [[[5, 6, 0]], [[7, 0]]])
    write_parquet(tmp_path / "pq", [[[1, 2], [3]]])
    for name, fix in (("meg", "format: megatron` after `pipeline index"),
                      ("pq", "format: parquet` after `pipeline index")):  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(
            f"seq_len: 4\nglobal_batch_size: 1\nsources: {{a: {{path: {name}}}}}\nmix: {{a: 1}}\n"
        )
        with pytest.raises(ConfigError, match=fix):
            Plan.from_config(load_config(tmp_path / f"{name}.yaml"))
    said = error_of(["index", str(tmp_path / "pq")])
    assert "is a directory: for its Parquet/Arrow files give --format parquet" in said
    assert main(["index", str(tmp_path / "meg.bin")]) == 0  # the prefix, not meg.bin.bin
    assert (tmp_path / "meg.pipeline-index").is_dir()
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    said = error_of(["index", str(tmp_path / "dd"), "--format", "parquet"])
    split = tmp_path / "dd" / "train"
    assert f"is a DatasetDict of splits train, test: give one split's directory ({split})" in said
    capsys.readouterr()
    assert main(["index", str(tmp_path / "pq" / "part-00000.parquet"), "--format", "parquet"]) == 0
    assert (tmp_path / "pq" / "part-00000.parquet.pipeline-index").is_dir()  # beside, no glob
