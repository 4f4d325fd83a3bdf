"""Megatron .bin/.idx datasets read in place (docs/in-place-corpora.md)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, StoreError
from pipeline.in_place import default_index_dir
from pipeline.plan.ledger import Ledger
from pipeline.plan.resume import reconcile
from pipeline.plan.rows import host_rows
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from pipeline.store.formats import open_store
from pipeline.store.megatron import MegatronStore
from pipeline.store.megatron_format import read_index, write_megatron
from pipeline.store.megatron_index import build_index
from tests.storegen import write_synthetic_store

ROOT = Path(__file__).resolve().parents[1]
# Megatron-LM's DType codes (indexed_dataset.py), written out here rather than imported
SPEC_CODES = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
    np.float64: 6, np.float32: 7, np.uint16: 8,
}  # fmt: skip


def random_documents(seed: int, count: int, high: int = 500, eod: int | None = 0) -> list:
    """`count` documents of 1..3 sequences of ids in [1, high), each ending with `eod`."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        seqs = [
            rng.integers(1, high, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))
        ]
        if eod is not None:
            seqs[-1].append(eod)
        docs.append(seqs)
    return docs


def flat_documents(docs: list) -> list[list[int]]:
    return [[t for seq in doc for t in seq] for doc in docs]


def indexed(tmp: Path, docs: list, dtype=np.uint16, name: str = "corpus") -> Path:
    write_megatron(tmp / name, docs, dtype)
    build_index(tmp / name)
    return tmp / name


def config_for(tmp: Path, sources: dict, **extra) -> dict:
    return {
        "seed": 3, "seq_len": 8, "global_batch_size": 8, "lanes": 2,
        "sources": sources, "mix": {name: 1.0 for name in sources}, **extra,
    }  # fmt: skip


def plan_of(tmp: Path, raw: dict) -> Plan:
    return Plan.from_config(parse_config(raw, str(tmp / "data.yaml"), tmp))


# -- the file format, against Megatron-LM's layout ---------------------------------------------


@pytest.mark.parametrize("dtype", list(SPEC_CODES))
def test_the_writer_writes_megatrons_layout_byte_for_byte(tmp_path, dtype):
    docs = [[[1, 2, 3], [4]], [[5, 6]]]  # 2 documents, 3 sequences
    write_megatron(tmp_path / "d", docs, dtype)
    size = np.dtype(dtype).itemsize
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", SPEC_CODES[dtype])
        + struct.pack("<QQ", 3, 3)  # sequences, document indices (documents + 1)
        + struct.pack("<3i", 3, 1, 2)  # tokens per sequence
        + struct.pack("<3q", 0, 3 * size, 4 * size)  # byte pointers
        + struct.pack("<3q", 0, 2, 3)  # document indices
    )
    assert (tmp_path / "d.idx").read_bytes() == expected
    tokens = np.arange(1, 7).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert (tmp_path / "d.bin").read_bytes() == tokens
    index = read_index(tmp_path / "d.idx")
    assert index.dtype == np.dtype(dtype)
    assert index.document_offsets(6 * size).tolist() == [0, 4, 6]


def test_a_multimodal_index_is_refused_by_name(tmp_path):
    write_megatron(tmp_path / "d", [[[1, 2]], [[3]]])
    with (tmp_path / "d.idx").open("ab") as idx:
        idx.write(b"\x00\x01")  # one mode byte per sequence
    with pytest.raises(StoreError, match=r"d\.idx: a multimodal Megatron dataset"):
        read_index(tmp_path / "d.idx")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"XXIDIDX\x00\x00" + b[9:], "not a Megatron index"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (lambda b: b[:17] + b"\x09" + b[18:], "unknown Megatron dtype code 9"),
        (lambda b: b[:-3], "truncated or corrupt"),
    ],
)
def test_a_damaged_index_is_one_line(tmp_path, damage, message):
    write_megatron(tmp_path / "d", [[[1, 2]], [[3]]])
    idx = tmp_path / "d.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(StoreError, match=message):
        build_index(tmp_path / "d")


