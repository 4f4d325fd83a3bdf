"""`prepare --runner beam` on Beam's DaskRunner, against a real `dask.distributed` cluster of two
worker processes on loopback, writes the local runner's store byte for byte."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dask.distributed import Client, LocalCluster

from pipeline.ingest.prepare import PrepareOptions, prepare
from tests.test_prepare_beam import _assert_same_stores, _cli, _no_leftovers, write_mixed_corpus


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two single-threaded worker processes and a scheduler, on 127.0.0.1 only, closed after."""
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=None,
    ) as local:  # fmt: skip
        yield local


def _executed(cluster: LocalCluster) -> list[int]:
    """How many tasks each worker process has run so far."""
    with Client(cluster) as client:
        counts = client.run(lambda dask_worker: dask_worker.state.executed_count)
    return [counts[address] for address in sorted(counts)]


def test_the_dask_runner_on_two_worker_processes_writes_the_local_store(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    inputs = [*write_mixed_corpus(tmp_path), "builtin:python-docs"]
    options = ["--num-shards", "4", "--eval-fraction", "0.2", "--seed", "5"]
    before = _executed(cluster)
    run = _cli(
        "prepare", *inputs, "--out", str(tmp_path / "dask"), *options, "--no-progress",
        "--runner", "beam", "--",
        "--runner=DaskRunner", f"--dask_client_address={cluster.scheduler_address}",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "prepare: Beam pipeline on DaskRunner" in run.stderr.splitlines()
    assert not [line for line in run.stderr.splitlines() if "distributed" in line], run.stderr
    after = _executed(cluster)
    assert all(b > a for a, b in zip(before, after)), (before, after)  # both did work
    local = prepare(
        PrepareOptions(inputs, tmp_path / "local", num_shards=4, eval_fraction=0.2, seed=5,
                       progress=False)
    )  # fmt: skip
    _assert_same_stores(local, {"train": tmp_path / "dask", "eval": tmp_path / "dask-eval"})
    assert _no_leftovers(tmp_path) == []


def test_bad_data_read_on_a_dask_worker_is_one_line(tmp_path: Path, cluster: LocalCluster) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    out = tmp_path / "out"
    run = _cli(
        "prepare", str(bad), "--out", str(out), "--no-progress", "--runner", "beam", "--",
        "--runner=dask", f"--dask_client_address={cluster.scheduler_address}",
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (
        f"error: {bad} line 2 is not JSON (Expecting value at column 1); JSON Lines need one "
        "JSON object per line"
    )
    assert not out.exists() and _no_leftovers(tmp_path) == []


def test_an_unreachable_scheduler_is_one_line_in_seconds(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Also: Dask's INFO logging (a local cluster's 35 lines of workers joining and leaving)
    is set to warnings for this process and the workers it starts, through Dask's config."""
    import os
    import time

    from pipeline.commands.cli import main
    from tests.test_gs_paths import closed_port

    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED", raising=False)
    (tmp_path / "a.txt").write_text("some text")
    address = f"tcp://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    code = main(
        ["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--no-progress",
         "--runner", "beam", "--", "--runner=DaskRunner", f"--dask_client_address={address}"]
    )  # fmt: skip
    assert time.monotonic() - started < 20
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(
        f"error: --dask_client_address={address}: cannot connect to the Dask scheduler "
        "(Connection refused)"
    )
    assert _no_leftovers(tmp_path) == []
    assert os.environ["DASK_LOGGING__DISTRIBUTED"] == "warning"
