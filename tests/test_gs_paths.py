"""A gs:// location is never turned into a local path (Path("gs://b/x") is "gs:/b/x")."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.urls import is_url

ROOT = Path(__file__).resolve().parent.parent
RAW = {"seq_len": 8, "global_batch_size": 2, "mix": {"web": 1}}


def trainer():
    spec = importlib.util.spec_from_file_location("train", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("url", ["gs://bucket/ckpt/run-1", "s3://b/x", "gs://b"])
def test_the_trainer_keeps_a_checkpoint_url_as_given(url):
    assert trainer().location(url) == url


def test_the_trainer_makes_a_local_checkpoint_dir_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert trainer().location("runs/x") == str(tmp_path / "runs" / "x")


@pytest.mark.parametrize("text", ["gs://b/x", "gs:/b/x", "s3://b", Path("gs://b/x")])
def test_urls_and_their_path_mangled_form_are_recognised(text):
    assert is_url(text)


@pytest.mark.parametrize("text", ["/mnt/data", "runs/gs", "C:/x", "./gs:x"])
def test_local_paths_are_not_urls(text):
    assert not is_url(text)


@pytest.mark.parametrize("path", ["gs://bucket/stores/web", "${DATA}/web"])
def test_a_store_url_stays_a_url(path, monkeypatch):
    monkeypatch.setenv("DATA", "gs://bucket/stores")
    config = parse_config({**RAW, "sources": {"web": {"path": path}}}, origin="run.yaml")
    assert str(config.sources[0].path) == "gs://bucket/stores/web"
    assert is_url(config.sources[0].path)


def test_a_config_read_from_a_url_needs_absolute_store_paths():
    with pytest.raises(ConfigError, match=r"sources\.web\.path: relative path 'web'"):
        parse_config({**RAW, "sources": {"web": {"path": "web"}}}, "gs://b/c.yaml", None)
    config = parse_config(
        {**RAW, "sources": {"web": {"path": "/mnt/data/web"}}}, "gs://b/c.yaml", None
    )
    assert config.sources[0].path == Path("/mnt/data/web")


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    "command",
    [["prepare", "{text}", "--out", "gs://b/s", "--no-progress"], ["verify-store", "gs://b/s"]],
)
def test_an_unreachable_bucket_is_one_line_exit_2_in_seconds(tmp_path, command):
    text = tmp_path / "a.txt"
    text.write_text("some text")
    port = closed_port()
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *(a.format(text=text) for a in command)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert time.monotonic() - started < 20  # gcsfs alone retried for ~35 s
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: gs://b/s") and len(done.stderr.splitlines()) == 1
    assert (
        f"cannot connect to Cloud Storage at 127.0.0.1:{port} (Connection refused)" in done.stderr
    )


@pytest.fixture
def unreachable(monkeypatch) -> int:
    """STORAGE_EMULATOR_HOST at a closed loopback port: Cloud Storage without a network."""
    port = closed_port()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    return port


@pytest.fixture(scope="module")
def local_config(tmp_path_factory) -> Path:
    from tests.storegen import write_synthetic_store

    root = tmp_path_factory.mktemp("gs-paths")
    write_synthetic_store(root / "web", [[300, 200]])
    (root / "data.yaml").write_text(
        "seq_len: 8\nglobal_batch_size: 2\nsources: {web: {path: web}}\nmix: {web: 1}\n"
    )
    return root / "data.yaml"


@pytest.mark.parametrize(
    "command",
    [["stages"], ["epochs"], ["inspect", "--step", "0"], ["verify", "--steps", "0:2"],
     ["dump", "--steps", "0:1", "--out", "d.npz"], ["plot", "--steps", "0:2", "--out", "p.png"]],
)  # fmt: skip
def test_a_ledger_in_an_unreachable_bucket_is_one_line_in_seconds(
    local_config, unreachable, capsys, command
):
    from pipeline.commands.cli import main

    started = time.monotonic()
    code = main([command[0], str(local_config), "--ledger", "gs://b/ckpt/40", *command[1:]])
    assert time.monotonic() - started < 20  # gcsfs alone retried for ~35 s per request
    error = capsys.readouterr().err
    assert code == 2 and len(error.splitlines()) == 1, error
    assert error.startswith(
        f"error: gs://b/ckpt/40: cannot connect to Cloud Storage at 127.0.0.1:{unreachable} "
    )


@pytest.mark.parametrize(
    "argv",
    [["gs://bucket/meg/pile"], ["gs://bucket/pq", "--format", "parquet"],
     ["/data/pile", "--out", "gs://bucket/index"]],
)  # fmt: skip
def test_an_in_place_corpus_in_a_bucket_is_refused_in_one_line(tmp_path, capsys, argv, monkeypatch):
    from pipeline.commands.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["index", *argv]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is indexed and read from a local path" in error, error
    assert not any(tmp_path.iterdir())  # no "gs:" directory made