def test_sequences_that_are_not_back_to_back_are_refused(tmp_path):
    write_megatron(tmp_path / "d", [[[1, 2]], [[3, 4]]])
    idx = tmp_path / "d.idx"
    data = bytearray(idx.read_bytes())
    data[34 + 8 + 8 : 34 + 8 + 16] = struct.pack("<q", 2)  # second pointer: 2 bytes, not 4
    idx.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="not lie back to back"):
        build_index(tmp_path / "d")


# -- the index: documents, eod, ids -------------------------------------------------------------


def test_the_index_finds_documents_eod_and_drops_empty_documents(tmp_path):
    docs = [[[5, 6], [7, 0]], [], [[8, 0]]]  # a document of 2 sequences, an empty one
    store = MegatronStore(build_index(indexed(tmp_path, docs)))
    assert store.num_documents == 2 and store.manifest["empty_documents"] == 1
    assert store.doc_offsets(0).tolist() == [0, 4, 6]
    assert store.eod_id == 0 and store.vocab_size == 9
    assert store.document(0, 0).tolist() == [5, 6, 7, 0]


def test_documents_without_a_common_last_id_carry_no_eod(tmp_path):
    store = MegatronStore(build_index(indexed(tmp_path, [[[5, 6]], [[7]]])))
    assert (store.eod_id, store.manifest["eod"]) == (-1, "none")


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
def test_every_megatron_dtype_reads_as_ids(tmp_path, dtype):
    docs = [[[1, 2, 3]], [[4, 5]]]
    store = MegatronStore(build_index(indexed(tmp_path, docs, dtype)))
    assert store.read_tokens(1, 5).tokens.tolist() == [2, 3, 4, 5]


def test_ids_that_are_not_token_ids_are_refused(tmp_path):
    write_megatron(tmp_path / "d", [[[1.5, 2.0]]], np.float32)
    with pytest.raises(StoreError, match=r"d\.bin: tokens from byte 0 on are not all whole ids"):
        build_index(tmp_path / "d")


# -- the plan's guarantees ----------------------------------------------------------------------


def expected_fields(tokens: np.ndarray, starts: set[int], start: int, width: int) -> tuple:
    """Segment ids and positions of a window at `start`, from the documents' starts alone."""
    segments, positions, segment, position = [], [], 0, 0
    for j in range(width):
        if j == 0 or start + j in starts:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(5, 60),
    seq_len=st.sampled_from([4, 8, 16]),
    lanes=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([np.uint16, np.int32, np.uint8]),
)
def test_every_token_is_an_input_once_per_epoch_and_positions_restart_at_documents(
    tmp_path_factory, seed, count, seq_len, lanes, dtype
):
    tmp = tmp_path_factory.mktemp("meg")
    docs = random_documents(seed, count, high=200)
    indexed(tmp, docs, dtype)
    stream = np.concatenate([np.array(d, np.int64) for d in flat_documents(docs)])
    starts = set(np.cumsum([0] + [len(d) for d in flat_documents(docs)]).tolist())
    assume(len(stream) >= lanes * (seq_len + 2))  # every lane holds a window
    raw = config_for(tmp, {"meg": {"path": "corpus", "format": "megatron"}})
    raw.update(seq_len=seq_len, lanes=lanes, global_batch_size=lanes * 2)
    plan = plan_of(tmp, raw)
    per_lane = plan.segment_plan(0).layouts["meg"].windows_per_lane
    seen = np.zeros(len(stream), dtype=np.int64)
    for step in range(-(-per_lane // 2)):
        draws = plan.draws(step)
        batch = plan.read(draws)
        for r in np.flatnonzero(draws.epoch == 0).tolist():
            start = int(draws.start[r])
            window = stream[start : start + seq_len + 1]
            assert batch["inputs"][r].tolist() == window[:-1].tolist()
            assert batch["targets"][r].tolist() == window[1:].tolist()
            segments, positions = expected_fields(window, starts, start, seq_len + 1)
            assert batch["inputs_segmentation"][r].tolist() == segments[:-1]
            assert batch["inputs_position"][r].tolist() == positions[:-1]
            assert batch["targets_position"][r].tolist() == positions[1:]
            seen[start : start + seq_len] += 1
    assert seen.max() == 1  # no token is an input twice in the epoch
    assert seen.sum() == per_lane * lanes * seq_len
    assert len(stream) - seen.sum() <= lanes * (2 * seq_len + 1)  # only the lanes' tails unused


def test_one_and_two_hosts_and_a_resume_read_identical_batches(tmp_path):
    indexed(tmp_path, random_documents(1, 80))
    plan = plan_of(
        tmp_path, config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}})
    )
    resumed = Plan(Ledger.from_json(json.loads(json.dumps(plan.ledger.to_json()))))
    for step in (0, 7, 40, 41):
        whole = plan.batch(step)
        halves = [plan.batch(step, host_rows(8, i, 2)) for i in range(2)]
        again = resumed.batch(step)
        for name, value in whole.items():
            assert np.array_equal(np.concatenate([h[name] for h in halves]), value)
            assert np.array_equal(again[name], value)
    report = audit(plan, 0, 120, process_counts=[1, 2, 4])
    assert report.ok, report.violations
    assert report.epochs_completed["meg"] >= 1


