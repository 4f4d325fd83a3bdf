"""Interventions combined in one ledger (docs/steering.md): geometry switches, skips,
take-downs and set mixes, checked by content on synthetic stores whose every token is its
position in the store, so a row tells which tokens (and documents) it serves."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan.data_state import DataState, digest_of, verify, verify_ledger
from pipeline.plan.ledger import Ledger, MixEntry, quantize
from pipeline.plan.resume import reconcile
from pipeline.plan.rows import host_rows
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

WEB = [[20] * 10, [30] * 8]  # concat: doc k of shard s holds its natural positions


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("combined")
    write_synthetic_store(root / "web", WEB, document_ids=True)
    return root


def web_raw(root: Path, seq_len: int = 8, lanes: int = 1, **source: object) -> dict:
    return {
        "seed": 1, "seq_len": seq_len, "lanes": lanes, "global_batch_size": lanes,
        "sources": {"web": {"path": str(root / "web"), **source}}, "mix": {"web": 1},
    }  # fmt: skip


def window_tokens(plan: Plan, step: int) -> list[tuple[int, np.ndarray]]:
    """(epoch, the seq_len + 1 tokens) of each concat window of `step`."""
    draws, batch = plan.draws(step), plan.batch(step)
    return [
        (int(epoch), np.append(batch["inputs"][i], batch["targets"][i][-1]))
        for i, epoch in enumerate(draws.epoch.tolist())
    ]


def test_dropping_a_concat_exclusion_inside_its_epoch_gives_the_rest_back(root, tmp_path):
    """Taken down at step 5, given back at step 10 in the same epoch: the documents' tokens
    not served before the take-down are served in that epoch (docs/steering.md, Limits: "what
    of them had not been served"), so it leaves out no more than its lane tails."""
    file = tmp_path / "t.txt"
    file.write_text("s0-d3\ns1-d2\n")  # tokens 60..79 and 260..289
    plan = Plan.from_config(parse_config(web_raw(root), origin="a.yaml"))
    taken = parse_config(web_raw(root, exclude=str(file)), origin="b.yaml")
    plan = Plan(reconcile(plan, taken, 5, switch=True))
    plan = Plan(reconcile(plan, parse_config(web_raw(root), origin="c.yaml"), 10, switch=True))
    tokens: Counter = Counter()
    step = 0
    while (rows := window_tokens(plan, step))[0][0] == 0:
        tokens.update(rows[0][1].tolist())
        step += 1
    missing = set(range(sum(map(sum, WEB)))) - set(tokens)
    # the lane tails of the epoch and of each of its two transitional streams: < 3 * (8 + 1)
    assert len(missing) < 27, sorted(missing)
    assert {260, 275, 289} <= set(tokens)  # the document not served before step 5


_rng = np.random.default_rng(4)
CHAT = [_rng.integers(3, 40, 30).tolist() for _ in range(2)]  # best_fit: 3 to 40 tokens


@pytest.fixture(scope="module")
def chat(root: Path) -> Path:
    write_synthetic_store(root / "chat", CHAT, document_ids=True)
    return root / "chat"


def two_raw(
    root: Path,
    seq_len: int,
    lanes: int,
    excluded: dict[str, Path],
    present: tuple[str, ...] = ("web", "chat"),
    web: str = "web",
) -> dict:
    """web (concat, from store `web`) and chat (best_fit), those `present`, 4 rows a step,
    each excluding the ids of its file."""
    sources = {
        "web": {"path": str(root / web)},
        "chat": {"path": str(root / "chat"), "packing": "best_fit"},
    }
    for name, file in excluded.items():
        sources[name]["exclude"] = str(file)
    return {
        "seed": 2, "seq_len": seq_len, "lanes": lanes, "global_batch_size": 4,
        "sources": {name: sources[name] for name in present},
        "mix": dict.fromkeys(present, 1),
    }  # fmt: skip


def document_ids(shards: list[list[int]]) -> tuple[np.ndarray, list[str]]:
    """(each document's first token, its id) of a synthetic store, in store order."""
    lengths = [n for shard in shards for n in shard]
    ids = [f"s{s}-d{k}" for s, shard in enumerate(shards) for k in range(len(shard))]
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), ids


