"""The plan commands end to end through `pipeline.commands.cli.main`, including bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.commands.cli import main
from pipeline.config import load_config
from pipeline.plan import data_state
from pipeline.plan.ledger import Ledger, Segment
from pipeline.plan.report import first_draw
from pipeline.plan.resume import reconcile
from pipeline.plan.rows import host_rows
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

SHARDS = {"a": [[30, 50, 20], [40, 60]], "b": [[25, 35, 45, 55]]}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("stores")
    for name, shards in SHARDS.items():
        write_synthetic_store(directory / name, shards)
    return directory


def write_config(directory: Path, stores: Path, **overrides) -> Path:
    raw = {
        "seed": 5,
        "seq_len": 8,
        "global_batch_size": 8,
        "lanes": 2,
        "sources": {name: {"path": str(stores / name)} for name in SHARDS},
        "mix": {"a": 3, "b": 1},
    }
    raw.update(overrides)
    if "stages" in overrides:
        del raw["mix"]
    path = directory / "data.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_rows_sources_and_documents(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, out, _ = run(capsys, "inspect", config, "--step", 7, "--rows", "0,2-3")
    assert code == 0
    plan = Plan.from_config(load_config(config))
    draws = plan.draws(7, [0, 2, 3])
    lines = out.splitlines()
    summary = draws.summary()
    assert f"these rows: stage {summary.stage_label}; epochs {summary.epochs_label}" in lines
    row_lines = [line for line in lines if line.split() and line.split()[0] in {"0", "2", "3"}]
    assert [int(line.split()[0]) for line in row_lines] == [0, 2, 3]
    for line, i in zip(row_lines, range(3)):
        fields = line.split()
        assert fields[1] == str(draws.lane[i])
        assert fields[3] == draws.source_names[draws.source[i]]
        assert int(fields[4]) == draws.epoch[i]
        assert int(fields[5].replace(",", "")) == draws.counter[i]
        assert int(fields[6]) == draws.window[i]
    assert "shard-0000" in out and ".array_record" in out and "tokens" in out
    # the synthetic store's tokens are stream positions: the preview shows them as ids
    layout = plan.segment_plan(0).layouts[draws.source_names[draws.source[0]]]
    shard, lo, hi = layout.pieces(
        int(draws.epoch[0]), int(draws.start[0]), int(draws.start[0]) + 9
    )[0]
    first_token = int(plan.store(layout.meta).read_shard_tokens(shard, lo, hi).tokens[0])
    assert f"'{first_token} " in out


@pytest.mark.parametrize(
    ("batch", "stages_says"),
    [(1, "batch 1, 1 row per lane"), ({"step": {0: 1, 10: 2}}, "2 from step 10 (1 lane)")],
    ids=["constant", "ramp"],
)
def test_counts_of_one_are_singular(tmp_path, stores, capsys, batch, stages_says):
    config = write_config(tmp_path, stores, global_batch_size=batch, lanes=1)
    code, out, _ = run(capsys, "inspect", config, "--step", 0)
    assert code == 0 and "1 row x seq_len 8, 1 lane of 1 row\n" in out
    code, out, _ = run(capsys, "stages", config)
    assert code == 0 and stages_says in out


def test_inspect_rejects_rows_outside_the_batch(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, _, err = run(capsys, "inspect", config, "--step", 0, "--rows", "8")
    assert code == 2 and "row 8" in err and len(err.strip().splitlines()) == 1


def test_dump_writes_host_rows_equal_to_the_plan(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    plan = Plan.from_config(load_config(config))
    parts = []
    for index in range(2):
        out = tmp_path / f"host{index}.npz"
        code, text, _ = run(
            capsys, "dump", config, "--steps", "3:6", "--process-index", index,
            "--process-count", 2, "--out", out,
        )  # fmt: skip
        assert code == 0 and str(out) in text
        data = np.load(out)
        assert data["steps"].tolist() == [3, 4, 5]
        assert data["rows"].tolist() == host_rows(8, index, 2).tolist()
        assert data["inputs"].shape == (3, 4, 8)
        assert data["source_names"].tolist() == ["a", "b"]
        for k, step in enumerate(range(3, 6)):
            batch = plan.batch(step, data["rows"])
            for name, value in batch.items():
                np.testing.assert_array_equal(data[name][k], value)
            draws = plan.draws(step, data["rows"])
            for name in ("source", "epoch", "window"):
                np.testing.assert_array_equal(data[name][k], getattr(draws, name), err_msg=name)
        parts.append(data)
    for k, step in enumerate(range(3, 6)):
        whole = plan.batch(step)
        joined = np.concatenate([p["targets"][k] for p in parts])
        np.testing.assert_array_equal(joined, whole["targets"])


def test_dump_of_a_batch_ramp_takes_one_batch_size_at_a_time(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores, global_batch_size={"step": {0: 4, 5: 8}})
    out = tmp_path / "ramp.npz"
    code, _, err = run(capsys, "dump", config, "--steps", "3:7", "--out", out)
    assert code == 2 and "different global batch sizes [4, 8]" in err
    code, _, _ = run(capsys, "dump", config, "--steps", "5:7", "--out", out)
    assert code == 0 and np.load(out)["inputs"].shape == (2, 8, 8)


def test_dump_across_a_switch_indexes_sources_by_the_files_names(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    plan = Plan.from_config(load_config(config))
    first = plan.ledger.segments[0]
    only_b = dict(first.config, sources={"b": first.config["sources"]["b"]},
                  stages=[{"name": "only-b", "steps": None, "mix": {"b": 1}}])  # fmt: skip
    counters = {"b": plan.segment_plan(0).counters_at(4)["b"]}
    path = tmp_path / "ledger.json"
    Ledger((first, Segment(4, only_b, {"b": first.fingerprints["b"]}, counters))).save(path)
    out = tmp_path / "dump.npz"
    code, _, _ = run(capsys, "dump", config, "--ledger", path, "--steps", "2:6", "--out", out)
    assert code == 0
    data = np.load(out)
    switched = Plan(data_state.load_ledger(path), plan.stores())
    assert data["source_names"].tolist() == ["a", "b"]
    for k, step in enumerate(range(2, 6)):
        draws = switched.draws(step)
        names = [draws.source_names[s] for s in draws.source]
        assert [data["source_names"][s] for s in data["source"][k]] == names
        np.testing.assert_array_equal(data["epoch"][k], draws.epoch)
    assert set(data["source"][2:].reshape(-1).tolist()) == {1}  # b is index 0 of segment 1


def test_dump_rejects_a_process_index_out_of_range(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, _, err = run(
        capsys, "dump", config, "--steps", "0:2", "--process-index", 2, "--process-count", 2,
        "--out", tmp_path / "x.npz",
    )  # fmt: skip
    assert code == 2 and "--process-index 2" in err


def test_verify_passes_a_real_plan(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, out, err = run(capsys, "verify", config, "--steps", "0:12")
    assert code == 0, out
    assert "steps 0..11: 96 rows" in out
    assert "process counts 1, 2" in out
    assert out.strip().splitlines()[-1].startswith("ok:")
    assert "verify" in err  # the tqdm progress bar


def test_verify_of_one_row_says_so_in_the_singular(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores, global_batch_size=1, lanes=1)
    code, out, _ = run(capsys, "verify", config, "--steps", "0:1", "--no-progress")
    assert code == 0 and out.startswith("steps 0..0: 1 row, 1 distinct window checked\n")
    assert "hosts: 1 host plan checked (process counts 1) against" in out


def test_verify_fails_on_a_ledger_whose_counters_go_backwards(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    plan = Plan.from_config(load_config(config))
    first = plan.ledger.segments[0]
    back = {k: max(0, v - 2) for k, v in plan.segment_plan(0).counters_at(6).items()}
    path = tmp_path / "ledger.json"
    Ledger((first, Segment(6, first.config, first.fingerprints, back))).save(path)
    code, _, err = run(
        capsys, "verify", config, "--ledger", path, "--steps", "0:9", "--process-count", 2,
        "--no-progress",
    )  # fmt: skip
    assert code == 2  # the CLI re-derives the counters and refuses the ledger before auditing
    assert "segments[1].counters.a: " in err and "re-derived from segments[0] at step 6" in err
    forged = Ledger((first, Segment(6, first.config, first.fingerprints, back)))
    report = audit(Plan(forged, plan.stores()), 0, 9, [2], progress=False)  # the audit finds it
    assert not report.ok
    assert any(line.startswith("source a") for line in report.violations)


def test_verify_refuses_an_incompatible_process_count(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, _, err = run(capsys, "verify", config, "--steps", "0:2", "--process-count", 3)
    assert code == 2 and "--process-count 3" in err


def test_epochs_bisection_matches_a_linear_scan(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, out, _ = run(capsys, "epochs", config, "--count", 2)
    assert code == 0
    plan = Plan.from_config(load_config(config))
    seg = plan.segment_plan(0)
    windows = {name: seg.layouts[name].windows_per_lane for name in SHARDS}
    found: dict[str, dict[int, tuple[int, int]]] = {name: {} for name in SHARDS}
    step = 0
    while any(len(f) < 2 for f in found.values()):  # a linear scan of lane 0's draws
        draws = plan.draws(step, np.arange(4))
        for row, (s, c) in enumerate(zip(draws.source, draws.counter)):
            name = draws.source_names[s]
            if c % windows[name] == 0 and c // windows[name] in (1, 2):
                found[name].setdefault(int(c // windows[name]), (step, row))
        step += 1
    for name in SHARDS:
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"{windows[name]:,}" in line
        for epoch, (step, row) in found[name].items():
            assert first_draw(plan, 0, name, epoch * windows[name]) == (step, row)
            assert f"{epoch}: {step:,}" + (f" r{row}" if row else "") in line


def test_epochs_of_a_rare_source_at_huge_steps_take_log_time(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores, mix={"a": 1, "b": 1e-9})
    start = time.perf_counter()
    code, _, _ = run(capsys, "epochs", config, "--count", 1)
    assert code == 0 and time.perf_counter() - start < 5
    plan = Plan.from_config(load_config(config))
    windows = plan.segment_plan(0).layouts["b"].windows_per_lane
    step, row = first_draw(plan, 0, "b", windows)
    assert step > 10**9
    draws = plan.draws(step, np.arange(4))
    assert draws.source_names[draws.source[row]] == "b" and draws.counter[row] == windows
    assert plan.segment_plan(0).counters_at(step)["b"] == windows  # not drawn before that step


def test_stages_shows_boundaries_of_an_epochized_stage(tmp_path, stores, capsys):
    stages = [
        {"name": "warm", "steps": 3, "mix": {"a": 1, "b": 1}},
        {"name": "epo", "epochs": {"b": 1}},
        {"name": "rest", "mix": {"a": 1}},
    ]
    config = write_config(tmp_path, stores, stages=stages)
    code, out, _ = run(capsys, "stages", config)
    assert code == 0
    plan = Plan.from_config(load_config(config))
    table = plan.segment_plan(0).table
    epo = table.stages[1]
    assert epo.start == 12
    last = epo.end - 1
    end = f"{last // 4:,}" + (f" r{last % 4 + 1}" if last % 4 != 3 else "")
    line = next(line for line in out.splitlines() if line.split()[:1] == ["epo"])
    assert line.split()[1] == "3" and end in line and "b x1 epochs" in line
    rest = next(line for line in out.splitlines() if line.split()[:1] == ["rest"])
    assert "open" in rest


def test_stages_with_a_ledger_lists_every_segment(tmp_path, stores, capsys, monkeypatch):
    config = write_config(tmp_path, stores)
    plan = Plan.from_config(load_config(config))
    first = plan.ledger.segments[0]
    changed = dict(first.config, stages=[{"name": "only-a", "mix": {"a": 1}}])
    path = tmp_path / "ledger.json"
    counters = plan.segment_plan(0).counters_at(20)
    Ledger((first, Segment(20, changed, first.fingerprints, counters))).save(path)
    code, out, _ = run(capsys, "stages", config, "--ledger", path)
    assert code == 0
    assert "ledger segment from step 0" in out and "ledger segment from step 20" in out
    assert "(19) switched" in out and "only-a" in out
    titles = []
    monkeypatch.setattr(
        "pipeline.commands.plot.plot_mixture", lambda *a, title: titles.append(title)
    )
    assert run(capsys, "plot", config, "--steps", "0:4", "--out", tmp_path / "c.png")[0] == 0
    assert run(capsys, "plot", config, "--ledger", path, "--steps", "0:4", "--out", path)[0] == 0
    later = f"the run of {config.name} and 1 later segment from step 20 (its ledger)"
    assert titles == [config.name, later]


def test_stages_shows_where_a_run_anchored_switch_joins_the_new_layout(tmp_path, stores, capsys):
    stages = [
        {"name": "warm", "steps": 3, "mix": {"a": 1, "b": 1}},
        {"name": "rest", "mix": {"a": {"linear": {0: 1, 40: 3}}, "b": 1}},
    ]
    plan = Plan.from_config(load_config(write_config(tmp_path, stores, stages=stages)))
    (tmp_path / "new").mkdir()
    stages[1]["mix"]["b"] = 2
    ramp = {"step": {0: 8, 30: 16}}
    config = write_config(tmp_path / "new", stores, stages=stages, global_batch_size=ramp)
    reconcile(plan, load_config(config), 25, switch=True).save(tmp_path / "ledger.json")
    code, out, _ = run(capsys, "stages", config, "--ledger", tmp_path / "ledger.json")
    assert code == 0
    header = next(line for line in out.splitlines() if "from step 25" in line)
    assert "batch 8 from step 0, 16 from step 30 (2 lanes)" in header
    assert "stages from step 0 (starts_at: run)" in header
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["rest"]]
    assert rows[0][1:4] == ["3", "(24)", "switched"]
    assert rows[1][1:4] == ["25", "(3)", "open"]  # joined at 25 the stage its config starts at 3
    png = tmp_path / "switch.png"
    code, _, _ = run(capsys, "plot", config, "--ledger", tmp_path / "ledger.json",
                     "--steps", "0:40", "--out", png)  # fmt: skip
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(tmp_path, stores, capsys):
    stages = [
        {"name": "warm", "steps": 10, "mix": {"a": {"linear": {0: 1, 10: 3}}, "b": 1}},
        {"name": "rest", "mix": {"a": 1, "b": 1}},
    ]
    config = write_config(tmp_path, stores, stages=stages)
    out = tmp_path / "plot.png"
    code, text, _ = run(capsys, "plot", config, "--steps", "0:40", "--out", out)
    assert code == 0 and "wrote" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


BAD_CONFIGS = [
    ({"mix": {"a": 1, "zz": 1}}, "mix.zz", "unknown source"),
    ({"sources": {"a": {"path": "/nonexistent/store"}}, "mix": {"a": 1}}, "sources.a.path", ""),
    ({"mix": {"a": -1, "b": 1}}, "mix.a", ">= 0"),
    (
        {"stages": [{"name": "s", "mix": {"a": {"step": {0: 1, 5: 0}}, "b": 0}}]},
        "stages[0].mix",
        "all weights are 0 at step 5",
    ),
    ({"mix": {"a": 0, "b": 0}}, ": mix: all weights", "all weights are 0 at step 0"),
    ({"mix": {"a": {"linear": {10: 1, 0: 2}}, "b": 1}}, "mix.a.linear", "increasing order"),
    ({"global_batch_size": 6, "lanes": 4}, "global_batch_size", "not divisible by lanes"),
    ({"seq_len": 10_000}, "sources.", "seq_len 10000"),
    ({"seq_len": 10_000, "lanes": 1, "global_batch_size": 1}, "sources.", "for 1 lane (use"),
    (
        {"stages": [{"name": "s", "steps": 1, "mix": {"a": {"step": {0: 1, 1: 2}}, "b": 1}}]},
        "stages[0].mix.a.step",
        "not inside the stage's 1 step (0..0)",
    ),
    ({"mixx": {"a": 1}}, "mixx", "unknown key"),
    ({"stages": [{"name": "s", "mix": {"a": 1}, "stpes": 3}]}, "stages[0].stpes", "unknown key"),
]


@pytest.mark.parametrize("overrides,key,words", BAD_CONFIGS)
@pytest.mark.parametrize("command", ["stages", "verify"])
def test_bad_configs_stop_with_one_line_naming_the_file_and_key(
    tmp_path, stores, capsys, overrides, key, words, command
):
    config = write_config(tmp_path, stores, **overrides)
    extra = ["--steps", "0:2"] if command == "verify" else []
    code, out, err = run(capsys, command, config, *extra)
    assert code == 2, out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and str(config) in lines[0]
    assert key in lines[0] and words in lines[0]


def test_a_path_that_is_not_a_store(tmp_path, stores, capsys):
    (tmp_path / "plain").mkdir()
    config = write_config(
        tmp_path, stores, sources={"a": {"path": str(tmp_path / "plain")}}, mix={"a": 1}
    )
    code, _, err = run(capsys, "epochs", config)
    assert code == 2 and "sources.a.path" in err and "not a token store" in err


def test_bad_arguments_exit_2(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    for argv in (
        ["verify", config, "--steps", "5:3"],
        ["inspect", config, "--step", "-1"],
        ["inspect", config, "--step", "0", "--rows", "x"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in argv])
        assert exit_info.value.code == 2
    code, _, err = run(capsys, "stages", tmp_path / "missing.yaml")
    assert code == 2 and "missing.yaml" in err


def test_a_step_that_is_not_a_number_is_named_as_such(tmp_path, stores, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(write_config(tmp_path, stores)), "--step", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "pipeline inspect: error: argument --step: expected an integer >= 0, got 'abc'"


def test_plot_to_a_file_that_is_not_an_image_is_one_line(tmp_path, stores, capsys):
    out = tmp_path / "plot.txt"
    code, _, err = run(
        capsys, "plot", write_config(tmp_path, stores), "--steps", "0:4", "--out", out
    )
    assert code == 2 and not out.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: --out {out}: the file name must end with an image format")
    assert ".png" in line


@pytest.mark.parametrize("rows", ["0-15", "0-1023"])
def test_output_cut_short_by_its_reader_is_no_traceback(tmp_path, stores, rows):
    """`pipeline inspect ... | head`: the closed pipe ends the command quietly, as for `cat`,
    whether the output meets it while running (~270 KB of rows) or only in the last flush
    (~5 KB: it stays in stdout's 8 KB buffer until the command returns)."""
    config = write_config(tmp_path, stores, global_batch_size=1024)
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "inspect", str(config), "--step", "0",
         "--rows", rows],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # buffered
    )  # fmt: skip
    process.stdout.close()  # the reader leaves before the first write
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == b""