def test_a_megatron_source_mixes_with_a_prepared_store(tmp_path):
    indexed(tmp_path, random_documents(2, 200))
    write_synthetic_store(tmp_path / "store", [[30, 50, 20], [40, 60]])
    sources = {"meg": {"path": "corpus", "format": "megatron"}, "prep": {"path": "store"}}
    with pytest.raises(ConfigError, match="different tokenizers"):
        plan_of(tmp_path, config_for(tmp_path, sources))
    plan = plan_of(tmp_path, config_for(tmp_path, sources, shared_vocabulary=True))
    drawn = set()
    for step in range(30):
        draws = plan.draws(step)
        plan.read(draws)
        drawn |= set(np.unique(draws.source).tolist())
    assert drawn == {0, 1}
    report = audit(plan, 0, 30, process_counts=[2])
    assert report.ok, report.violations


def test_best_fit_packing_and_a_switch_to_a_mixture_keep_their_guarantees(tmp_path):
    indexed(tmp_path, random_documents(9, 150))
    write_synthetic_store(tmp_path / "store", [[30, 50, 20], [40, 60]])
    packed = {"meg": {"path": "corpus", "format": "megatron", "packing": "best_fit"}}
    report = audit(plan_of(tmp_path, config_for(tmp_path, packed)), 0, 20, process_counts=[2])
    assert report.ok, report.violations
    assert report.packing["meg"].documents > 0
    alone = plan_of(
        tmp_path, config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}})
    )
    sources = {"meg": {"path": "corpus", "format": "megatron"}, "prep": {"path": "store"}}
    mixed = parse_config(config_for(tmp_path, sources, shared_vocabulary=True), "b.yaml", tmp_path)
    ledger = reconcile(alone, mixed, 10, switch=True)
    assert ledger.segments[1].counters["meg"] == alone.segment_plan(0).counters_at(10)["meg"] > 0
    switched = Plan(ledger)
    report = audit(switched, 0, 60, process_counts=[2])
    assert report.ok, report.violations  # no window of meg's epoch drawn twice across the switch


# -- identity, changes, and the files left as they were -----------------------------------------


def big_dataset(tmp: Path) -> Path:
    """Over 5 blocks of 64 KiB, so that some blocks are not among the sampled ones."""
    docs = [[[*np.full(1000, 1 + k % 200).tolist(), 0]] for k in range(300)]
    return indexed(tmp, docs)


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_a_changed_bin_in_a_sampled_block_is_refused_at_open(tmp_path):
    prefix = big_dataset(tmp_path)
    flip(tmp_path / "corpus.bin", 10)
    with pytest.raises(
        StoreError, match=r"corpus\.bin: the dataset changed after `pipeline index`"
    ):
        MegatronStore(default_index_dir(prefix))


