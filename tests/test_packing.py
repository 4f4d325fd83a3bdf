"""`packing: best_fit`: whole documents per row, the loss mask in the batch, exact resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Ledger, Plan, host_rows, parse_config
from pipeline.commands.cli import main
from pipeline.errors import ConfigError
from pipeline.plan import packing
from pipeline.plan.packing import PackedLayout, best_fit_decreasing
from pipeline.read.audit import audit
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import commit, staging_dir, write_manifest, write_shard
from tests.storegen import TOKENIZER, write_synthetic_store

EOD = 2**31 - 1  # each document's last token: never a position here, fits the int32 batch


def write_masked_store(path: Path, shards: list[list[tuple[int, ...]]]) -> TokenStore:
    """Shard i holds documents of (length, untrained prefix[, untrained tail]) shards[i]: the
    tail, if any, is the span of that many tokens before the eod (as a chat template's
    end-of-turn marker). Token value = its position in the natural stream (the eod: EOD), so
    every document is recognisable."""
    staging = staging_dir(path)
    position, infos = 0, []
    for index, docs in enumerate(shards):
        documents = []
        for length, *prefix_and_tail in docs:
            tokens = np.arange(position, position + length, dtype=np.uint32)
            tokens[-1] = EOD
            spans = _untrained(length, *prefix_and_tail)
            documents.append((tokens, np.array(spans, np.int64).reshape(-1, 2)))
            position += length
        infos.append(write_shard(staging, index, len(shards), documents, np.dtype(np.uint32),
                                 masked=True))  # fmt: skip
    write_manifest(staging, infos, TOKENIZER, np.dtype(np.uint32), {"synthetic": True})
    commit(staging, path, overwrite=False)
    return TokenStore(path)


def _untrained(length: int, prefix: int, tail: int = 0) -> list[tuple[int, int]]:
    """The untrained spans of a `write_masked_store` document (never leaving it)."""
    prefix = min(prefix, length)
    spans = [(0, prefix)] if prefix else []
    if tail and length - 1 - tail >= prefix:
        spans.append((length - 1 - tail, length - 1))
    return spans


def _flags(length: int, *prefix_and_tail: int) -> np.ndarray:
    """Per token of a `write_masked_store` document: trained, from the spans it was given."""
    flags = np.ones(length, bool)
    for a, b in _untrained(length, *prefix_and_tail):
        flags[a:b] = False
    return flags


def _config(path: Path, seq_len: int, batch: int, lanes: int, **source: object) -> dict:
    return {
        "seed": 7,
        "seq_len": seq_len,
        "global_batch_size": batch,
        "lanes": lanes,
        "sources": {"sft": {"path": str(path), "packing": "best_fit", **source}},
        "mix": {"sft": 1},
    }


def _doc_table(store: TokenStore) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """First token -> (tokens, trained flags) of every document."""
    table = {}
    for shard in range(store.num_shards):
        offsets = store.doc_offsets(shard)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            tokens = store.read_shard_tokens(shard, a, b).tokens.astype(np.int64)
            table[int(tokens[0])] = (tokens, store.trained(shard, a, b))
    return table


def _row_documents(batch: dict[str, np.ndarray], row: int) -> list[tuple[int, slice]]:
    """(first input token, columns) of each segment of a row; checks segments are contiguous,
    numbered 1, 2, ... and followed only by padding."""
    seg = batch["inputs_segmentation"][row]
    used = int((seg > 0).sum())
    assert (seg[used:] == 0).all() and (seg[:used] > 0).all()
    bounds = np.flatnonzero(np.diff(seg[:used])) + 1
    docs = []
    for number, (a, b) in enumerate(zip([0, *bounds.tolist()], [*bounds.tolist(), used]), 1):
        assert (seg[a:b] == number).all()
        docs.append((int(batch["inputs"][row, a]), slice(a, b)))
    return docs


def _pieces_are_the_documents(plan, draws, batch, store: TokenStore) -> None:
    """`Plan.pieces` (what a feed fetches ahead of its reads) names the documents the rows
    hold, in order, each as long as read."""
    [(piece_store, shards, lo, hi)] = plan.pieces(draws, local=True)
    firsts = [first for row in range(len(draws.rows)) for first, _ in _row_documents(batch, row)]
    read = [
        int(piece_store.read_shard_tokens(shard, start, start + 1).tokens[0])
        for shard, start in zip(shards.tolist(), lo.tolist(), strict=True)
    ]
    assert piece_store.path == store.path
    assert read == firsts
    sizes = [
        cols.stop - cols.start + 1
        for row in range(len(draws.rows))
        for _, cols in _row_documents(batch, row)
    ]
    assert (hi - lo).tolist() == sizes


lengths = st.lists(
    st.lists(
        st.tuples(st.integers(2, 40), st.integers(0, 6), st.integers(0, 3)), min_size=0, max_size=12
    ),
    min_size=1,
    max_size=4,
).filter(lambda shards: sum(map(len, shards)) >= 8)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shards=lengths, seq_len=st.integers(8, 48), lanes=st.sampled_from([1, 2, 4]))
def test_rows_hold_whole_documents_once_per_epoch_with_the_mask(
    tmp_path_factory: pytest.TempPathFactory, shards: list, seq_len: int, lanes: int
) -> None:
    store = write_masked_store(tmp_path_factory.mktemp("s") / "store", shards)
    table = _doc_table(store)
    written = [_flags(*doc) for docs in shards for doc in docs]  # in stream order, as `table`
    assert all(np.array_equal(a, b) for a, (_, b) in zip(written, table.values(), strict=True))
    try:
        plan = Plan.from_config(parse_config(_config(store.path, seq_len, 2 * lanes, lanes)))
    except ConfigError as error:  # too few documents to give every lane a row
        assert "cannot be split evenly" in str(error)
        return
    layout = plan.segment_plan(0).layouts["sft"]
    per_epoch = layout.windows_per_lane * lanes
    steps = 2 * per_epoch // (2 * lanes) + 1  # a little over two epochs
    seen: dict[int, Counter] = {}
    for step in range(steps):
        draws = plan.draws(step)
        batch = plan.read(draws)
        _pieces_are_the_documents(plan, draws, batch, store)
        for row in range(len(draws.rows)):
            epoch = int(draws.epoch[row])
            for first, cols in _row_documents(batch, row):
                tokens, trained = table[first]
                n = min(len(tokens), seq_len + 1)  # truncated to a row
                assert cols.stop - cols.start == n - 1  # the whole document: no row crosses one
                assert (batch["inputs"][row, cols] == tokens[: n - 1]).all()
                assert (batch["targets"][row, cols] == tokens[1:n]).all()
                assert (batch["inputs_position"][row, cols] == np.arange(n - 1)).all()
                assert (batch["targets_position"][row, cols] == np.arange(n - 1)).all()
                expected = np.where(trained[1:n], batch["inputs_segmentation"][row, cols], 0)
                assert (batch["targets_segmentation"][row, cols] == expected).all()
                seen.setdefault(epoch, Counter())[first] += 1
            pad = batch["inputs_segmentation"][row] == 0
            for name in ("targets_segmentation", "inputs_position", "targets_position"):
                assert (batch[name][row][pad] == 0).all()
    complete = [e for e in seen if (e + 1) * per_epoch <= steps * 2 * lanes]
    assert complete
    for epoch in complete:  # every document exactly once per epoch
        assert seen[epoch] == Counter(list(table))


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shards=lengths, data=st.data())
def test_untrained_spans_of_ranges_over_many_shards(
    tmp_path_factory: pytest.TempPathFactory, shards: list, data: st.DataObject
) -> None:
    store = write_masked_store(tmp_path_factory.mktemp("s") / "store", shards)
    # per shard, per token: trained, from the spans written
    flags = [np.concatenate([np.ones(0, bool)] + [_flags(*doc) for doc in docs]) for docs in shards]
    nonempty = [s for s in range(len(shards)) if flags[s].size]
    ranges = []
    for _ in range(data.draw(st.integers(1, 12))):
        shard = data.draw(st.sampled_from(nonempty))
        start = data.draw(st.integers(0, flags[shard].size - 1))
        ranges.append((shard, start, data.draw(st.integers(start + 1, flags[shard].size))))
    piece, lo, hi = store.untrained_spans(*np.array(ranges).T)
    assert ((lo >= 0) & (lo <= hi)).all()
    found = [np.ones(stop - start, bool) for _, start, stop in ranges]
    for i, a, b in zip(piece.tolist(), lo.tolist(), hi.tolist()):
        assert b <= found[i].size
        found[i][a:b] = False
    for (shard, start, stop), mask in zip(ranges, found):
        assert np.array_equal(mask, flags[shard][start:stop])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(step=st.integers(0, 10**7), process_count=st.sampled_from([1, 2, 4]))
def test_restore_at_any_step_and_any_host_count_gives_the_same_batch(
    tmp_path_factory: pytest.TempPathFactory, step: int, process_count: int
) -> None:
    path = tmp_path_factory.mktemp("s") / "store"
    store = write_masked_store(path, [[(5 + i % 17, i % 4) for i in range(40)]] * 3)
    config = parse_config(_config(store.path, 32, 8, 4))
    plan = Plan.from_config(config)
    whole = plan.batch(step)
    packing._CACHE.clear()  # as in a new process: the packing is read back from disk
    restored = Plan(Ledger.from_json(plan.ledger.to_json()))
    parts = [
        restored.batch(step, host_rows(8, index, process_count)) for index in range(process_count)
    ]
    for name, values in whole.items():
        assert np.array_equal(np.concatenate([p[name] for p in parts]), values)


def test_uninterrupted_stream_equals_restored_steps(tmp_path: Path) -> None:
    store = write_masked_store(tmp_path / "s", [[(3 + i % 29, i % 3) for i in range(60)]] * 2)
    plan = Plan.from_config(parse_config(_config(store.path, 24, 4, 2)))
    stream = [plan.batch(step) for step in range(40)]
    for step in (0, 13, 39):
        packing._CACHE.clear()  # as in a new process: the packing is read back from disk
        fresh = Plan(Ledger.from_json(plan.ledger.to_json()))
        for name in stream[step]:
            assert np.array_equal(fresh.batch(step)[name], stream[step][name])


def test_too_long_documents_are_truncated_or_dropped_and_counted(tmp_path: Path) -> None:
    store = write_masked_store(tmp_path / "s", [[(10, 0)] * 6 + [(50, 2), (17, 0), (18, 0)]])
    truncate = PackedLayout("sft", store, 0, 16, 1, "truncate")
    drop = PackedLayout("sft", store, 0, 16, 1, "drop")
    assert (truncate.stats.truncated, truncate.stats.dropped, truncate.stats.documents) == (2, 0, 9)
    assert (drop.stats.truncated, drop.stats.dropped, drop.stats.documents) == (0, 2, 7)
    plan = Plan.from_config(parse_config(_config(store.path, 16, 1, 1, too_long="drop")))
    firsts = {
        first
        for step in range(drop.windows_per_lane)
        for first, _ in _row_documents(plan.batch(step), 0)
    }
    assert len(firsts) == 7 and 60 not in firsts  # the 50-token document starts at token 60


def test_best_fit_decreasing_fills_the_tightest_row() -> None:
    rows = best_fit_decreasing(np.array([5, 3, 7, 2, 4, 1]), 8)
    assert [sorted(int(np.array([5, 3, 7, 2, 4, 1])[i]) for i in row) for row in rows] == [
        [1, 7],
        [3, 5],
        [2, 4],
    ]


def test_rows_split_evenly_over_lanes_or_refused(tmp_path: Path) -> None:
    store = write_masked_store(tmp_path / "s", [[(4, 0)] * 5])
    layout = PackedLayout("sft", store, 0, 64, 4, "truncate")  # 5 docs fit one row: split to 4
    assert layout.windows_per_lane == 1 and layout.stats.rows == 4
    with pytest.raises(ConfigError, match=r"sources\.sft: its documents make 5 rows.*8 lanes"):
        PackedLayout("sft", store, 0, 64, 8, "truncate")


def test_cli_epochs_of_one_packed_row_of_one_document_is_singular(tmp_path: Path, capsys) -> None:
    store = write_masked_store(tmp_path / "s", [[(4, 0)]])
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump(_config(store.path, 64, 1, 1)))
    assert main(["epochs", str(config)]) == 0
    assert "best_fit: 1 row per epoch of 1 document, padding" in capsys.readouterr().out


def test_mixed_with_a_concat_source_in_epochized_stages(tmp_path: Path) -> None:
    sft = write_masked_store(tmp_path / "sft", [[(6 + i % 11, 2) for i in range(30)]])
    text = write_synthetic_store(tmp_path / "text", [[300, 200], [400]])
    config = {
        "seq_len": 16,
        "global_batch_size": 4,
        "lanes": 2,
        "sources": {"text": {"path": str(text.path)}, "sft": {"path": str(sft.path),
                                                            "packing": "best_fit"}},
        "stages": [{"name": "pre", "steps": 3, "mix": {"text": 1}},
                   {"name": "sft", "epochs": {"sft": 2, "text": 1}},
                   {"name": "after", "mix": {"text": 1}}],
    }  # fmt: skip
    plan = Plan.from_config(parse_config(config))
    seg = plan.segment_plan(0)
    sft_rows = seg.layouts["sft"].windows_per_lane
    end = seg.table.stages[1].end
    counters = seg.table.counters(end)
    assert counters[seg.config.source_names.index("sft")] == 2 * sft_rows  # two epochs of rows
    table = _doc_table(sft)
    seen = Counter()
    for step in range(int(seg.clock.step_of(end - 1)) + 1):
        draws = plan.draws(step)
        batch = plan.read(draws)
        for row in np.flatnonzero(draws.source == seg.config.source_names.index("sft")):
            seen.update(first for first, _ in _row_documents(batch, int(row)))
        concat = draws.source != seg.config.source_names.index("sft")
        assert (batch["inputs_segmentation"][concat] > 0).all()  # windows stay padding-free
    assert seen == Counter({first: 2 for first in table})


@pytest.mark.parametrize(
    "shards", [[[(8, 3)] * 20], [[(8, 3)] * 7, [(5, 4)] * 6, [(8, 3)] * 9]], ids=["1", "3"]
)
def test_concat_windows_of_a_masked_store_carry_the_mask(tmp_path: Path, shards) -> None:
    store = write_masked_store(tmp_path / "s", shards)
    config = _config(store.path, 10, 2, 1)
    config["sources"]["sft"] = {"path": str(store.path)}
    plan = Plan.from_config(parse_config(config))
    table = {}
    for tokens, trained in _doc_table(store).values():
        table.update(zip(tokens.tolist(), trained.tolist()))
    for step in range(5):
        batch = plan.batch(step)
        targets = batch["targets"]
        flags = np.vectorize(lambda t: table.get(int(t), True))(targets)
        zero = batch["targets_segmentation"] == 0
        # untrained targets (and only they) have segment 0; the eod is trained
        assert np.array_equal(zero, ~flags & (targets != EOD))
        assert (batch["inputs_segmentation"] > 0).all()  # attention is untouched by the mask


def test_config_keys_are_checked(tmp_path: Path) -> None:
    store = write_masked_store(tmp_path / "s", [[(8, 3)] * 20])
    with pytest.raises(ConfigError, match=r"sources\.sft\.packing: expected concat or best_fit"):
        parse_config(_config(store.path, 8, 2, 1, packing="first_fit"))
    with pytest.raises(ConfigError, match=r"sources\.sft\.too_long: expected truncate or drop"):
        parse_config(_config(store.path, 8, 2, 1, too_long="wrap"))


def _mixed_plan(tmp_path: Path) -> tuple[Plan, Path]:
    sft = write_masked_store(tmp_path / "sft", [[(6 + i % 11, 2) for i in range(30)]] * 2)
    text = write_synthetic_store(tmp_path / "text", [[300, 200], [400]])
    config = {
        "seq_len": 16,
        "global_batch_size": 4,
        "lanes": 2,
        "sources": {
            "text": {"path": str(text.path)},
            "sft": {"path": str(sft.path), "packing": "best_fit", "too_long": "drop"},
        },
        "mix": {"text": 1, "sft": 1},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return Plan.from_config(parse_config(config)), path


def test_audit_checks_whole_documents_and_each_document_once(tmp_path: Path) -> None:
    plan, _ = _mixed_plan(tmp_path)
    report = audit(plan, 0, 60)
    assert report.ok, report.violations
    assert report.document_epochs["sft"] >= 2
    assert report.packing["sft"].rows == 2 * plan.segment_plan(0).layouts["sft"].windows_per_lane
    # A packing that uses a document twice (and leaves one out) is caught.
    layout = plan.segment_plan(0).layouts["sft"]
    layout.row_docs = layout.row_docs.copy()  # the packing is shared read-only
    layout.row_docs[1] = layout.row_docs[0]
    report = audit(plan, 0, 60, process_counts=[1])
    assert any("each is used exactly once per epoch" in v for v in report.violations)


def test_cli_inspect_epochs_and_verify_describe_best_fit(tmp_path: Path, capsys) -> None:
    plan, config = _mixed_plan(tmp_path)
    assert main(["inspect", str(config), "--step", "0"]) == 0
    out = capsys.readouterr().out
    assert "packed row" in out and "trained 2.." in out and "padding:" in out
    assert main(["epochs", str(config)]) == 0
    out = capsys.readouterr().out
    header, *lines = out.splitlines()
    assert header.split()[1] == "rows/lane"  # a best_fit source's epoch is packed rows
    sft = next(line.split() for line in lines if line.startswith("sft "))
    assert sft[1] == f"{plan.segment_plan(0).layouts['sft'].windows_per_lane:,}"
    assert "best_fit: " in out and "rows per epoch of 60 documents" in out
    assert main(["verify", str(config), "--steps", "0:40", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "every document once in" in out and "outside whole-document row tails" in out