def test_a_ledger_of_another_run_is_refused_naming_both(tmp_path, stores, capsys):
    """With --ledger the plan is the ledger's: a config none of its segments holds (the wrong
    run's ledger) would label another run's rows with this file's name, so it is refused."""
    config = write_config(tmp_path, stores)
    path = tmp_path / "ledger.json"
    Plan.from_config(load_config(config)).ledger.save(path)
    (tmp_path / "other").mkdir()
    other = write_config(tmp_path / "other", stores, seed=6)
    code, out, err = run(capsys, "inspect", other, "--ledger", path, "--step", 0, "--rows", 0)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"error: {other}: this data config is none of the 1 segment of the ledger {path} "
        "(another run's ledger?); with --ledger, give the config of one of its segments (the "
        "run's first config, or one it switched to)"
    ]
    code, out, _ = run(capsys, "inspect", config, "--ledger", path, "--step", 0, "--rows", 0)
    assert code == 0 and out.startswith("step 0: ledger segment 0")


def test_dump_names_the_file_it_wrote_when_npz_is_left_out(tmp_path, stores, capsys):
    config = write_config(tmp_path, stores)
    code, out, _ = run(capsys, "dump", config, "--steps", "0:2", "--out", tmp_path / "h1")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'h1.npz'}: steps 0..1")
    assert np.load(tmp_path / "h1.npz")["inputs"].shape == (2, 8, 8)


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--step", 2**62],  # rows per lane x step overflows int64
        ["inspect", "--step", 2**63 - 1],  # wrapped silently to another step's rows
        ["inspect", "--step", 10**20],  # past int64 itself
        ["verify", "--steps", f"0:{10**20}"],
        ["dump", "--steps", f"{10**20 - 2}:{10**20}", "--out", "x.npz"],
    ],
)
def test_a_step_past_the_last_addressable_one_is_one_line(tmp_path, stores, capsys, argv):
    config = write_config(tmp_path, stores)
    code, out, err = run(capsys, argv[0], config, *argv[1:])
    assert code == 2 and out == ""
    assert err.startswith("error: step ") and len(err.strip().splitlines()) == 1
    assert f"last step this plan can address ({2**62 // 4 - 1:,})" in err  # 4 rows per lane