def test_a_changed_bin_elsewhere_is_refused_at_its_first_read_by_the_sources_key(tmp_path):
    big_dataset(tmp_path)
    flip(tmp_path / "corpus.bin", 65536 + 100)  # block 1: not sampled (0, 3, 6, 9 of 10)
    raw = config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}}, lanes=1)
    plan = plan_of(tmp_path, raw)
    changed = r"sources\.meg\.path: .*corpus\.bin: bytes 65536\.\..*changed after `pipeline index`"
    with pytest.raises(StoreError, match=changed):
        for step in range(2000):
            plan.batch(step)
    with pytest.raises(StoreError, match="does not match its checksum in the index"):
        MegatronStore(default_index_dir(tmp_path / "corpus")).verify()


def test_a_changed_idx_or_a_reindexed_dataset_is_refused(tmp_path):
    prefix = indexed(tmp_path, random_documents(3, 50))
    plan = plan_of(
        tmp_path, config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}})
    )
    flip(tmp_path / "corpus.idx", 40)  # a sequence length
    with pytest.raises(StoreError, match=r"corpus\.idx: the dataset changed"):
        MegatronStore(default_index_dir(prefix))
    write_megatron(prefix, random_documents(4, 50))
    build_index(prefix)  # new content, new fingerprint: the recorded run is refused
    with pytest.raises(
        StoreError,
        match=r"sources\.meg\.path: .*content fingerprint .* the ledger.*: the corpus read in "
        r"place \(its data files, or their `pipeline index`\) changed",
    ):
        Plan(plan.ledger).batch(0)


def test_indexing_and_training_leave_the_files_as_they_were(tmp_path):
    write_megatron(tmp_path / "corpus", random_documents(5, 200))
    files = [tmp_path / "corpus.bin", tmp_path / "corpus.idx"]
    before = [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files]
    build_index(tmp_path / "corpus")
    plan = plan_of(
        tmp_path, config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}})
    )
    for step in range(50):
        plan.batch(step)
    open_store(default_index_dir(tmp_path / "corpus"), verify=True)
    assert [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "corpus.bin",
        "corpus.idx",
        "corpus.pipeline-index",
    ]


# -- config and command line --------------------------------------------------------------------


def test_the_config_names_the_index_and_round_trips(tmp_path):
    indexed(tmp_path, random_documents(6, 20))
    build_index(tmp_path / "corpus", tmp_path / "elsewhere")
    sources = {"meg": {"path": "corpus", "format": "megatron", "index": "elsewhere"}}
    config = parse_config(config_for(tmp_path, sources), "c.yaml", tmp_path)
    spec = config.source("meg")
    assert spec.path == tmp_path / "elsewhere" and spec.data == tmp_path / "corpus"
    again = parse_config(config_for(tmp_path, {"meg": spec.to_json()}), "c.yaml", tmp_path)
    assert again.source("meg") == spec
    assert Plan.from_config(config).batch(0)["inputs"].shape == (8, 8)


def test_an_index_of_another_dataset_is_refused_by_the_sources_key(tmp_path):
    write_megatron(tmp_path / "corpus", random_documents(6, 20))
    write_megatron(tmp_path / "other", random_documents(7, 20))
    build_index(tmp_path / "other", tmp_path / "elsewhere")
    sources = {"meg": {"path": "corpus", "format": "megatron", "index": "elsewhere"}}
    with pytest.raises(ConfigError, match=r"sources\.meg\.path: .*elsewhere: indexes .*other"):
        plan_of(tmp_path, config_for(tmp_path, sources))


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"path": "corpus", "format": "arrow"},
            r"sources\.meg\.format: expected store, megatron or parquet",
        ),
        ({"path": "corpus", "index": "x"}, r"sources\.meg\.index: only a source read in place"),
        ({"path": "gs://b/corpus", "format": "megatron"}, "read from a local path"),
    ],
)
def test_bad_format_keys_are_one_line(tmp_path, entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config_for(tmp_path, {"meg": entry}), "c.yaml", tmp_path)


