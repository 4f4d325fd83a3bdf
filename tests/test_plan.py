"""Properties of the data plan over random configs and random synthetic stores."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import DataConfig, parse_config
from pipeline.plan.draws import DrawSummary
from pipeline.plan.row_layout import DOCUMENTS, WINDOWS, SourceKinds, by_kind
from pipeline.plan.rows import host_rows
from pipeline.read.plan import READERS, Plan, _readers
from tests.storegen import doc_starts, synthetic_meta, write_synthetic_store

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))

shard_lists = st.lists(
    st.lists(st.integers(1, 40), min_size=0, max_size=8), min_size=1, max_size=4
).filter(lambda shards: sum(map(sum, shards)) >= 120)


@st.composite
def setups(draw, sources=1):
    lanes = draw(st.sampled_from([1, 2, 4]))
    rows_per_lane = draw(st.integers(1, 3))
    return {
        "seed": draw(st.integers(0, 2**31)),
        "seq_len": draw(st.integers(1, 12)),
        "lanes": lanes,
        "global_batch_size": lanes * rows_per_lane,
        "shards": [draw(shard_lists) for _ in range(sources)],
        "record_tokens": draw(st.sampled_from([1, 5, 2048])),  # documents span records
    }


def config_of(directory: Path, setup: dict, mix: dict | None = None, stages=None) -> DataConfig:
    """The data config of `setup`, its source sN's store at directory/sN."""
    names = [f"s{i}" for i in range(len(setup["shards"]))]
    raw = {k: setup[k] for k in ("seed", "seq_len", "lanes", "global_batch_size")}
    raw["sources"] = {name: {"path": str(directory / name)} for name in names}
    if stages is not None:
        raw["stages"] = stages
    else:
        raw["mix"] = mix or dict.fromkeys(names, 1)
    return parse_config(raw, origin="test.yaml")


def build(directory: Path, setup: dict, mix: dict | None = None, stages=None) -> Plan:
    """The plan of `setup` over real stores written to `directory`."""
    for i, shards in enumerate(setup["shards"]):
        write_synthetic_store(directory / f"s{i}", shards, setup.get("record_tokens", 2048))
    return Plan.from_config(config_of(directory, setup, mix, stages))


def plan_of(setup: dict, mix: dict | None = None, stages=None) -> Plan:
    """The plan of `setup` from store metadata alone: draws only, nothing written or read."""
    config = config_of(Path("/nonexistent"), setup, mix, stages)
    metas = {
        s.name: synthetic_meta(s.path, setup["shards"][int(s.name[1:])]) for s in config.sources
    }
    return Plan.from_config(config, metas)


def epoch_stream(plan: Plan, name: str, epoch: int) -> np.ndarray:
    layout = plan.segment_plan(0).layouts[name]
    starts = layout.meta.shard_starts
    return np.concatenate([np.arange(starts[s], starts[s + 1]) for s in layout.shard_order(epoch)])


@SETTINGS
@given(setups(sources=2), st.integers(0, 60))
def test_store_metadata_alone_gives_the_plan_of_the_written_stores(setup, step):
    with tempfile.TemporaryDirectory() as tmp:
        written = build(Path(tmp), setup, mix={"s0": 2, "s1": 1})
        planned = plan_of(setup, mix={"s0": 2, "s1": 1})
        for got, want in ((planned.draws(s), written.draws(s)) for s in (step, 10**9 + step)):
            for name in ("lane", "stage", "source", "counter", "epoch", "window", "start"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        for name in ("s0", "s1"):
            meta = planned.segment_plan(0).layouts[name].meta
            assert not meta.path.exists()
            want = written.segment_plan(0).layouts[name].meta
            np.testing.assert_array_equal(meta.shard_tokens, want.shard_tokens)


@SETTINGS
@given(setups())
def test_same_config_gives_identical_batches_in_any_call_order(setup):
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup)
        again = build(Path(tmp) / "again", setup)
        steps = [5, 0, 3, 10**6, 1]
        first = {step: plan.batch(step) for step in steps}
        for step in reversed(steps):
            for field, value in again.batch(step).items():
                np.testing.assert_array_equal(value, first[step][field])