def test_plot_labels_a_ledger_line_with_the_entrys_kind_not_its_keys():
    """The changed keys of a switch run off a figure's top (demo-switch changes eight): the line
    says switch / skip N steps, and `stages --ledger` lists the keys."""
    from pipeline.commands.plot import _kind

    entry = "switch: packing, sources, stages changed; skip 10 steps (step 20 serves plan step 30)"
    assert _kind(entry) == "switch; skip 10 steps"
    assert _kind("switch: stages laid out anew") == "switch"
    takedown = "exclude sources.docs: the ids of /runs/x/takedown.txt (sha256 0123456789ab)"
    assert _kind(f"switch: mix.a changed; {takedown}") == "switch; exclude sources.docs"


def test_plot_marks_each_ledger_entry_a_switch_a_skip_and_set_mix_calls(
    tmp_path, stores, capsys, monkeypatch
):
    """Every intervention of a run is on its figure: a red line and label at a switch and at a
    skip (the entry's kind), and a red tick at each set_mix call; `stages --ledger` lists them."""
    import matplotlib.pyplot as plt

    from pipeline.plan.ledger import MixEntry, quantize

    config = write_config(tmp_path, stores)
    (tmp_path / "new").mkdir()
    changed = load_config(write_config(tmp_path / "new", stores, mix={"a": 1, "b": 1}))
    run_plan = Plan.from_config(load_config(config))
    switched = Plan(reconcile(run_plan, changed, 10, switch=True), run_plan.stores())
    skipped = Plan(reconcile(switched, changed, 20, skip=10), run_plan.stores())
    steered = skipped.with_mix(MixEntry(25, quantize({"a": 1.0, "b": 3.0})))
    steered = steered.with_mix(MixEntry(31, quantize({"a": 2.0, "b": 1.0})))
    steered.ledger.save(tmp_path / "ledger.json")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    new, ledger = tmp_path / "new" / "data.yaml", tmp_path / "ledger.json"

    def plot(steps: str, out: Path) -> int:
        return run(capsys, "plot", new, "--ledger", ledger, "--steps", steps, "--out", out)[0]

    assert plot("0:40", tmp_path / "p.png") == 0
    (ax,) = figures[0].axes
    red = [line for line in ax.lines if line.get_color() == "red"]
    labels = [text.get_text() for text in ax.texts if text.get_color() == "red"]
    assert labels == [" ledger switch (segment 1)", " ledger skip 10 steps (segment 2)"]
    assert [tuple(line.get_xdata()) for line in red[:2]] == [(10, 10), (20, 20)]
    assert list(red[2].get_xdata()) == [25, 31]
    assert red[2].get_label() == "ledger set_mix (2 calls)"
    assert plot("24:27", tmp_path / "q.png") == 0
    (ax,) = figures[1].axes
    assert not [text for text in ax.texts if text.get_color() == "red"]
    (ticks,) = [line for line in ax.lines if line.get_color() == "red"]
    assert list(ticks.get_xdata()) == [25]
    # the ledger's count, as `stages` gives it, and which of them the range shows
    assert ticks.get_label() == "ledger set_mix (1 of its 2 calls: those in steps 24..26)"
    figures[1].canvas.draw()
    assert all(tick == int(tick) for tick in ax.get_xticks())  # whole steps on a short range
    code, out, _ = run(capsys, "stages", new, "--ledger", ledger)
    assert code == 0
    header = next(line for line in out.splitlines() if "ledger segment from step 20" in line)
    assert "ledger segment from step 20: skip 10 steps (step 20 serves plan step 30)" in header
    # the new config's stages count from the run's start, plan step 0 (no served step holds it)
    assert "stages from plan step 0 (served step t is plan step t + 10; starts_at: run)" in header
    assert "step -" not in out
    assert "set_mix: 2 calls, steps 25..31" in out


def test_plot_labels_a_seq_len_switch_with_its_values(tmp_path, stores):
    """A geometry switch (docs/steering.md, context extension) is marked like any switch, and its
    label carries the change itself: the keys it changed are many, the seq_len values few."""
    from pipeline.commands.plot import interventions

    run_plan = Plan.from_config(load_config(write_config(tmp_path, stores)))
    (tmp_path / "long").mkdir()
    longer = load_config(write_config(tmp_path / "long", stores, seq_len=16))
    ledger = reconcile(run_plan, longer, 10, switch=True)
    lines, mixes = interventions(ledger, 0, 40)
    assert lines == [(10, " ledger switch; geometry seq_len 8 -> 16 (segment 1)")]
    assert len(mixes) == 0
    assert interventions(ledger, 11, 40)[0] == []
