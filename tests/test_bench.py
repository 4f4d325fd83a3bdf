"""`pipeline bench` on a tiny store, and the batched read path against the per-row reference.

The bench's timings are never asserted; its table's structure and token accounting are. The
batched read (`layout.window_pieces`, `piece_reads.read_pieces`, `batch.fields`) replaced
a per-row path (`SourceLayout.read_window` + a cumsum assembly); both are kept here as the reference
the fast path must equal bit for bit, through the flat sidecars and through ArrayRecord.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.commands.cli import main
from pipeline.config import parse_config
from pipeline.errors import StoreError
from pipeline.read.plan import Plan
from pipeline.store import writer
from pipeline.store.identity import manifest_digest
from pipeline.store.token_store import TokenStore, read_pieces
from tests.storegen import arrayrecord_only, write_synthetic_store
from tests.test_plan import build, setups

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def reference_batch(plan: Plan, step: int, rows=None) -> dict[str, np.ndarray]:
    """The pre-optimisation read: one `SourceLayout.read_window` per row, per-token scans."""
    draws = plan.draws(step, rows)
    segment = plan.segment_plan(draws.segment_index)
    seq_len = segment.config.seq_len
    layouts = [segment.layouts[draws.source_names[s]] for s in draws.source]
    windows = [
        layout.read_window(plan.store(layout.meta), int(e), int(t))
        for layout, e, t in zip(layouts, draws.epoch, draws.start)
    ]
    tokens = np.empty((len(windows), seq_len + 1), dtype=np.int32)
    starts = np.zeros((len(windows), seq_len + 1), dtype=bool)
    for row, window in enumerate(windows):
        tokens[row] = window.tokens
        starts[row, window.doc_starts] = True
    starts[:, 0] = True
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32), tokens.shape)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "inputs_segmentation": segments[:, :-1],
        "targets_segmentation": segments[:, 1:],
        "inputs_position": positions[:, :-1],
        "targets_position": positions[:, 1:],
    }


@SETTINGS
@given(setups(sources=3), st.integers(0, 10**6), st.data())
def test_batched_read_equals_the_per_row_reference(setup, step, data):
    """All sources' windows are read in one pass (`window_pieces`, `read_pieces`): through the
    sidecars, through ArrayRecord, and with one source's store read each way in one batch."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup, mix={"s0": 3, "s1": 2, "s2": 1})
        size = setup["global_batch_size"]
        rows = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size))
        records = arrayrecord_only(plan)
        first, *others = plan.stores()
        mixed = Plan(plan.ledger, [TokenStore(first.path, flat=False), *others])
        for chosen in (None, rows):
            slow = reference_batch(plan, step, chosen)
            for fast in (plan.batch(step, chosen), records.batch(step, chosen),
                         mixed.batch(step, chosen)):  # fmt: skip
                for field, expected in slow.items():
                    assert fast[field].dtype == expected.dtype == np.int32, field
                    np.testing.assert_array_equal(fast[field], expected, err_msg=field)
            pieces_are_the_windows(plan, plan.draws(step, chosen), slow)


def pieces_are_the_windows(plan: Plan, draws, batch: dict) -> None:
    """`Plan.pieces` (what a feed fetches ahead of its reads) holds the windows' tokens."""
    read = [
        store.read_shard_tokens(shard, start, stop).tokens
        for store, shards, lo, hi in plan.pieces(draws, local=True)
        for shard, start, stop in zip(shards.tolist(), lo.tolist(), hi.tolist(), strict=True)
    ]
    windows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    np.testing.assert_array_equal(np.sort(np.concatenate(read)), np.sort(windows.ravel()))


def test_batched_read_names_a_corrupt_record(tmp_path):
    plan = build(tmp_path, {"seed": 0, "seq_len": 8, "lanes": 1, "global_batch_size": 2,
                            "shards": [[[30, 30, 30], [40, 40]]]})  # fmt: skip
    store = arrayrecord_only(plan).stores()[0]
    index = store.record_offsets(0)
    out = np.empty((1, 9), np.int32)
    store._loaded["index"][0] = np.array(index) + np.array([0, 1, 1, 1])  # no longer fits
    with pytest.raises(StoreError, match="corrupt"):
        read_pieces([store], [0], [0], [0], [9], out, [0], [0])
    with pytest.raises(StoreError, match="inside the shard"):
        read_pieces([store], [0], [0], [5], [500], out, [0], [0])