@SETTINGS
@given(setups(sources=2), st.data())
def test_hosts_together_produce_the_single_host_batch(setup, data):
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup)
        step = data.draw(st.integers(0, 50))
        whole = plan.batch(step)
        batch = setup["global_batch_size"]
        for count in (c for c in (1, 2, 4, 8) if batch % c == 0):
            parts = [plan.batch(step, host_rows(batch, i, count)) for i in range(count)]
            for field, value in whole.items():
                np.testing.assert_array_equal(np.concatenate([p[field] for p in parts]), value)
        rows = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=6))
        for field, value in plan.batch(step, rows).items():
            np.testing.assert_array_equal(value, whole[field][rows])


@SETTINGS
@given(setups())
def test_every_window_is_used_exactly_once_per_epoch_per_lane(setup):
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup)
        layout = plan.segment_plan(0).layouts["s0"]
        windows = layout.windows_per_lane
        seq_len = setup["seq_len"]
        rows_per_lane = setup["global_batch_size"] // setup["lanes"]
        steps = -(-3 * windows // rows_per_lane)  # three epochs and a bit
        seen: dict[tuple[int, int], list[int]] = {}
        for step in range(steps):
            draws = plan.draws(step)
            batch = plan.read(draws)
            for row in range(setup["global_batch_size"]):
                lane, epoch = int(draws.lane[row]), int(draws.epoch[row])
                seen.setdefault((lane, epoch), []).append(int(draws.window[row]))
                stream = epoch_stream(plan, "s0", epoch)
                start = lane * layout.lane_tokens + int(draws.window[row]) * seq_len
                expected = stream[start : start + seq_len + 1]
                np.testing.assert_array_equal(batch["inputs"][row], expected[:-1])
                np.testing.assert_array_equal(batch["targets"][row], expected[1:])
        for (lane, epoch), drawn in seen.items():
            if epoch < 3:
                assert sorted(drawn) == list(range(windows)), (lane, epoch)


@SETTINGS
@given(setups(sources=2), st.integers(0, 40))
def test_segments_and_positions_match_a_naive_reference(setup, step):
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup)
        batch = plan.batch(step)
        draws = plan.draws(step)
        for row in range(setup["global_batch_size"]):
            name = draws.source_names[draws.source[row]]
            starts = set(doc_starts(setup["shards"][int(name[1:])]).tolist())
            window = np.concatenate([batch["inputs"][row], batch["targets"][row][-1:]])
            segment, position, segments, positions = 1, 0, [], []
            for i, token in enumerate(window):
                if i > 0 and int(token) in starts:
                    segment, position = segment + 1, 0
                segments.append(segment)
                positions.append(position)
                position += 1
            assert batch["inputs_segmentation"][row].tolist() == segments[:-1]
            assert batch["targets_segmentation"][row].tolist() == segments[1:]
            assert batch["inputs_position"][row].tolist() == positions[:-1]
            assert batch["targets_position"][row].tolist() == positions[1:]


@SETTINGS
@given(setups(sources=2), st.integers(1, 5), st.integers(1, 5))
def test_no_padding_and_exact_mixture_counts(setup, w0, w1):
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup, mix={"s0": w0, "s1": w1})
        rows_per_lane = setup["global_batch_size"] // setup["lanes"]
        counts = np.zeros((setup["lanes"], 2), dtype=np.int64)
        for step in range(30):
            draws = plan.draws(step)
            batch = plan.read(draws)
            for field in batch.values():
                assert field.shape == (setup["global_batch_size"], setup["seq_len"])
            assert (batch["inputs_segmentation"] > 0).all()
            assert (batch["targets_segmentation"] > 0).all()
            for row in range(setup["global_batch_size"]):
                counts[draws.lane[row], draws.source[row]] += 1
                position = step * rows_per_lane + row % rows_per_lane + 1
                share = position * w0 / (w0 + w1)
                if row % rows_per_lane == rows_per_lane - 1:
                    assert abs(counts[draws.lane[row], 0] - share) <= 0.5 + 1e-9


@SETTINGS
@given(setups(sources=2), st.integers(0, 200), st.integers(1, 5))
def test_a_step_summary_is_the_merge_of_its_row_chunks(setup, step, chunks):
    stages = [{"name": "first", "steps": 3, "mix": {"s0": 1}}, {"name": "then", "mix": {"s1": 1}}]
    plan = plan_of(setup, stages=stages)
    draws = plan.draws(step)
    whole = draws.summary()
    merged = DrawSummary()
    for rows in np.array_split(np.arange(setup["global_batch_size"]), chunks):
        if rows.size:
            merged = merged.merge(plan.draws(step, rows).summary())
    assert merged == whole
    names = [draws.source_names[s] for s in draws.source]
    assert dict(whole.epochs) == {
        name: max(int(e) for n, e in zip(names, draws.epoch) if n == name) for name in set(names)
    }
    assert whole.stage_label == ("first" if step < 3 else "then")
    assert whole.epochs_label == " ".join(f"{n}={e}" for n, e in sorted(whole.epochs.items()))


