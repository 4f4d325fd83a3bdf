"""Taking documents down (`sources.NAME.exclude`): checked by content on a real store of
documents of random letters, each recorded with its id (`prepare --id-field`)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import DataConfig, load_config, parse_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.plan.ledger import Ledger
from pipeline.plan.resume import reconcile
from pipeline.read.audit import audit
from pipeline.read.plan import Plan

DOCUMENTS = 70
STEPS = 48


def _texts() -> dict[str, str]:
    rng = random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return {
        f"doc-{i}": "".join(rng.choice(letters) for _ in range(rng.randint(6, 40)))
        for i in range(DOCUMENTS)
    }


TEXTS = _texts()
BY_CONTENT = {text.encode(): name for name, text in TEXTS.items()}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exclude")
    lines = root / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in TEXTS.items()))
    options = PrepareOptions([str(lines)], root / "store", num_shards=3, id_field="id")
    return prepare(options)["train"]


def raw_config(store: Path, lanes: int = 2, **source: object) -> dict:
    return {
        "seed": 3, "seq_len": 64, "lanes": lanes, "global_batch_size": 2 * lanes,
        "sources": {"web": {"path": str(store), "packing": "best_fit", **source}},
        "mix": {"web": 1},
    }  # fmt: skip


def excluding(store: Path, file: Path, ids: list[str], lanes: int = 2, **entry) -> DataConfig:
    file.write_text("# taken down\n\n" + "".join(f"{i}\n" for i in ids))
    exclude = {"file": str(file), **entry} if entry else str(file)
    return parse_config(raw_config(store, lanes, exclude=exclude), origin="excluding.yaml")


def served(plan: Plan, step: int) -> list[tuple[int, str]]:
    """(epoch, document id) of each document in the rows of `step`, found by its content."""
    draws = plan.draws(step)
    batch = plan.read(draws)
    out = []
    for row, epoch in enumerate(draws.epoch.tolist()):
        segments, tokens = batch["inputs_segmentation"][row], batch["inputs"][row]
        for k in np.unique(segments[segments > 0]).tolist():
            content = bytes(tokens[segments == k].astype(np.uint8).tolist())
            out.append((epoch, BY_CONTENT[content]))
    return out


# up to two take-downs, each growing the last: (steps after the previous switch, ids added)
takedowns = st.lists(
    st.tuples(st.integers(1, 9), st.sets(st.integers(0, DOCUMENTS - 1), min_size=1, max_size=6)),
    min_size=1,
    max_size=2,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(takedowns, st.sampled_from([1, 2]))
def test_excluded_documents_never_appear_after_the_switch_and_the_rest_once_per_epoch(
    store, tmp_path, steps, lanes
):
    plan = Plan.from_config(parse_config(raw_config(store, lanes), origin="run.yaml"))
    unchanged = plan
    switches, ids, step = [], set(), 0
    for number, (gap, added) in enumerate(steps):
        step += gap
        ids |= {f"doc-{i}" for i in added}
        config = excluding(store, tmp_path / f"takedown{number}.txt", sorted(ids), lanes)
        plan = Plan(reconcile(plan, config, step, switch=True))
        switches.append((step, set(ids)))
    for t in range(switches[0][0]):  # the steps before the first switch are unchanged
        for field, values in unchanged.batch(t).items():
            np.testing.assert_array_equal(plan.batch(t)[field], values, err_msg=f"step {t}")
    per_epoch: dict[int, Counter] = {}
    for t in range(STEPS):
        for epoch, name in served(plan, t):
            per_epoch.setdefault(epoch, Counter())[name] += 1
            for at, taken in switches:
                assert not (t >= at and name in taken), f"{name} served at step {t} after {at}"
    final = switches[-1][1]
    last = max(per_epoch)
    assert last >= 3  # the range rolls over several whole epochs after the switches
    for epoch, counts in per_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch} serves a document twice"
        if epoch < last:  # complete: every document not taken down, exactly once
            assert set(TEXTS) - final <= set(counts), f"epoch {epoch} lost a document"


def test_an_unknown_id_is_one_line_naming_the_file_and_line_unless_ignored(store, tmp_path):
    file = tmp_path / "takedown.txt"
    plan = Plan.from_config(parse_config(raw_config(store), origin="run.yaml"))
    with pytest.raises(ConfigError) as error:
        reconcile(plan, excluding(store, file, ["doc-1", "no-such-doc", "doc-2"]), 4, switch=True)
    assert str(error.value) == (
        f"excluding.yaml: {file} line 4: document id 'no-such-doc' is not in the store of "
        f"sources.web ({store}); remove the line, or set sources.web.exclude: "
        "{file: ..., missing: ignore}"
    )
    config = excluding(store, file, ["doc-1", "no-such-doc", "doc-2"], missing="ignore")
    after = Plan(reconcile(plan, config, 4, switch=True))
    names = {name for t in range(4, STEPS) for _, name in served(after, t)}
    assert not names & {"doc-1", "doc-2"} and len(names) == DOCUMENTS - 2


def test_a_fresh_run_that_excludes_never_serves_them(store, tmp_path):
    config = excluding(store, tmp_path / "t.txt", ["doc-0", "doc-9", '"doc-33"'], lanes=1)
    plan = Plan.from_config(config)
    counts = Counter(name for t in range(STEPS) for epoch, name in served(plan, t) if epoch == 0)
    assert set(counts) == set(TEXTS) - {"doc-0", "doc-9", "doc-33"}
    assert set(counts.values()) == {1}


def test_what_cannot_exclude_is_refused_by_name(store, tmp_path):
    file = tmp_path / "t.txt"
    file.write_text("doc-1\n")
    bad = tmp_path / "bad.txt"
    bad.write_text('doc-1\n"unterminated\n')
    with pytest.raises(ConfigError, match=r"bad\.txt line 2: a line that starts with"):
        parse_config(raw_config(store, exclude=str(bad)), origin="c.yaml")
    with pytest.raises(ConfigError, match=r"sources\.web\.exclude\.missing: expected error or"):
        parse_config(raw_config(store, exclude={"file": str(file), "missing": "skip"}), "c.yaml")
    plain = tmp_path / "plain"
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"text": "some text"}) + "\n")
    prepare(PrepareOptions([str(lines)], plain, num_shards=1, progress=False))
    with pytest.raises(ConfigError, match=r"records no document ids; prepare it with --id-field"):
        Plan.from_config(parse_config(raw_config(plain, exclude=str(file)), origin="c.yaml"))


def test_the_ledger_records_the_exclusion_and_refuses_an_edited_file(store, tmp_path):
    plan = Plan.from_config(parse_config(raw_config(store), origin="run.yaml"))
    assert plan.ledger.to_json()["version"] == 3  # without exclusions: as before
    file = tmp_path / "takedown.txt"
    ledger = reconcile(plan, excluding(store, file, ["doc-4"]), 6, switch=True)
    raw = ledger.to_json()
    assert raw["version"] == 6
    again = Ledger.from_json(json.loads(json.dumps(raw)))
    assert Plan(again).batch(10)["inputs"].tolist() == Plan(ledger).batch(10)["inputs"].tolist()
    assert ledger.entry(1).startswith(f"exclude sources.web: the ids of {file} (sha256 ")
    file.write_text("doc-5\n")
    with pytest.raises(LedgerError, match=r"takedown\.txt changed since it was recorded"):
        Plan(Ledger.from_json(raw)).batch(10)


def test_the_cli_names_an_exclude_file_edited_since_the_ledger_recorded_it(store, tmp_path, capsys):
    """`--ledger` with the config that names the edited file (the run's current config): the
    file's change is named, not "this data config is none of the segments" (another run's?)."""
    from pipeline.commands.cli import main

    file = tmp_path / "takedown.txt"
    plan = Plan.from_config(parse_config(raw_config(store), origin="run.yaml"))
    ledger = reconcile(plan, excluding(store, file, ["doc-4"]), 6, switch=True)
    (tmp_path / "ledger.json").write_text(json.dumps(ledger.to_json()))
    config_file = tmp_path / "data.yaml"
    config_file.write_text(yaml.safe_dump(raw_config(store, exclude=str(file))))
    file.write_text("doc-5\n")
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", str(tmp_path / "ledger.json")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert error.startswith("error: ledger segment 1 (from step 6): the recorded config is ")
    assert f"{file} changed since it was recorded" in error


def test_a_restore_that_takes_documents_down_serves_the_plan_and_the_cli_replays_it(
    store, tmp_path, capsys
):
    """Through a real Orbax checkpoint: saved at step 6, restored with `DataRestore(feed,
    switch=True)` under a config that excludes three documents; the feed never serves them,
    and `pipeline dump/verify/stages/inspect --ledger` of a later checkpoint replay it."""
    from pipeline.commands.cli import main
    from tests.test_checkpoint import assert_dump_replays, switched_through_orbax

    switch, taken = 6, ["doc-2", "doc-11", "doc-50"]
    before = parse_config(raw_config(store), origin="run.yaml")
    after = excluding(store, tmp_path / "takedown.txt", taken)
    config_file = tmp_path / "data.yaml"
    config_file.write_text(
        yaml.safe_dump(raw_config(store, exclude=str(after.sources[0].exclude.file)))
    )
    expected = Plan(reconcile(Plan.from_config(before), after, switch, switch=True))
    directory = tmp_path / "ckpt"
    served_inputs = switched_through_orbax(directory, before, after, switch, expected, 8)
    for step in range(switch, switch + 8):  # what the feed served (equal to these) by content
        assert not {name for _, name in served(expected, step)} & set(taken)
    step_dir = str(directory / str(switch + 8))
    assert_dump_replays(config_file, step_dir, switch, served_inputs)
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", step_dir]) == 0
    assert (
        f"ledger segment from step 6: exclude sources.web: the ids of {tmp_path / 'takedown.txt'}"
        in capsys.readouterr().out
    )
    assert main(["verify", str(config_file), "--ledger", step_dir, "--steps", "0:40"]) == 0
    assert "ok: no window repeats" in capsys.readouterr().out
    assert main(["inspect", str(config_file), "--ledger", step_dir, "--step", "7"]) == 0
    shown = capsys.readouterr().out
    ids = {name for _, name in served(expected, 7)}
    assert ids and all(f"id '{name}'" in shown for name in ids)


def test_dropping_an_exclusion_brings_the_documents_back_once(store, tmp_path):
    plan = Plan.from_config(parse_config(raw_config(store), origin="run.yaml"))
    taken = {"doc-7", "doc-8", "doc-30", "doc-64"}
    plan = Plan(
        reconcile(plan, excluding(store, tmp_path / "t.txt", sorted(taken)), 3, switch=True)
    )
    plan = Plan(
        reconcile(plan, parse_config(raw_config(store), origin="back.yaml"), 5, switch=True)
    )
    per_epoch: dict[int, Counter] = {}
    for t in range(STEPS):
        for epoch, name in served(plan, t):
            per_epoch.setdefault(epoch, Counter())[name] += 1
            assert not (3 <= t < 5 and name in taken), f"{name} served at step {t}"
    assert {name for t in range(5, 12) for _, name in served(plan, t)} & taken
    for epoch in range(max(per_epoch)):  # complete epochs: every document exactly once
        assert per_epoch[epoch] == Counter(dict.fromkeys(TEXTS, 1)), f"epoch {epoch}"


def test_the_exclude_file_format_and_its_config_keys(store, tmp_path):
    file = tmp_path / "ids.txt"
    file.write_text('# a comment\n\n  doc-1  \n"doc-2"\n"# not a comment"\n\tdoc-3\n')
    config = parse_config(raw_config(store, exclude=str(file)), origin="c.yaml")
    exclude = config.sources[0].exclude
    assert list(exclude.ids()) == [(3, "doc-1"), (4, "doc-2"), (5, "# not a comment"), (6, "doc-3")]
    assert exclude.missing == "error" and exclude.to_json()["sha256"] == exclude.sha256
    pinned = {"file": str(file), "sha256": exclude.sha256, "missing": "ignore"}
    assert parse_config(raw_config(store, exclude=pinned), "c.yaml").sources[0].exclude.missing == (
        "ignore"
    )
    with pytest.raises(ConfigError, match=r"c\.yaml: sources\.web\.exclude\.sha256: .* changed"):
        parse_config(raw_config(store, exclude={**pinned, "sha256": "0" * 64}), "c.yaml")
    with pytest.raises(ConfigError, match=r"sources\.web\.exclude: .*cannot read the exclude"):
        parse_config(raw_config(store, exclude=str(tmp_path / "absent.txt")), "c.yaml")
    with pytest.raises(ConfigError, match=r"sources\.web\.exclude\.sort: unknown key"):
        parse_config(raw_config(store, exclude={"file": str(file), "sort": 1}), "c.yaml")
    written = tmp_path / "data.yaml"  # a file name is relative to the config file
    written.write_text(yaml.safe_dump(raw_config(store, exclude="ids.txt")))
    assert load_config(written).sources[0].exclude.file == file


def _concat_edges(plan: Plan, step: int) -> list[tuple[int, int, int]]:
    """(epoch, shard, token) of each edge (a token and the next, inside one piece of the
    store) the concat windows of `step` serve."""
    draws = plan.draws(step)
    layout = plan.segment_plan(draws.segment_index).layouts["web"]
    out = []
    for epoch, start in zip(draws.epoch.tolist(), draws.start.tolist()):
        for shard, lo, hi in layout.pieces(epoch, start, start + layout.seq_len + 1):
            out.extend((epoch, shard, t) for t in range(lo, hi - 1))
    return out


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_concat_source_never_serves_them_and_serves_the_rest_once_per_epoch(
    store, tmp_path, lanes
):
    raw = raw_config(store, lanes)
    del raw["sources"]["web"]["packing"]
    raw["seq_len"] = 16
    run = Plan.from_config(parse_config(raw, origin="run.yaml"))
    taken, switch = ["doc-5", "doc-21", "doc-22", "doc-60"], 4
    file = tmp_path / "takedown.txt"
    file.write_text("".join(f"{i}\n" for i in taken))
    raw["sources"]["web"]["exclude"] = str(file)
    plan = Plan(reconcile(run, parse_config(raw, origin="concat.yaml"), switch, switch=True))
    for t in range(switch):
        np.testing.assert_array_equal(plan.batch(t)["inputs"], run.batch(t)["inputs"])
    # a second take-down in the middle of a regular epoch of the first one's layout
    later, more = 100 // lanes, ["doc-40", "doc-41"]
    file = tmp_path / "takedown2.txt"
    file.write_text("".join(f"{i}\n" for i in taken + more))
    raw["sources"]["web"]["exclude"] = str(file)
    plan = Plan(reconcile(plan, parse_config(raw, origin="more.yaml"), later, switch=True))
    assert plan.segment_plan(2).layouts["web"].transition is not None
    stop = 240 // lanes
    for t in range(switch, stop):  # by content: no 5 letters of a taken-down document
        gone = taken + more if t >= later else taken
        excluded = {TEXTS[i][k : k + 5] for i in gone for k in range(len(TEXTS[i]) - 4)}
        for row in plan.batch(t)["inputs"]:
            text = bytes(np.where(row < 256, row, ord("|")).astype(np.uint8).tolist()).decode()
            assert not any(text[k : k + 5] in excluded for k in range(len(text) - 4)), t
    edges = Counter(e for t in range(stop) for e in _concat_edges(plan, t))
    assert max(edges.values()) == 1  # no edge twice in an epoch, across the switch
    report = audit(plan, 0, stop)  # what `pipeline verify --ledger` checks
    assert report.ok, report.violations
    st = plan.store(plan.segment_plan(0).layouts["web"].meta)
    ids = {s: st.document_ids(s) for s in range(st.num_shards)}
    inside = [
        (s, t)
        for s, names in ids.items()
        for d, name in enumerate(names)
        if name not in taken + more
        for t in range(int(st.doc_offsets(s)[d]), int(st.doc_offsets(s)[d + 1]) - 1)
    ]
    last = max(epoch for epoch, _, _ in edges)
    assert last >= 3
    for epoch in range(last):  # complete: every edge inside a kept document, but the tails
        served_here = {(s, t) for e, s, t in edges if e == epoch}
        missed = [edge for edge in inside if edge not in served_here]
        # the lane tails (< lanes * seq_len) of the epoch and of a transitional one before it,
        # and the edges a window loses where the stream joins runs (one per joint it spans)
        assert len(missed) < 2 * lanes * 16 + 4 * 16, (epoch, len(missed))
    for t in range(switch, stop):
        for _, s, token in _concat_edges(plan, t):
            d = int(np.searchsorted(st.doc_offsets(s), token, side="right")) - 1
            assert ids[s][d] not in (taken + more if t >= later else taken), (t, ids[s][d])


def test_a_relative_exclude_file_is_recorded_absolute_so_the_ledger_replays_anywhere(
    store, tmp_path, monkeypatch
):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ids.txt").write_text("doc-3\n")
    (tmp_path / "run" / "data.yaml").write_text(
        yaml.safe_dump(raw_config(store, exclude="ids.txt"))
    )
    monkeypatch.chdir(tmp_path / "run")
    plan = Plan.from_config(load_config("data.yaml"))  # the config named relative to the cwd
    recorded = plan.ledger.last.config["sources"]["web"]["exclude"]["file"]
    assert recorded == str(tmp_path / "run" / "ids.txt")
    monkeypatch.chdir(tmp_path)  # `pipeline dump --ledger` from elsewhere
    ledger = Ledger.from_json(json.loads(json.dumps(plan.ledger.to_json())))
    np.testing.assert_array_equal(Plan(ledger).batch(0)["inputs"], plan.batch(0)["inputs"])
    with pytest.raises(ConfigError, match=r"sources\.web\.exclude: relative path 'ids\.txt' in a "):
        parse_config(raw_config(store, exclude="ids.txt"), origin="gs://b/c.yaml", base_dir=None)


def test_an_exclude_file_splits_ids_at_line_ends_only_and_passes_a_byte_order_mark(store, tmp_path):
    file = tmp_path / "ids.txt"  # Windows Notepad: a BOM and CRLF; old Mac: CR alone
    file.write_bytes("\ufeffdoc-1\r\ndoc-2\rdoc-3\n doc\u20284 \ndoc\x855\x0c6\n".encode())
    exclude = parse_config(raw_config(store, exclude=str(file)), origin="c.yaml").sources[0].exclude
    assert list(exclude.ids()) == [
        (1, "doc-1"), (2, "doc-2"), (3, "doc-3"), (4, "doc\u20284"), (5, "doc\x855\x0c6")
    ]  # fmt: skip


plain_ids = (
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters='\r\n"#'), min_size=1)
    .map(str.strip)
    .filter(bool)
)
any_ids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(st.tuples(st.one_of(plain_ids, any_ids), st.booleans()), max_size=8),
    end=st.sampled_from(["\n", "\r\n", "\r"]),
    bom=st.booleans(),
)
def test_an_exclude_file_gives_back_the_ids_written_to_it(tmp_path, lines, end, bom):
    """Each id written as a line (plain, or as a JSON string), with any line end, blank and
    comment lines between and white space around, is read back whole, at its line."""
    from pipeline.config.exclude import parse_exclude

    text, expected = "\ufeff" if bom else "", []
    for number, (document_id, quoted) in enumerate(lines):
        plain = document_id == document_id.strip() and document_id[0] not in '"#'
        plain = plain and not {"\r", "\n"} & set(document_id) and not quoted
        line = document_id if plain else json.dumps(document_id)
        text += f"# {number}{end}{end} {line}\t{end}"
        expected.append((3 * number + 3, document_id))
    file = tmp_path / "ids.txt"
    file.write_bytes(text.encode())
    spec = parse_exclude(str(file), "exclude", None, lambda key, why: ConfigError(why))
    assert list(spec.ids()) == expected


def test_a_moved_run_directory_finds_its_exclude_file_by_content(store, tmp_path, capsys):
    """Stores, configs and the exclude file moved together (the file beside the config, same
    SHA-256): the ledger's recorded absolute path is gone, and the file is found by its digest,
    as stores are by their fingerprint, so `dump/verify/stages --ledger` replay the run."""
    import shutil

    from pipeline.commands.cli import main

    run = tmp_path / "run"
    shutil.copytree(store, run / "store")
    (run / "ids.txt").write_text("doc-3\ndoc-40\n")
    (run / "base.yaml").write_text(yaml.safe_dump(raw_config(Path("store"))))
    (run / "data.yaml").write_text(yaml.safe_dump(raw_config(Path("store"), exclude="ids.txt")))
    ledger = reconcile(Plan.from_config(load_config(run / "base.yaml")),
                       load_config(run / "data.yaml"), 6, switch=True)  # fmt: skip
    (run / "ledger.json").write_text(json.dumps(ledger.to_json()))
    expected = Plan(ledger).batch(9)["inputs"]
    moved = tmp_path / "moved"
    run.rename(moved)
    for config in ("data.yaml", "base.yaml"):  # the file the config names, or one beside it
        args = [str(moved / config), "--ledger", str(moved / "ledger.json")]
        assert main(["dump", *args, "--steps", "9:10", "--out", str(tmp_path / "d.npz")]) == 0
        np.testing.assert_array_equal(np.load(tmp_path / "d.npz")["inputs"][0], expected)
        assert main(["verify", *args, "--steps", "0:20"]) == 0
        assert main(["stages", *args]) == 0
    from pipeline.feed.data_feed import DataFeed
    from pipeline.feed.restore import restore_state
    from pipeline.plan.data_state import DataState
    from tests.test_checkpoint import mesh

    with DataFeed(load_config(moved / "data.yaml"), mesh()) as feed:  # a restore, moved
        restore_state(feed, DataState(9, Ledger.from_json(ledger.to_json())))
        np.testing.assert_array_equal(np.asarray(next(feed)["inputs"]), expected)
    (moved / "ids.txt").write_text("doc-3\n")  # another file of that name is not the file
    assert main(["stages", str(moved / "base.yaml"), "--ledger", str(moved / "ledger.json")]) == 2
    assert "cannot read the exclude file" in capsys.readouterr().err


@pytest.mark.parametrize("fresh", [True, False])
def test_a_takedown_never_forces_a_geometry_change(store, tmp_path, fresh):
    """Every row holds one document (seq_len 4 truncates each), 70 rows over 2 lanes; taking
    one down leaves 69, which no moving of documents evens out: the last row is left out of the
    epochs (as a transitional epoch leaves its tail) instead of the config being refused."""
    short = {"seq_len": 4}
    before = parse_config({**raw_config(store), **short}, origin="run.yaml")
    file = tmp_path / "t.txt"
    file.write_text("doc-4\n")
    after = parse_config({**raw_config(store, exclude=str(file)), **short}, origin="t.yaml")
    plan = (
        Plan.from_config(after)
        if fresh
        else Plan(reconcile(Plan.from_config(before), after, 5, switch=True))
    )
    layout = plan.segment_plan(len(plan.ledger.segments) - 1).layouts["web"]
    excluded = set(layout.excluded.documents.tolist())
    assert len(excluded) == 1
    for epoch in (1, 2):
        documents = layout.documents_of(layout.epoch_rows(epoch)).tolist()
        assert len(documents) == len(set(documents)) == DOCUMENTS - 2
        assert not excluded & set(documents)
    assert audit(plan, 0, 80).ok


def test_an_edited_exclude_file_is_reported_once_by_its_segment(store, tmp_path, capsys, caplog):
    """Three segments (a take-down at 6, another switch at 10 that keeps it): the file edited
    since is one line naming the segment that recorded it, not a warning that a later
    segment's counters were not re-derived and then the error."""
    from pipeline.commands.cli import main

    file = tmp_path / "takedown.txt"
    plan = Plan.from_config(parse_config(raw_config(store), origin="run.yaml"))
    taken = excluding(store, file, ["doc-4"])
    ledger = reconcile(plan, taken, 6, switch=True)
    bigger = {**raw_config(store, exclude=str(file)), "global_batch_size": 8}
    more = parse_config(bigger, origin="more.yaml")
    ledger = reconcile(Plan(ledger), more, 10, switch=True)
    (tmp_path / "ledger.json").write_text(json.dumps(ledger.to_json()))
    config_file = tmp_path / "data.yaml"
    config_file.write_text(yaml.safe_dump(bigger))
    file.write_text("doc-5\n")
    capsys.readouterr()
    caplog.clear()
    assert main(["stages", str(config_file), "--ledger", str(tmp_path / "ledger.json")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not re-derived" not in error, error
    assert error.startswith("error: ledger segment 1 (from step 6): the recorded config is ")
    assert not [r for r in caplog.records if "not re-derived" in r.getMessage()]


def test_exclude_errors_name_the_config_once_and_say_why_in_words(store, tmp_path, capsys):
    """A missing exclude file: `data.yaml: sources.web.exclude: FILE: cannot read the exclude
    file (No such file or directory)`, no errno text; a store without ids: the config once."""
    from pipeline.commands.cli import main
    from pipeline.ingest.prepare import PrepareOptions, prepare

    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump(raw_config(store, exclude="nope.txt")))
    assert main(["stages", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"error: {config}: sources.web.exclude: {tmp_path / 'nope.txt'}: cannot read the "
        "exclude file (No such file or directory)\n"
    )
    (tmp_path / "a.txt").write_text("a document\n" * 30)
    bare = prepare(PrepareOptions([str(tmp_path / "a.txt")], tmp_path / "bare", progress=False))
    (tmp_path / "t.txt").write_text("doc-1\n")
    config.write_text(yaml.safe_dump(raw_config(bare["train"], exclude="t.txt")))
    assert main(["stages", str(config)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {config}: sources.web.exclude: the store ") and (
        error.count(str(config)) == 1
    ), error