def test_a_dataset_not_indexed_yet_says_how(tmp_path):
    write_megatron(tmp_path / "corpus", random_documents(7, 20))
    with pytest.raises(ConfigError, match=r"sources\.meg\.path: .* run `pipeline index`"):
        plan_of(tmp_path, config_for(tmp_path, {"meg": {"path": "corpus", "format": "megatron"}}))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False)


def test_pipeline_index_and_verify_store_on_the_command_line(tmp_path):
    write_megatron(tmp_path / "corpus", random_documents(8, 20))
    done = run_cli("index", str(tmp_path / "corpus"), "--out", str(tmp_path / "ix"))
    assert done.returncode == 0, done.stderr
    assert "20 documents" in done.stdout and "eod id: 0" in done.stdout
    assert run_cli("verify-store", str(tmp_path / "ix")).returncode == 0
    sources = {"meg": {"path": "corpus", "format": "megatron", "index": "ix"}}
    (tmp_path / "data.yaml").write_text(json.dumps(config_for(tmp_path, sources)))
    config = str(tmp_path / "data.yaml")
    inspect = run_cli("inspect", config, "--step", "2")
    assert inspect.returncode == 0 and "corpus.bin" in inspect.stdout, inspect.stderr
    dump = run_cli("dump", config, "--steps", "0:3", "--out", str(tmp_path / "d.npz"))
    assert dump.returncode == 0, dump.stderr
    plan = Plan.from_config(parse_config(config_for(tmp_path, sources), config, tmp_path))
    with np.load(tmp_path / "d.npz") as dumped:
        assert np.array_equal(dumped["inputs"][1], plan.batch(1)["inputs"])
    missing = run_cli("index", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "nothing.bin: no such file" in missing.stderr


@pytest.mark.parametrize(
    ("documents", "out", "message"),
    [
        ([], "ix", r"corpus\.bin: the dataset holds no tokens; nothing to index"),
        ([[[]], [[]]], "ix", r"corpus\.bin: the dataset holds no tokens; nothing to index"),
        ([[[5, 6]]], "file/ix", r"file/ix: cannot create the index directory: Not a directory"),
    ],
)
def test_pipeline_index_of_an_empty_dataset_or_to_a_bad_out_is_one_line(
    tmp_path, documents, out, message
):
    write_megatron(tmp_path / "corpus", documents)
    (tmp_path / "file").write_text("not a directory")
    done = run_cli("index", str(tmp_path / "corpus"), "--out", str(tmp_path / out))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert re.search(message, done.stderr), done.stderr


def test_a_copy_of_a_dataset_and_the_index_beside_it_reads_and_verifies_the_copy(tmp_path, capsys):
    """The index beside its data records the prefix relative to itself: a copy of both checks
    the copy's files (a damaged copy is refused) and `verify-store` names what it read."""
    import shutil

    from pipeline.commands.cli import main

    (tmp_path / "a").mkdir()
    write_megatron(tmp_path / "a" / "corpus", random_documents(8, 20))
    assert main(["index", str(tmp_path / "a" / "corpus")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    index = default_index_dir(tmp_path / "b" / "corpus")
    capsys.readouterr()
    assert main(["verify-store", str(index)]) == 0
    said = capsys.readouterr().out
    assert said.endswith(
        f"; checked {tmp_path / 'b' / 'corpus.bin'}, {tmp_path / 'b' / 'corpus.idx'}\n"
    )
    flip(tmp_path / "b" / "corpus.bin", 10)
    assert main(["verify-store", str(index)]) == 2
    assert f"{tmp_path / 'b' / 'corpus.bin'}: " in capsys.readouterr().err
    assert main(["verify-store", str(default_index_dir(tmp_path / "a" / "corpus"))]) == 0