def test_rows_go_to_the_reader_of_their_layouts_row_kind(monkeypatch):
    """The drawn sources grouped by `row_kind` (`by_kind`), `_readers` hands each kind's
    sources to its entry in `READERS`: a new kind of rows is one entry there, nothing else in
    the read path."""

    def one_each(layouts, open_store, sources, packed, found):
        return [(("each", k), [k]) for k in sources]

    monkeypatch.setitem(READERS, "new", one_each)
    kinds = [WINDOWS, "new", DOCUMENTS, WINDOWS, "new"]
    layouts = [SimpleNamespace(row_kind=kind, meta=k) for k, kind in enumerate(kinds)]
    which = np.array([4, 0, 2, 3, 1, 0, 4])
    grouped = by_kind(SourceKinds(kinds), np.unique(which).tolist(), READERS)
    groups = _readers(layouts, lambda meta: f"store {meta}", which, grouped, False, {})
    rows = {}
    for read, mine in groups:
        sources = set(which[mine].tolist())
        kind = {kinds[k] for k in sources}
        assert len(kind) == 1
        if kind == {"new"}:
            assert read == ("each", sources.pop())
        rows.update(dict.fromkeys(mine.tolist(), sources))
    assert sorted(rows) == list(range(len(which)))
    assert len(groups) == 4  # the windows together, the document source, each "new" source
    only = _readers(
        layouts, None, np.array([3, 0, 3]), by_kind(SourceKinds(kinds), [0, 3]), False, {}
    )
    assert len(only) == 1 and only[0][1] == slice(None)


class Looks(Sequence):
    """A plan's kinds of its sources (`layout_types`, `row_kinds`), counting the sources whose
    kind a step looks at in `seen`."""

    def __init__(self, kinds: Sequence, seen: list[int]) -> None:
        self.kinds, self.seen = kinds, seen

    def __getitem__(self, k):
        self.seen.append(k)
        return self.kinds[k]

    def __len__(self) -> int:
        return len(self.kinds)

    def __getattr__(self, name: str):
        return getattr(self.kinds, name)


def kinds_looked_at(directory: Path, sources: int, mixed: bool, steps: int) -> int:
    """How many sources' kinds `steps` steps of a mixture of `sources` sources (every other one
    `best_fit` when `mixed`) look at, to draw, read (both forms) and list their pieces."""
    names = [f"s{i}" for i in range(sources)]
    raw: dict = {"seed": 3, "seq_len": 16, "lanes": 2, "global_batch_size": 8}
    raw["sources"] = {name: {"path": str(directory / name)} for name in names}
    for name in names[1::2] if mixed else ():
        raw["sources"][name]["packing"] = "best_fit"
    raw["mix"] = dict.fromkeys(names, 1)
    for name in names:
        write_synthetic_store(directory / name, [[5, 17, 9, 12, 3, 16]])
    plan = Plan.from_config(parse_config(raw, origin="test.yaml"))
    segment, seen = plan.segment_plan(0), []
    segment.layout_types = Looks(segment.layout_types, seen)
    segment.row_kinds = Looks(segment.row_kinds, seen)
    for step in range(steps):
        draws = plan.draws(step)
        plan.read(draws)
        plan.read_compact(draws)
        plan.pieces(draws, local=True)
    return len(seen)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_steps_grouping_of_its_sources_by_kind_looks_at_its_rows_not_every_source(
    tmp_path, mixed
):
    """A step groups the sources it draws by their kind of layout and of rows (`by_kind`,
    `compact.form`) without looking at the kind of every source of the mixture: at most each
    drawn source's, once per grouping (4 a step here), whatever the number of sources (the
    design's per-step cost; a plain count over the sources' kinds was one look per source)."""
    steps, rows = 3, 8
    for sources in (4, 64):
        looked = kinds_looked_at(tmp_path / str(sources), sources, mixed, steps)
        assert looked <= 4 * steps * rows, (sources, looked)