WEB_STARTS, WEB_IDS = document_ids(WEB)
CHAT_STARTS, CHAT_IDS = document_ids(CHAT)
WEB_OF_TOKEN = np.repeat(WEB_IDS, [n for shard in WEB for n in shard])
interventions = st.one_of(
    st.tuples(
        st.just("geometry"), st.tuples(st.sampled_from([8, 12, 24]), st.sampled_from([1, 2, 4]))
    ),
    st.tuples(
        st.just("exclude"),
        st.tuples(
            st.sets(st.sampled_from(WEB_IDS), max_size=3),
            st.sets(st.sampled_from(CHAT_IDS), max_size=3),
        ),
    ),
    st.tuples(st.just("skip"), st.integers(1, 6)),
    st.tuples(st.just("mix"), st.integers(1, 5)),
    st.tuples(st.just("leave"), st.sampled_from(["web", "chat"])),  # out, or back in
    st.tuples(st.just("store"), st.just(None)),  # web from the other store (A -> B -> A)
)
WEB2 = 1000  # the first token of store web2, web's same-size twin with other content


@pytest.fixture(scope="module")
def web2(root: Path) -> Path:
    write_synthetic_store(root / "web2", WEB, first=WEB2, document_ids=True)
    return root / "web2"


def steered(root: Path, tmp: Path, ops: list) -> tuple[Plan, list, list[tuple[int, dict]]]:
    """The run steered by `ops` ((steps after the last, intervention)): the plan, (step,
    plan before the intervention at it) of each, and (from step, ids excluded per source)."""
    seq_len, lanes, excluded = 8, 1, {"web": set(), "chat": set()}
    present, web = ("web", "chat"), "web"

    def config(number: int):
        files = {}
        for name, ids in excluded.items():
            if ids and name in present:
                files[name] = tmp / f"{number}-{name}.txt"
                files[name].write_text("".join(f"{i}\n" for i in sorted(ids)))
        raw = two_raw(root, seq_len, lanes, files, present, web)
        return parse_config(raw, origin=f"{number}.yaml")

    plan = Plan.from_config(config(0))
    before, taken, step = [], [(0, {k: set(v) for k, v in excluded.items()})], 0
    for number, (gap, (kind, value)) in enumerate(ops, start=1):
        step = max(1, step + gap)
        before.append((step, plan))
        if kind == "mix":
            weights = {"web": value, "chat": 6 - value}
            weights = quantize({name: weights[name] for name in present})
            plan = Plan(plan.ledger.with_mix(MixEntry(step, weights)), plan.stores())
            continue
        if kind == "geometry":
            seq_len, lanes = value
        elif kind == "exclude":
            excluded = {"web": set(value[0]), "chat": set(value[1])}
        elif kind == "leave":  # the other source stays (or comes back, if it was out)
            present = tuple(n for n in ("web", "chat") if (n in present) != (n == value))
            present = present or tuple(n for n in ("web", "chat") if n != value)
        elif kind == "store":
            web = "web2" if web == "web" else "web"
        skip = value if kind == "skip" else 0
        plan = Plan(reconcile(plan, config(number), step, switch=True, skip=skip))
        taken.append((step, {k: set(v) for k, v in excluded.items()}))
    return plan, before, taken