@pytest.mark.multiprocess  # about ten worker processes, each importing JAX and Grain
def test_bench_command_prints_the_tables_and_every_contender_counts_whole_batches(tmp_path, capsys):
    from benchmarks.bench import table

    out = tmp_path / "bench.json"
    code = main([
        "bench", "--cache-dir", str(tmp_path / "cache"), "--synthetic-tokens", "200000",
        "--synthetic-doc-len", "60", "--rows", "8", "--seq-len", "64", "--steps", "2",
        "--reps", "2", "--round-s", "0", "--pace-ms", "1", "--grain-workers", "1", "--no-scale",
        "--no-progress", "--json", str(out), "--no-sft",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    for label in ("**ours: DataFeed -> global arrays**", "ours: MaxText create_data_iterator",
                  "Grain ReadOptions(num_threads=0, prefetch_buffer_size=0)",
                  "Grain + mp_prefetch(1 worker)", "limit: ArrayRecord read(i, i+1)",
                  "DataFeed / Grain's best single process", "DataFeed / Grain's best mp_prefetch",
                  "step 1,000,000,000", "Orbax restore",
                  "ours through Grain: host_dataset + mp_prefetch(2 workers)",
                  "limit: transfer of the six fields only",
                  "limit: transfer of tokens + boundaries only",
                  "ours: DataFeed, feed: {expand: device}"):  # fmt: skip
        assert label in printed, label
    contenders = result["contenders"]
    expected = {"feed", "feed_nostats", "feed_unchecked", "maxtext", "grain_view", "plan",
                "plan_arrayrecord", "grain_t0_b0", "grain_t16_b500", "grain_mp1",
                "format_per_record", "copy", "feed_device",
                "transfer", "transfer_compact", "transfer_expanded"}  # fmt: skip
    assert expected <= set(contenders)
    for name, row in contenders.items():
        assert row["tokens_per_s"] > 0 and row["next_ms_per_step"] > 0, name
        assert row["cpu_s_per_mtok"] >= 0, name
    # Each worker counts the tokens of the global arrays it built: 8 rows x 64 per step.
    assert {row["tokens"] for row in contenders.values()} == {2 * 2 * 8 * 64}
    restore = result["restore_s"]
    assert set(restore["feed"]) == {"0", "1000", "1000000", "1000000000"}
    overhead = result["stats_overhead"]
    assert overhead["stats_call_s"] > 0 and set(overhead["step_s"]) == {"with", "without"}
    assert "feed statistics: DataFeed step" in printed
    assert set(restore[result["grain_best_single"]]) == set(restore["feed"])
    mixed = result["mix_restore_s"]  # a restore whose ledger records 10,000 set_mix calls
    assert set(mixed) == {"0", "10000"} and mixed["10000"]["state_bytes"] <= 1_000_000
    line = next(line for line in printed.splitlines() if "10,000 set_mix calls" in line)
    assert f"({mixed['10000']['total'] / mixed['0']['total']:.2f}x; target <= 2x)" in line
    assert "sft" not in result and "packed SFT" not in printed
    # The block checksums' cost: DataFeed's A/B against verify: off, and the checks alone.
    feed, checks = contenders["feed"]["cpu_s_per_mtok"], result["checksum_cost"]
    alone = checks["plan_cpu_s_per_mtok"]
    assert checks["plan_share"] == pytest.approx(alone / feed)
    share = 1 - contenders["feed_unchecked"]["cpu_s_per_mtok"] / feed
    line = next(line for line in printed.splitlines() if line.startswith("checksummed reads"))
    assert f"DataFeed {share:+.1%} of its CPU per token" in line
    assert f"{alone:+.4f} CPU s per M tokens = {alone / feed:+.1%}" in line
    # The transfer limit's line: its CPU per token against DataFeed's and Grain's best.
    grain, transfer = contenders[result["grain_best_single"]], contenders["transfer"]
    line = next(line for line in printed.splitlines() if line.startswith("transfer limit:"))
    assert f"{transfer['cpu_s_per_mtok']:.4f} CPU s per M tokens" in line
    share = transfer["cpu_s_per_mtok"] / contenders["feed"]["cpu_s_per_mtok"]
    reach = grain["cpu_s_per_mtok"] / transfer["cpu_s_per_mtok"]
    assert f"{share:.0%} of DataFeed's" in line and line.endswith(
        f"{reach:.1f}x less CPU per token"
    )
    # Transfer less: the compact form's transfer against the six fields'.
    packed, expanded = contenders["transfer_compact"], contenders["transfer_expanded"]
    line = next(line for line in printed.splitlines() if line.startswith("transfer less"))
    less = transfer["cpu_s_per_mtok"] / packed["cpu_s_per_mtok"]
    assert f"{packed['cpu_s_per_mtok']:.4f} CPU s per M tokens, {less:.1f}x less" in line
    assert f"with the on-device expansion {expanded['cpu_s_per_mtok']:.4f}" in line
    # The scale table's transfer columns, from a scale run's figures.
    result["scale"] = {
        str(n): {"rows_per_process": 8 // n, "tokens_per_s_per_process": 1e6,
                 "cpu_s_per_mtok_per_process": 0.02 * n, "peak_rss_mb": 500,
                 "transfer_cpu_s_per_mtok_per_process": 0.01 * n,
                 "compact_cpu_s_per_mtok_per_process": 0.004 * n * n}
        for n in (1, 2)
    }  # fmt: skip
    row = "| 2 | 4 | 1,000,000 | 0.0400 | 2.00 | 500 MB | 0.0200 | 2.00 | 0.0160 | 4.00 |"
    assert row in table(result)


@pytest.mark.multiprocess  # contender workers, and a restore in a new process per step
def test_bench_sft_only_prints_the_packed_sft_table(tmp_path, capsys):
    """One round (`--reps 1`): each restore is one new process, not one per round; the rounds'
    sums and medians are bench.py's `measure`, which the main table's test runs twice."""
    from benchmarks import bench

    out = tmp_path / "bench.json"
    code = main([
        "bench", "--sft-only", "--cache-dir", str(tmp_path / "cache"), "--rows", "8",
        "--steps", "2", "--reps", "1", "--round-s", "0", "--pace-ms", "1", "--devices", "2",
        "--grain-workers", "1", "--no-progress", "--json", str(out),
        "--sft-documents", "400", "--sft-seq-len", "64", "--sft-mean-len", "20",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    for label in ("packed SFT: 400 documents", "**ours: DataFeed (best_fit) -> global arrays**",
                  "Grain FirstFitPackIterDataset, ReadOptions(num_threads=0, "
                  "prefetch_buffer_size=0)", "Grain BestFitPackIterDataset + mp_prefetch(1 worker)",
                  "ours: best_fit source, Plan.batch, host only",
                  "restore to first batch, in a new process",
                  "the packing kept on disk", "nothing kept"):  # fmt: skip
        assert label in printed, label
    assert "DataFeed -> global arrays" not in printed  # the other tables did not run
    sft = json.loads(out.read_text())["sft"]
    assert len(sft["grain"]) == 9  # two packers x four ReadOptions, best-fit + mp_prefetch(1)
    workers = {"feed"} | set(sft["grain"])
    names = workers | {"ours_best_fit", "ours_concat"}
    assert set(sft["tokens_per_s"]) == set(sft["cpu_s_per_mtok"]) == set(sft["padding"]) == names
    assert min(sft["tokens_per_s"].values()) > 0 and min(sft["cpu_s_per_mtok"].values()) >= 0
    # Each worker counts the target slots of the global arrays it built: 8 rows x 64 per step.
    assert sft["worker_tokens"] == dict.fromkeys(workers, 2 * 8 * 64)
    assert sft["padding"]["ours_concat"] == 0  # windows never pad
    assert 0 < sft["padding"]["grain_best_fit_mp1"] < 1  # Grain's bins pad
    assert 0 <= sft["padding"]["ours_best_fit"] < 1 and sft["packing"]["rows"] > 0
    assert set(sft["resume_s"]) == {"0", "1000", "1000000"}
    assert min(sft["resume_s"].values()) > 0 and sft["resume_cold_s"] > 0
    # The summary names Grain's fastest packer row in one process, by this run's medians.
    tps = sft["tokens_per_s"]
    single = max((n for n, o in sft["grain"].items() if not o["workers"]), key=tps.get)
    line = next(line for line in printed.splitlines() if "best packer in one process" in line)
    assert f"{bench.sft_bench.sft_label(single, sft['grain'])})" in line
    assert f": {tps['feed'] / tps[single]:.1f}x target slots/s" in line


def test_the_bench_cache_is_keyed_by_the_store_format_and_rebuilds_what_it_cannot_read(tmp_path):
    import argparse

    from benchmarks.bench import add_arguments, resolve_sources
    from pipeline.store.meta import FORMAT_VERSION, MASKED_FORMAT_VERSION

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--cache-dir", str(tmp_path), "--synthetic-tokens", "20000",
                              "--synthetic-doc-len", "60"])  # fmt: skip
    path = tmp_path / f"format-{FORMAT_VERSION}-{MASKED_FORMAT_VERSION}" / "synthetic-20000-60"
    path.mkdir(parents=True)  # what an older version, or an interrupted run, left there
    old = {"format": "pipeline-token-store", "format_version": FORMAT_VERSION - 1}
    (path / "manifest.json").write_text(json.dumps(old))
    assert resolve_sources(args) == {"corpus": (path, 1)}
    store = TokenStore(path)
    assert store.num_tokens >= 20000 and all("flat" in s for s in store.manifest["shards"])
    (path / store.manifest["shards"][0]["index"]).unlink()  # a readable manifest, a lost file
    assert resolve_sources(args) == {"corpus": (path, 1)}
    TokenStore(path, verify=True)
    manifest = json.loads((path / "manifest.json").read_text())  # an older prepare's sidecars:
    for shard in manifest["shards"]:  # no block checksums, so each is hashed whole on first read
        del shard["flat_blocks"], shard["flat_blocks_sha256"], shard["flat_block_bytes"]
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert resolve_sources(args) == {"corpus": (path, 1)}
    assert all("flat_blocks" in s for s in TokenStore(path).manifest["shards"])
    with mock.patch.object(writer, "BLOCK_BYTES", 2048):  # another prepare's block size
        assert resolve_sources(args) == {"corpus": (path, 1)}
    blocks = {s["flat_block_bytes"] for s in TokenStore(path).manifest["shards"]}
    assert blocks == {2048} != {writer.BLOCK_BYTES}
    assert resolve_sources(args) == {"corpus": (path, 1)}  # checked at another cost: made again
    blocks = {s["flat_block_bytes"] for s in TokenStore(path).manifest["shards"]}
    assert blocks == {writer.BLOCK_BYTES}


def test_grain_contender_fields_restart_after_every_eod():
    """Grain's packed rows get the six fields from eod positions, like a MaxText user's."""
    from benchmarks.contenders import Fields

    eod = 99
    tokens = np.array([[5, eod, 7, 8, eod, 9, 4], [eod, 1, 2, 3, 4, 5, 6]], dtype=np.int32)
    batch = Fields(eod)({"tokens": tokens})
    np.testing.assert_array_equal(batch["inputs"], tokens[:, :-1])
    np.testing.assert_array_equal(batch["targets"], tokens[:, 1:])
    np.testing.assert_array_equal(
        batch["inputs_segmentation"], [[1, 1, 2, 2, 2, 3], [1, 2, 2, 2, 2, 2]]
    )
    np.testing.assert_array_equal(
        batch["inputs_position"], [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    )
    np.testing.assert_array_equal(
        batch["targets_segmentation"], [[1, 2, 2, 2, 3, 3], [2, 2, 2, 2, 2, 2]]
    )


def test_bench_help_lists_the_benchmark_options_loaded_on_demand(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--help"])
    assert stop.value.code == 0
    assert "--synthetic-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--no-such-option"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_bench_in_an_installed_package_says_it_needs_a_source_checkout(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("pipeline.commands.bench.BENCH_FILE", tmp_path / "benchmarks/bench.py")
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pipeline bench") and "runs from a source checkout" in out
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `pipeline bench` runs from a source checkout of pipeline")
    assert err.count("\n") == 1 and str(tmp_path / "benchmarks/bench.py") in err


@pytest.mark.multiprocess  # one contender process, importing JAX
def test_a_free_running_contender_prints_no_input_bound_warnings(tmp_path, capfd):
    """A contender's feed is input-bound by design; the feed's warning about it, every 100
    steps, flooded `make bench`'s output (93 lines in one run)."""
    from benchmarks.bench import Worker, close_all

    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "lanes": 1,
              "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    spec = {"config": config, "contenders": {"feed": "feed", "maxtext": "maxtext"},
            "grain": {}, "tmp": str(tmp_path)}  # fmt: skip
    worker = Worker(spec, tmp_path, 2, "feeds")
    try:
        worker.wait_ready()
        runs = [
            worker.ask({"run": name, "steps": 250, "pace": 0.0}) for name in ("feed", "maxtext")
        ]
    finally:
        close_all([worker])
    assert [run["tokens"] for run in runs] == [250 * 8 * 64] * 2
    assert "input-bound" not in capfd.readouterr().err


@pytest.mark.multiprocess  # a 1- and a 2-process jax.distributed job of contender workers
def test_the_scale_rows_run_the_transfer_limit_with_the_feed_closed(tmp_path, monkeypatch):
    """Each scale process runs the feed, then the transfer limit: a feed left open refills its
    prefetch in its reader threads during the transfer run, CPU its column would count."""
    import argparse
    from types import SimpleNamespace

    from benchmarks import bench

    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "lanes": 1,
              "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    answers = []
    receive = bench.Worker.receive

    def recorded(worker: bench.Worker) -> dict:
        answers.append(receive(worker))
        return answers[-1]

    monkeypatch.setattr(bench.Worker, "receive", recorded)
    monkeypatch.setattr(bench, "SCALE_PROCESSES", (1, 2))
    args = argparse.Namespace(devices=2, rows=8, steps=2, reps=1)
    base = {"config": config, "grain": {}, "tmp": str(tmp_path)}
    result = bench.scale(base, args, tmp_path, SimpleNamespace(update=lambda: None))
    assert set(result) == {"1", "2"}
    runs = [answer for answer in answers if "feed_threads" in answer]
    # per job: the feed's run in each process (its threads live), then the transfers'
    one, two = [True, False, False], [True, True, False, False, False, False]
    assert [run["feed_threads"] > 0 for run in runs] == one + two
    assert all(r["compact_cpu_s_per_mtok_per_process"] > 0 for r in result.values())


def test_the_scale_benchmarks_parts_run_on_a_small_store(tmp_path):
    """benchmarks/scale_bench.py takes minutes to hours at its sizes, so it is run by hand: its
    store builder and measurements, on a 3-shard store, in the fresh processes it uses."""
    from benchmarks import scale_bench

    store = scale_bench.build(tmp_path / "s", 3, 50)
    built = (store / "manifest.json").stat().st_mtime_ns
    assert scale_bench.build(tmp_path / "s", 3, 50) == store  # built once
    assert (store / "manifest.json").stat().st_mtime_ns == built
    assert TokenStore(store).num_tokens == 3 * 50 * scale_bench.DOC
    rss = scale_bench.child(["rss", str(store), "2"])
    assert rss["rss_mb"] >= rss["baseline_mb"] > 0
    start = scale_bench.child(["start", str(store)])
    assert set(start) == {"open_s", "reopen_s", "first_batch_s"} and min(start.values()) > 0
    cost = scale_bench.host_cost(str(store), 4, 2, reps=2)
    assert cost["ms"] > 0 and cost["peak_kb"] > 0


def test_the_scale_bench_request_rates_meet_the_budget_at_4096_hosts():
    """Issue 29's target: <= 10 requests a second to Cloud Storage for the whole job; the
    coordinator's load is bounded by the job's poll budget whatever the feeds per process,
    where one poll per feed and host every 2 s would be 4,096 RPC/s with two feeds, and only
    process 0 reads every host's time to batch."""
    from benchmarks import scale_bench
    from pipeline.feed import host_stop

    one = scale_bench.request_rates(1, 4)
    assert one["coordinator"] == one["stragglers"] == 0
    assert one["storage"] == 4 / host_stop.STORE_CHECK_S
    two = scale_bench.request_rates(2, 4, feeds=2)
    assert two["storage"] == one["storage"] and two["coordinator"] == 2 / host_stop.POLL_S
    big = scale_bench.request_rates(4096, 4, feeds=2, window_s=100)
    assert big["storage"] == one["storage"] <= 10
    assert big["coordinator"] == pytest.approx(host_stop.JOB_POLLS_PER_S)
    assert big["coordinator_per_host"] == 2 * 4096 / host_stop.POLL_S
    # a figure a host; on host 0 its reads of them and the verdict
    reads = scale_bench.TYPICAL_READS, scale_bench.worst_reads()
    assert big["stragglers"] == pytest.approx(2 * (4096 + reads[0] + 1) / 100)
    assert big["stragglers_worst"] == pytest.approx(2 * (4096 + reads[1] + 1) / 100)
    assert big["values_read"] == pytest.approx(2 * 4096 * reads[0] / 100)
    assert big["values_read_worst"] == pytest.approx(2 * 4096 * reads[1] / 100)
    assert big["values_read_per_host"] == pytest.approx(4096 * big["values_read"] / reads[0])


@pytest.mark.parametrize("silent", [False, True])
def test_the_scale_bench_counts_the_reads_process_0_makes_of_a_window(monkeypatch, silent):
    """Process 0 of 3 (stragglers.Peers, the watcher's schedule on a fake clock): hosts 1 and 2
    publish their figure of the window between its first read and the next, and it makes
    TYPICAL_READS; host 2 never publishes, and it reads until WINDOW_WAIT_S: worst_reads()."""
    from benchmarks import scale_bench
    from pipeline.feed import stragglers

    class Directory:
        def __init__(self) -> None:
            self.values: dict[str, str] = {}
            self.reads = 0

        def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
            self.values[key] = value

        def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
            self.reads += 1
            return [(k, v) for k, v in self.values.items() if k.startswith(directory)]

    client, now = Directory(), [1000.0]
    monkeypatch.setattr(stragglers, "coordination_client", lambda: client)
    monkeypatch.setattr(stragglers.jax, "process_count", lambda: 3)
    monkeypatch.setattr(stragglers.jax, "process_index", lambda: 0)
    monkeypatch.setattr(stragglers.time, "monotonic", lambda: now[0])
    peers = stragglers.Peers(warn=False)
    peers.offer(1, 4, 0.01)
    peers.exchange()
    assert client.reads == 1
    for host in (1, 2)[: 1 if silent else 2]:
        client.values[f"{stragglers.TIME_TO_BATCH}{peers._lane}/{host}"] = "4 0.02"
    while peers.read_at is not None and client.reads < 100:
        now[0] = peers.read_at  # the watcher reads at the scheduled time (or later)
        peers.settle()
    assert peers.slowest.process == (2 if silent else 1)
    assert client.reads == (scale_bench.worst_reads() if silent else scale_bench.TYPICAL_READS)


@pytest.mark.multiprocess  # a fresh process per variant and round, each importing JAX
def test_the_feed_ab_prints_each_variants_figures(tmp_path):
    """benchmarks/feed_ab.py produces docs/benchmarks.md's A/B tables: one column per variant,
    every figure a positive time, in both modes."""
    import subprocess
    import sys

    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    base = [sys.executable, "benchmarks/feed_ab.py", "--store", str(store.path), "--rows", "8",
            "--seq-len", "64", "--devices", "2", "--rounds", "1"]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    for extra, keys in (
        (["--steps", "30", "--paced", "3", "--threads", "1", "--threads", "auto"],
         ["cpu_ms", "wall_ms", "paced_cpu_ms", "next_ms", "next_cpu_ms"]),
        (["--restore", "--at", "1000"], ["restore_ms"]),
    ):  # fmt: skip
        out = subprocess.run(base + extra, cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| ")]
        header, table = rows[0], rows[2:]
        assert [row[0].removeprefix("| ") for row in table] == keys
        variants = len(header) - 2
        assert variants == (2 if "--threads" in extra else 1)
        for row in table:
            assert all(float(cell.split()[0]) > 0 for cell in row[1 : 1 + variants]), row


def test_the_transfer_limit_transfers_fresh_copies_of_the_feeds_six_fields(tmp_path):
    """The limit row is the feed's transfer of the real fields: the six of `Plan.batch` with
    the feed's sharding, each step from new host buffers laid out as `Plan.read` lays them."""
    import jax

    from benchmarks.contenders import TransferLimit, fresh_copy
    from pipeline.read.batch import FIELDS

    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "lanes": 1,
              "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    limit = TransferLimit({"config": config})
    host = limit.host
    copy = fresh_copy(host)
    for name, view in host.items():
        assert copy[name].strides == view.strides and not np.shares_memory(copy[name], view)
        np.testing.assert_array_equal(copy[name], view)
    assert np.shares_memory(copy["inputs"], copy["targets"])  # one buffer, as in Plan.read
    limit.prepare(2)
    first, second = limit.queue
    assert not np.shares_memory(first["inputs"], second["inputs"])
    expected = Plan.from_config(parse_config(config, origin="test")).batch(0)
    for _ in range(2):
        batch = next(limit)
        assert list(batch) == list(FIELDS)
        for name, values in batch.items():
            assert isinstance(values, jax.Array) and len(values.sharding.device_set) == 8
            np.testing.assert_array_equal(np.asarray(values), expected[name], err_msg=name)
    assert limit.queue == []


@pytest.mark.multiprocess  # Grain's mp_prefetch worker processes
def test_the_grain_view_row_serves_the_plans_batches_as_global_arrays(tmp_path):
    """The row times the docs' recipe: `host_dataset` batched per step through two
    `mp_prefetch` workers, ending in the same global arrays as DataFeed's."""
    import jax
    from absl import flags

    from benchmarks.contenders import GrainView

    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "lanes": 1,
              "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    plan = Plan.from_config(parse_config(config, origin="test"))
    was_parsed = flags.FLAGS.is_parsed()
    view = GrainView({"config": config, "grain": {"workers": 2}})
    try:
        for step in range(3):
            batch = next(view)
            for name, values in plan.batch(step).items():
                assert isinstance(batch[name], jax.Array)
                assert len(batch[name].sharding.device_set) == 8
                np.testing.assert_array_equal(np.asarray(batch[name]), values, err_msg=name)
    finally:
        view.close()
        if not was_parsed:
            flags.FLAGS.unparse_flags()


def test_padding_is_counted_from_the_served_arrays():
    import jax.numpy as jnp

    from benchmarks.contenders import padding

    rows = [[1, 1, 2, 0], [1, 0, 0, 0]]  # 4 of 8 slots padding, then 0 of 8
    batches = iter([{"inputs_segmentation": jnp.array(rows)},
                    {"inputs_segmentation": jnp.ones((2, 4), jnp.int32)}])  # fmt: skip
    assert padding(batches, 2) == 4 / 16


@pytest.mark.multiprocess  # a contenders.py worker, and its Grain mp_prefetch process
@pytest.mark.parametrize(("last", "code"), [('{"quit": true}', 0), ('{"run": "nope"}', 1)])
def test_a_grain_mp_prefetch_worker_exits_without_leaking_shared_memory(tmp_path, last, code):
    """Grain's mp_prefetch hands batches over in shared memory; the contender's close must
    unlink what Grain's iterator still holds, or the resource tracker warns at exit: on quit,
    and when a command fails (here: a contender the worker does not have)."""
    store = write_synthetic_store(tmp_path / "s", [[60] * 300], record_tokens=64)
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8,
              "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    grain = {"threads": 1, "buffer": 16, "workers": 1, "packer": "best_fit"}
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"config": config, "contenders": {"g": "grain_sft"}, "grain": grain})
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
    commands = '{"run": "g", "steps": 5, "pace": 0.0}\n' + last + "\n"
    done = subprocess.run([sys.executable, "benchmarks/contenders.py", str(spec)], input=commands,
                          env=env, cwd=env["PYTHONPATH"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert '"tokens": 2560' in done.stdout  # 5 batches of 8 x 64 target slots
    assert "leaked shared_memory" not in done.stderr, done.stderr


def test_the_packed_sft_grain_rows_sweep_every_setting_of_the_main_table(tmp_path):
    """Both packers with every ReadOptions the main table tries, best-fit with mp_prefetch of
    1..--grain-workers processes (reading as the main table's mp rows), all in one `throughput`:
    Grain's best configuration is found by measurement, not picked by hand."""
    import argparse
    from types import SimpleNamespace

    from benchmarks import bench

    grain_read, sft_bench = sys.modules["grain_read"], bench.sft_bench  # as bench.py imports them
    seen = {}

    def throughput(specs, host, args, tmp, bar):
        seen.update(specs)
        answer = SimpleNamespace(ask=lambda command: {"padding": 0.0})
        return {name: {} for name in specs}, dict.fromkeys(specs, answer)

    args = argparse.Namespace(rows=8, sft_seq_len=64, grain_workers=3, reps=1, steps=1,
                              no_progress=True)  # fmt: skip
    sft_bench.worker_rows(tmp_path, args, throughput, lambda workers: None)
    grain = [spec["grain"] for name, spec in seen.items() if name != "feed"]
    got = sorted((g["packer"], g["threads"], g["buffer"], g["workers"]) for g in grain)
    single = [(p, t, b, 0) for p in ("first_fit", "best_fit") for t, b in ((0, 0), (1, 16),
              (2, 64), (16, 500))]  # fmt: skip
    mp = [("best_fit", *grain_read.GRAIN_MP_READ, n) for n in (1, 2, 3)]
    assert got == sorted(single + mp)
    # the same settings as the main table's Grain rows, under the same suffixes
    main = {n: o for n, (kind, o) in bench.contender_table(args).items() if kind == "grain"}
    best_fit = {n: dict(o, packer="best_fit") for n, o in main.items()}
    assert {n.replace("grain_", "grain_best_fit_"): o for n, o in best_fit.items()} == {
        n: spec["grain"] for n, spec in seen.items() if n.startswith("grain_best_fit")
    }


def sft_result(grain: dict[str, dict], tps: dict[str, float], cpu: dict[str, float]) -> dict:
    """A packed-SFT result as run_sft returns it, with the given Grain rows and figures."""
    names = {"feed", "ours_best_fit", "ours_concat"} | set(grain)
    return {"documents": 10, "tokens": 3000, "seq_len": 64, "rows": 8, "devices": 2,
            "grain": grain, "tokens_per_s": tps, "cpu_s_per_mtok": cpu,
            "padding": dict.fromkeys(names, 0.01),
            "packing": {"rows": 5, "truncated": 0, "dropped": 0, "padding_fraction": 0.01},
            "resume_s": {"0": 0.01}, "resume_cold_s": 0.1}  # fmt: skip


def test_the_sft_summary_lines_compare_with_grains_fastest_rows_by_median(tmp_path):
    """Not the first row, nor the one of least CPU: the highest median target slots/s, in one
    process (either packer) and with mp_prefetch, each named in its line."""
    from benchmarks import bench

    sft_bench = bench.sft_bench
    grain = sft_bench.grain_rows(3)
    tps = dict.fromkeys(grain, 1e6) | {"feed": 2e7, "ours_best_fit": 4e7, "ours_concat": 5e7}
    cpu = dict.fromkeys(tps, 1.0) | {"feed": 0.05}
    tps["grain_first_fit_t2_b64"], cpu["grain_first_fit_t2_b64"] = 4e6, 0.5
    cpu["grain_best_fit_t0_b0"] = 0.1  # the least CPU, not the fastest
    tps["grain_best_fit_mp2"], cpu["grain_best_fit_mp2"] = 8e6, 0.25
    lines = sft_bench.sft_table(sft_result(grain, tps, cpu)).splitlines()
    assert sum(line.startswith("| Grain ") for line in lines) == 4 + 4 + 3
    assert (
        "DataFeed (best_fit) / Grain's best packer in one process (Grain FirstFitPackIterDataset, "
        "ReadOptions(num_threads=2, prefetch_buffer_size=64)): 5.0x target slots/s, "
        "10.0x less CPU per target slot"
    ) in lines
    assert (
        "DataFeed (best_fit) / Grain's best mp_prefetch (Grain BestFitPackIterDataset + "
        "mp_prefetch(2 workers)): 2.5x target slots/s, 5.0x less CPU per target slot"
    ) in lines


FAKE_WORKER = """
import json, signal, sys
spec = json.loads(open(sys.argv[1]).read())
signal.alarm(20)  # a worker that outlives its test dies anyway
if spec.get("fail"):
    sys.exit(3)
if not spec.get("silent"):
    print("bench-answer " + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if "quit" in line:
        break
"""


@pytest.fixture
def fake_workers(tmp_path, monkeypatch) -> list:
    """bench.py's workers run FAKE_WORKER (no JAX): ready, failing at start, or silent; the
    list gets every Worker started."""
    from benchmarks import bench

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(bench, "WORKER", script)
    started = []

    class Recorded(bench.Worker):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(bench, "Worker", Recorded)
    return started


def test_throughput_closes_the_workers_it_started_when_one_fails(tmp_path, fake_workers):
    """`throughput` hands its workers to the caller only on success: on an error it must
    close the ones it started, or they live on (as long as the bench's process) unasked."""
    import argparse
    from types import SimpleNamespace

    from benchmarks import bench

    specs = {"ok": {}, "broken": {"fail": True}, "late": {}}
    args = argparse.Namespace(devices=1, reps=1, steps=1, round_s=0, pace_ms=1)
    bar = SimpleNamespace(update=lambda: None)
    with pytest.raises(RuntimeError, match="bench worker broken exited with code 3"):
        bench.throughput(specs, {"contenders": {"h": "h"}}, args, tmp_path, bar)
    assert [w.name for w in fake_workers] == ["ok", "broken", "late", "host"]
    # each exited, the live ones because they were asked to quit (not killed, not by alarm)
    assert [w.process.poll() for w in fake_workers] == [0, 3, 0, 0]


def test_a_worker_that_never_answers_is_an_error_not_a_hang(tmp_path, fake_workers, monkeypatch):
    from benchmarks import bench

    monkeypatch.setattr(bench, "ANSWER_TIMEOUT_S", 0.5)
    worker = bench.Worker({"silent": True}, tmp_path, 1, "silent")
    with pytest.raises(RuntimeError, match=r"bench worker silent gave no answer in 0\.5 s"):
        worker.wait_ready()
    bench.close_all([worker])
    assert worker.process.returncode == 0  # it read the quit: the wait was bounded, not it


def test_the_checked_reads_cost_is_the_checks_work(tmp_path, monkeypatch):
    """The checks alone: about what the CRCs of the blocks read cost, made dear here (1 ms per
    call, one call per run of blocks a read checks)."""
    from benchmarks.bench import checked_reads_cpu
    from pipeline.store import flat_blocks

    store = tmp_path / "s"
    write_synthetic_store(store, [[3000] * 20, [5000] * 12])  # 4 blocks of 64 KiB per shard
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8,
              "sources": {"s": {"path": str(store)}}, "mix": {"s": 1}}  # fmt: skip
    real, calls = flat_blocks.google_crc32c.extend, []

    def dear(crc, data):
        calls.append(1)
        end = time.process_time() + 1e-3
        while time.process_time() < end:
            pass
        return real(crc, data)

    monkeypatch.setattr(flat_blocks.google_crc32c, "extend", dear)
    cost = checked_reads_cpu(config, steps=20, rounds=1) * 20 * 8 * 64  # CPU s over the steps
    assert calls and 0.9e-3 * len(calls) <= cost <= 1e-3 * len(calls) + 0.05  # + noise


def test_the_checked_reads_bench_prints_a_line_per_step_count(tmp_path):
    """benchmarks/checked_reads_bench.py, whose lines docs/benchmarks.md quotes: one per
    `--check-steps`, for stores prepared with the `--block-bytes` asked for, each followed
    (`--by-store`) by its store's counts: 2 steps of 4 x 33 uint32 tokens in 512-byte blocks
    (128 tokens) make at most 8 reads, each hashing at most two blocks, so at most 2 KiB per
    check, and at least one block a step; first (`--unit-costs`), a check's parts."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "benchmarks/checked_reads_bench.py", "--cache-dir", str(tmp_path),
               "--synthetic-tokens", "20000", "--synthetic-doc-len", "60", "--rows", "4",
               "--seq-len", "32", "--check-steps", "2", "3", "--rounds", "1", "--by-store",
               "--block-bytes", "512", "--processes", "2", "--unit-costs"]  # fmt: skip
    out = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    parts, *every = out.stdout.splitlines()
    assert parts.startswith("a check's parts, CPU per block of 512 bytes ("), parts
    assert "blocks, 1 rounds): first read (hashed, then 512 bytes copied) " in parts, parts
    lines, stores = every[0::2], every[1::2]
    assert len(stores) == 2 and all(line.startswith("  synthetic-20000-60: ") for line in stores)
    assert "264 tokens served (1% of its " in stores[0], stores  # 2 steps x 4 rows x 33
    assert "; per step 4.0 reads, " in stores[0], stores
    checks = float(stores[0].split("reads, ")[1].split(" checks")[0])
    assert 1 <= checks <= 4, stores  # every read of the first step is of a fresh store
    assert float(stores[0].split(" checks of ")[1].split(" KiB")[0]) <= 2, stores
    assert len(lines) == 2 and all("blocks of 512 bytes" in line for line in lines), lines
    assert all("1 rounds in each of 2 processes" in line for line in lines), lines
    hashed = [float(line.split("hashes ")[1].split(" bytes per token served")[0]) for line in lines]
    assert all(h >= 4 for h in hashed), lines  # uint32 tokens: a block is hashed whole
    assert ": 2 steps (1% of the tokens): hashes " in lines[0], lines
    assert ": 3 steps (2% of the tokens): hashes " in lines[1], lines


def test_the_mixed_restore_row_restores_a_ledger_of_recorded_set_mix_calls(tmp_path):
    """The row's checkpoint holds the calls in its data state, and the timed restore follows
    them: it is the restore of a run that steered its mixture, not of a plain one."""
    from benchmarks.contenders import Feed
    from pipeline.plan import data_state

    stores = [write_synthetic_store(tmp_path / n, [[60] * 300], record_tokens=64) for n in "ab"]
    config = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "lanes": 1,
              "sources": {n: {"path": str(s.path)} for n, s in zip("ab", stores)},
              "mix": {"a": 1, "b": 1}}  # fmt: skip
    feed = Feed({"config": config})
    try:
        plain = feed.restore(400, tmp_path)
        mixed = feed.restore(400, tmp_path, mixes=200)
    finally:
        feed.close()
    assert plain["total"] > 0 and mixed["total"] > 0
    ledger = data_state.load_ledger(tmp_path / "ours-400-mixes-200" / "400")
    assert [m.step for m in ledger.mixes] == list(range(0, 400, 2))
    assert {dict(m.weights)["a"] for m in ledger.mixes} == {2**20 // 3, 2 * 2**20 // 3}
    assert len(data_state.load_ledger(tmp_path / "ours-400" / "400").mixes) == 0
    assert 200 * 16 < mixed["state_bytes"] - plain["state_bytes"] < 200 * 30


def test_the_prepare_benchmark_sets_prepare_beside_the_limit_and_datasets_map(
    tmp_path, hf_tokenizer_json
):
    """benchmarks/prepare_bench.py's rows for docs/benchmarks.md: `prepare --workers` 1 and 2,
    the tokenizer's encode_batch (on its threads, on one, and `encode_batch_fast`) and
    `datasets.map(num_proc=2)` over the same texts, which count the tokens the tokenizer gives
    text by text; the store's count adds one eod per document."""
    import tokenizers

    texts = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" for i in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    command = [sys.executable, "benchmarks/prepare_bench.py", str(corpus), "--tokenizer",
               f"hf:{hf_tokenizer_json}", "--runners", "local", "--workers", "1,2",
               "--repeat", "1", "--num-shards", "2", "--num-proc", "2"]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| ")]
    names = [(row[0].removeprefix("| "), row[1]) for row in rows[1:]]  # after the header
    assert names == [
        ("local", "1"), ("local", "2"), ("encode_batch (the limit)", "threads"),
        ("encode_batch, one thread (the limit per CPU)", "1 thread"),
        ("encode_batch_fast", "threads"), ("datasets.map (the peer)", "num_proc=2"),
    ]  # fmt: skip
    model = tokenizers.Tokenizer.from_file(str(hf_tokenizer_json))
    tokens = sum(len(model.encode(t, add_special_tokens=False).ids) for t in texts)
    assert f"# encode_batch and datasets.map: {tokens:,} tokens (the store adds" in out.stdout
    assert f"40 documents, {tokens + 40:,} tokens" in out.stdout  # one eod per document


def test_the_prepare_benchmark_runs_the_peer_row_where_it_leaves_the_tokenizer_one_thread(
    tmp_path, hf_tokenizer_json
):
    """`datasets.map(num_proc=...)` sets TOKENIZERS_PARALLELISM=false in its process's C
    environment (what the tokenizers library reads) and restores only a Python copy of
    os.environ: run in the bench's process, it left every later encode_batch row, and
    `prepare --workers 1`, on one thread. Each row now runs in a process of its own."""
    import ctypes

    from benchmarks import prepare_bench

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"text {i}"}) + "\n" for i in range(20)))
    spec = f"hf:{hf_tokenizer_json}"
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    assert getenv(b"TOKENIZERS_PARALLELISM") is None  # nothing set it before
    for row in prepare_bench._rows(
        argparse.Namespace(runners="local", workers="1", inputs=[str(corpus)], num_shards=1,
                           tokenizer=spec, num_proc=2), str(tmp_path),
    ):  # fmt: skip
        figures = prepare_bench.measure(row[2])
        assert figures[0] > 0 and figures[1] > 0, row[:2]
    assert getenv(b"TOKENIZERS_PARALLELISM") is None


@pytest.mark.multiprocess
def test_the_bucket_bench_removes_the_stores_and_caches_it_wrote(tmp_path):
    """benchmarks/bucket_bench.py writes its stores, configs and host caches (~370 MB at its
    defaults) under a temporary directory, removed when it ends; one row per run of a source
    count, each a fresh process."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bucket_bench.py"
    args = ["--sources", "1", "--steps", "2", "--latency", "0", "--train-ms", "0"]
    done = subprocess.run(
        [sys.executable, str(bench), *args], env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [line.split("|")[2].strip() for line in done.stdout.splitlines()[2:]] == [
        "cold, fetch_ahead: 0", "cold", "warm",
    ]  # fmt: skip
    assert not list(tmp_path.glob("bucket-bench-*"))
