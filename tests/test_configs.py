"""Every file in configs/ loads, plans and passes the audit on real (small) builtin stores."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.plan.report import stage_rows
from pipeline.plan.resume import reconcile
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from pipeline.store.token_store import TokenStore

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def megatron_example():
    spec = importlib.util.spec_from_file_location(
        "megatron_example", SCRIPTS / "megatron_example.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tmp tree like the repository's: data/<builtin stores> and configs/<copies>."""
    root = tmp_path_factory.mktemp("configs")
    for name in ("python-code", "python-tests", "python-docs", "python-docstrings"):
        prepare(
            PrepareOptions(
                inputs=[f"builtin:{name}"], out=root / "data" / name, num_shards=2, progress=False
            )
        )
    assert megatron_example().main(root / "data") == 0  # `make megatron-example`'s script
    shutil.copytree(CONFIGS[0].parent, root / "configs")
    return root / "configs"


def test_there_are_configs():
    names = {path.name for path in CONFIGS}
    assert {"default.yaml", "linear-warmup.yaml", "curriculum.yaml"} <= names
    assert {"seeds01-main.yaml", "seeds01-task.yaml", "batch-ramp.yaml"} <= names


def test_batch_ramp_grows_the_batch_and_keeps_epochs_exact(workdir):
    plan = Plan.from_config(load_config(workdir / "batch-ramp.yaml"))
    assert [plan.batch_size(step) for step in (0, 19, 20, 59, 60, 10**6)] == [8, 8, 16, 16, 32, 32]
    rows = {row.name: row for row in stage_rows(plan)}
    assert (rows["warmup"].end_step, rows["docs-epoch"].start_step) == (29, 30)  # 30 steps
    docs = plan.segment_plan(0).layouts["docs"].windows_per_lane
    drawn = 0
    for step in range(30, rows["docs-epoch"].end_step + 1):
        draws = plan.draws(step)
        drawn += int(((draws.source == 1) & (draws.lane == 0) & (draws.stage == 1)).sum())
    assert drawn == docs  # one docs epoch, at 4 and then 8 rows per lane
    report = audit(plan, 15, 65, process_counts=[1, 2, 4, 8])
    assert report.ok, report.violations


def test_the_demo_switch_continues_the_curriculum_where_the_run_is(workdir):
    """configs/demo-switch.yaml at step 100 of a demo-curriculum.yaml run draws what an
    uninterrupted demo-switch.yaml run draws from step 100 on (the docs ramp mid-way), then
    instruction-tunes on whole, masked docstring pairs from step 110."""
    curriculum = Plan.from_config(load_config(workdir / "demo-curriculum.yaml"))
    new = load_config(workdir / "demo-switch.yaml")
    switched = Plan(reconcile(curriculum, new, 100, switch=True))
    uninterrupted = Plan.from_config(new)
    for step in range(100, 130):
        assert switched.draws(step).source.tolist() == uninterrupted.draws(step).source.tolist()
    main, sft = stage_rows(switched)[-2:]
    assert (main.segment_index, main.name, main.joined_at) == (1, "main", 100)
    assert (sft.segment_index, sft.name, sft.start_step, sft.end_step) == (1, "sft", 110, None)
    draws = switched.draws(100)
    assert 0 < int((draws.source == draws.source_names.index("docs")).sum()) < 16  # mid-ramp
    draws = switched.draws(110)
    assert int((draws.source == draws.source_names.index("sft")).sum()) == 24  # 3:1 with code
    batch = switched.read(draws)
    assert 0.2 < float((batch["targets_segmentation"] == 0).mean()) < 0.6  # prompts masked
    report = audit(switched, 90, 130, process_counts=[2])
    assert report.ok, report.violations
    assert report.packing["sft"].documents > 1000


@pytest.mark.parametrize("name", [path.name for path in CONFIGS])
def test_every_config_plans_and_passes_the_audit(workdir, name):
    config = load_config(workdir / name)
    assert config.final_batch_size <= 64 and config.seq_len <= 1024  # CPU-demo sized
    plan = Plan.from_config(config)
    report = audit(plan, 0, 24, process_counts=[2])
    assert report.ok, report.violations
    assert report.rows_checked == sum(plan.batch_size(step) for step in range(24))
    assert stage_rows(plan)


def test_curriculum_epochized_stage_uses_every_docs_window_once(workdir):
    plan = Plan.from_config(load_config(workdir / "curriculum.yaml"))
    rows = {row.name: row for row in stage_rows(plan)}
    middle = rows["docs-epochs"]
    assert middle.start_step == 50 and middle.end_step is not None
    # the whole epochized stage and the start of the next one: a docs epoch completes inside
    report = audit(plan, 0, middle.end_step + 3, process_counts=[])
    assert report.ok, report.violations
    assert report.epochs_completed["docs"] >= 1


def test_seeds01_switch_to_the_task_dataset_repeats_no_window(workdir):
    main = Plan.from_config(load_config(workdir / "seeds01-main.yaml"))
    task = load_config(workdir / "seeds01-task.yaml")
    switch = 30
    with pytest.raises(Exception, match=r"reconcile\(\.\.\., switch=True\)"):
        reconcile(main, task, switch)
    ledger = reconcile(main, task, switch, switch=True)
    assert [s.start_step for s in ledger.segments] == [0, switch]
    carried = ledger.segments[1].counters["docs"]
    assert carried == main.segment_plan(0).counters_at(switch)["docs"] > 0
    switched = Plan(ledger)
    windows = switched.segment_plan(1).layouts["docs"].windows_per_lane
    # across the switch and through more than one whole docs epoch afterwards
    stop = switch + -(-2 * windows // task.rows_per_lane)
    report = audit(switched, 0, stop, process_counts=[])
    assert report.ok, report.violations
    assert report.epochs_completed["docs"] >= 1
    hosts = audit(switched, switch - 2, switch + 2, process_counts=[4])
    assert hosts.ok, hosts.violations
    # steps before the switch are still the main config's
    before = main.batch(switch - 1)
    for field, value in switched.batch(switch - 1).items():
        assert (value == before[field]).all()


def test_the_megatron_example_reads_the_documents_in_place(workdir):
    """configs/megatron-in-place.yaml: the Megatron copy of python-docs serves its documents,
    each ending with the bytes tokenizer's eod, which the index detects."""
    plan = Plan.from_config(load_config(workdir / "megatron-in-place.yaml"))
    megatron = plan.segment_plan(0).layouts["docs"].meta
    with TokenStore(workdir.parent / "data" / "python-docs") as store:
        assert megatron.num_tokens == store.num_tokens
        assert megatron.tokenizer["eod_id"] == store.eod_id
        first = store.document(0, 0)
    assert plan.store(megatron).document(0, 0).tolist() == first.tolist()
    draws = plan.draws(3)
    assert set(draws.source_names[s] for s in draws.source.tolist()) == {"code", "docs"}