@settings(max_examples=10, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(ops=st.lists(st.tuples(st.integers(0, 12), interventions), min_size=1, max_size=4))
@example(ops=[(4, ("exclude", ({"s0-d3", "s1-d2"}, {"s0-d1"}))), (5, ("exclude", (set(), set())))])
@example(ops=[(5, ("exclude", ({"s0-d4"}, set()))), (6, ("exclude", (set(), set())))])
@example(ops=[(10, ("leave", "chat")), (10, ("leave", "chat"))])  # out at 10, back at 20
@example(ops=[(10, ("store", None)), (10, ("store", None))])  # web A -> B -> A
@example(  # chat out while seq_len and lanes change and a skip passes over web, then back
    ops=[
        (6, ("leave", "chat")),
        (3, ("geometry", (12, 2))),
        (4, ("skip", 2)),
        (5, ("leave", "chat")),
        (0, ("store", None)),
        (7, ("store", None)),
    ]
)
@example(  # 24 on 2 lanes, taken down at the same step (replacing that segment), a skip, a
    # mix, back to 8 on 1 lane (seq_len and lanes decrease, the first geometry again)
    ops=[
        (3, ("geometry", (24, 2))),
        (0, ("exclude", ({"s0-d1", "s1-d0"}, {"s1-d2"}))),
        (7, ("skip", 3)),
        (2, ("mix", 2)),
        (5, ("geometry", (8, 1))),
    ]
)
def test_interventions_combined_serve_nothing_twice_nothing_taken_down_and_replay(
    root, chat, web2, tmp_path, ops
):
    try:
        plan, before, taken = steered(root, tmp_path, ops)
    except ConfigError:  # best_fit rows that cannot be split evenly over 4 lanes
        reject()
    ledger = Ledger.from_json(json.loads(json.dumps(plan.ledger.to_json())))
    verify_ledger(ledger, Plan(ledger), "steered")  # the counters re-derive
    stop = max(step for step, _ in before) + 40
    report = audit(plan, 0, stop, process_counts=[])  # `pipeline verify --ledger` passes
    assert report.ok, report.violations
    pairs, documents = defaultdict(list), defaultdict(list)
    # per web store and epoch: windows, lane tails per segment, ids excluded at its last draw
    tokens, tails, end = defaultdict(list), defaultdict(dict), {}
    for t in range(stop):
        draws, batch = plan.draws(t), plan.batch(t)
        gone = next(ids for at, ids in reversed(taken) if at <= t)
        for i, (source, epoch) in enumerate(zip(draws.source.tolist(), draws.epoch.tolist())):
            if draws.source_names[source] == "web":
                w = np.append(batch["inputs"][i], batch["targets"][i][-1]).astype(np.int64)
                store = int(w[0] >= WEB2)  # web or its twin web2: positions from 0 in each
                w -= store * WEB2
                pairs[store, epoch].append(w[:-1][w[1:] == w[:-1] + 1])
                tokens[store, epoch].append(w)
                config = plan.segment_plan(draws.segment_index).config
                tails[store, epoch][draws.segment_index] = config.lanes * (config.seq_len + 1)
                end[store, epoch] = gone["web"]
                docs = {WEB_IDS[d] for d in np.searchsorted(WEB_STARTS, w, "right") - 1}
                assert not docs & gone["web"], (t, i, docs & gone["web"])
                continue
            segments, inputs = batch["inputs_segmentation"][i], batch["inputs"][i]
            for k in np.unique(segments[segments > 0]).tolist():
                first = int(inputs[segments == k][0])
                d = int(np.searchsorted(CHAT_STARTS, first, "right")) - 1
                assert CHAT_STARTS[d] == first, (t, i, first)  # a whole document
                assert CHAT_IDS[d] not in gone["chat"], (t, i, CHAT_IDS[d])
                documents[epoch].append(d)
    for key, mine in pairs.items():  # no token pair twice in an epoch of a web store
        flat = np.concatenate(mine)
        assert flat.size == np.unique(flat).size, (key, Counter(flat.tolist()).most_common(3))
    if not any(kind == "skip" for _, (kind, _) in ops):  # a skip leaves windows out
        for (store, epoch), mine in tokens.items():  # rolled over: all but the lane tails
            if (store, epoch + 1) not in tails:
                continue
            every = np.flatnonzero(~np.isin(WEB_OF_TOKEN, list(end[store, epoch])))
            missing = np.setdiff1d(every, np.concatenate(mine)).size
            bound = sum(tails[store, epoch].values()) + min(tails[store, epoch + 1].values())
            assert missing < bound, ("web", store, epoch, missing, bound)
    for epoch, mine in documents.items():
        assert len(mine) == len(set(mine)), ("chat", epoch, Counter(mine).most_common(3))
    for at, earlier in before:  # every step before an intervention replays unchanged
        for t in range(at):
            for name, values in earlier.batch(t).items():
                np.testing.assert_array_equal(plan.batch(t)[name], values, err_msg=f"{t} {name}")
    for at, _ in before:  # a restored host of each process count computes its own rows
        for count in (2, 4):
            lanes = plan.segment_plan_at(at).config.lanes
            if lanes % count and count % lanes:
                continue
            host = Plan(ledger, plan.stores())
            for index in range(count):
                rows = host_rows(4, index, count)
                mine = host.batch(at, rows)
                for name, values in plan.batch(at).items():
                    np.testing.assert_array_equal(mine[name], values[rows], err_msg=f"{at} {name}")


def test_dump_across_a_seq_len_switch_is_refused_by_name_and_dumps_each_side(
    root, tmp_path, capsys
):
    """A step's fields are [rows, seq_len]: a range across a seq_len change cannot stack
    into one array, so it is one line naming the switch, not a traceback."""
    import yaml

    from pipeline.commands.cli import main

    plan = Plan.from_config(parse_config(web_raw(root, 8, 2), origin="a.yaml"))
    raw = web_raw(root, 16, 2)
    plan = Plan(reconcile(plan, parse_config(raw, origin="b.yaml"), 5, switch=True))
    ledger, config = tmp_path / "ledger.json", tmp_path / "data.yaml"
    plan.ledger.save(ledger)
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "d.npz"
    dump = ["dump", str(config), "--ledger", str(ledger), "--out", str(out), "--steps"]
    capsys.readouterr()
    assert main([*dump, "3:7"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--steps 3:7 spans a change of seq_len (8 -> 16 at step 5); dump the steps of each "
            "seq_len separately"
        )
    )
    for steps, width in (("3:5", 8), ("5:7", 16)):
        assert main([*dump, steps]) == 0
        assert np.load(out)["inputs"].shape == (2, 2, width)


@pytest.mark.parametrize("name, ids", [("web", WEB_IDS), ("chat", CHAT_IDS)])
def test_taking_down_every_document_of_a_source_is_refused_by_name(root, chat, tmp_path, name, ids):
    """Not "use a smaller seq_len" or "a larger store": the exclude file is what empties it."""
    file = tmp_path / "all.txt"
    file.write_text("".join(f"{i}\n" for i in ids))
    plan = Plan.from_config(parse_config(two_raw(root, 8, 1, {}), origin="a.yaml"))
    config = parse_config(two_raw(root, 8, 1, {name: file}), origin="b.yaml")
    with pytest.raises(ConfigError) as error:
        reconcile(plan, config, 5, switch=True)
    assert str(error.value) == (
        f"b.yaml: sources.{name}.exclude: {file} takes down every document of "
        f"{root / name} ({len(ids)} documents); leave the source out of the mix instead"
    )


def test_a_take_down_that_leaves_too_few_tokens_says_so_not_that_the_store_is_small(root, tmp_path):
    file = tmp_path / "most.txt"
    file.write_text("".join(f"{i}\n" for i in WEB_IDS[1:]))  # 20 tokens left of 440
    with pytest.raises(ConfigError, match=r"has 20 tokens left once its exclude is taken out for"):
        Plan.from_config(parse_config(web_raw(root, 24, exclude=str(file)), origin="a.yaml"))


def test_an_id_listed_twice_takes_its_document_down_once(root, chat, tmp_path):
    """The same documents as the file that lists it once: the same rows after the switch."""
    once, twice = tmp_path / "once.txt", tmp_path / "twice.txt"
    once.write_text("s0-d1\ns1-d4\n")
    twice.write_text("s0-d1\ns1-d4\n# again\ns0-d1\n")
    plan = Plan.from_config(parse_config(two_raw(root, 8, 2, {}), origin="a.yaml"))
    plans = [
        Plan(reconcile(plan, parse_config(two_raw(root, 8, 2, {"web": f}), "b.yaml"), 5, True))
        for f in (once, twice)
    ]
    for t in range(5, 60):
        a, b = (p.batch(t) for p in plans)
        for name, values in a.items():
            np.testing.assert_array_equal(b[name], values, err_msg=f"step {t} {name}")


def test_a_restore_at_a_huge_step_with_every_intervention_costs_no_steps(root, chat, tmp_path):
    """A skip, a take-down and a seq_len and lanes change at step 10^12 (with a mix before):
    counters and transitional epochs are computed, never replayed step by step, so this is
    milliseconds; the rows are those of the plan's step 10^12 + skip before the switch."""
    file = tmp_path / "t.txt"
    file.write_text("s0-d1\ns1-d3\n")
    big = 10**12
    plan = Plan.from_config(parse_config(two_raw(root, 8, 1, {}), origin="a.yaml"))
    plan = Plan(plan.ledger.with_mix(MixEntry(big - 7, quantize({"web": 1, "chat": 2}))))
    config = parse_config(two_raw(root, 24, 2, {"web": file, "chat": file}), origin="b.yaml")
    steered = Plan(reconcile(plan, config, big, switch=True, skip=5))
    segment = steered.ledger.last
    assert segment.counters == plan.segment_plan(0).counters_at(big + 5)
    verify_ledger(steered.ledger, steered, "steered")
    draws, batch = steered.draws(big + 1), steered.batch(big + 1)
    assert draws.epoch.min() > 10**9 and batch["inputs"].shape == (4, 24)
    web = np.asarray(draws.source_names)[draws.source] == "web"
    assert web.any()
    assert not set(WEB_OF_TOKEN[batch["inputs"][web]].ravel()) & {"s0-d1", "s1-d3"}


def _edit(path: tuple, value: object):
    def apply(raw: dict) -> None:
        *keys, last = path
        for key in keys:
            raw = raw[key]
        if value is None:
            del raw[last]
        else:
            raw[last] = value

    return apply


@pytest.mark.parametrize(
    "edit, message",
    [
        (_edit(("segments", 1, "config", "seq_len"), 24), r"segments\[1\] fingerprint does not"),
        (_edit(("segments", 1, "config", "lanes"), 1), r"segments\[1\] fingerprint does not"),
        (
            _edit(("segments", 1, "config", "sources", "web", "exclude", "sha256"), "0" * 64),
            r"segments\[1\] fingerprint does not",
        ),
        (
            _edit(("segments", 1, "config", "sources", "web", "exclude"), None),
            r"segments\[1\] fingerprint does not",
        ),
        (_edit(("version",), 5), r"segments\[1\] changes seq_len and lanes, which a ledger of"),
        (  # malformed, not a KeyError/TypeError traceback
            _edit(("segments", 1, "config", "sources", "web", "exclude"), "t.txt"),
            r"segments\[1\]\.config\.sources\.web\.exclude is malformed: expected",
        ),
        (
            _edit(("segments", 1, "config", "sources", "web", "exclude", "sha256"), None),
            r"segments\[1\]\.config\.sources\.web\.exclude is malformed: expected",
        ),
        (
            _edit(("segments", 1, "config", "seq_len"), None),
            r"segments\[1\] is malformed: no key 'seq_len'",
        ),
        (_edit(("segments", 1, "config", "sources", "web"), 3), r"segments\[1\] is malformed"),
        (_edit(("segments", 1, "counters", "web"), 17), r"segments\[1\]\.counters\.web: 17 rec"),
    ],
)
def test_an_edited_geometry_or_take_down_is_refused_even_with_its_digest_redone(
    root, chat, tmp_path, edit, message
):
    file = tmp_path / "t.txt"
    file.write_text("s0-d1\n")
    plan = Plan.from_config(parse_config(two_raw(root, 8, 1, {}), origin="a.yaml"))
    config = parse_config(two_raw(root, 16, 2, {"web": file}), origin="b.yaml")
    plan = Plan(reconcile(plan, config, 6, switch=True, skip=2))
    raw = DataState(20, plan.ledger).to_json()
    assert raw["ledger"]["segments"][1]["counters"]["web"] == 16  # what the last edit changes
    edit(raw["ledger"])
    raw["digest"] = digest_of({key: value for key, value in raw.items() if key != "digest"})
    with pytest.raises(LedgerError, match=message):
        state = DataState.from_json(raw, "ckpt/20")
        verify(state, Plan(state.ledger))


def test_verify_tells_two_transitional_epochs_that_end_at_one_counter_apart(root, chat, tmp_path):
    """A geometry switch at step 1, then a take-down at step 9 inside its transitional epoch:
    both transitional packings of chat's epoch 0 end at counter 31, and number their rows
    from the same first row. `pipeline verify` (`audit`) keyed windows by (seq_len, lanes,
    first counter), so it took the second packing's rows for the first's, reported them
    "used again" and the epoch incomplete, and refused a run that serves each document once."""
    plan, _, _ = steered(
        root, tmp_path, [(0, ("geometry", (8, 2))), (8, ("exclude", (set(), {"s0-d1"})))]
    )
    layouts = [plan.segment_plan(i).layouts["chat"] for i in (1, 2)]
    assert layouts[0].first_counter == layouts[1].first_counter  # the case, still
    report = audit(plan, 0, 49, process_counts=[])
    assert report.ok, report.violations
    assert report.epochs_completed["chat"] >= 1
