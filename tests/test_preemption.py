"""A preemption notice on a real multi-process run: every process saves at one agreed step and
exits with status 75, and resuming from that checkpoint is bit-exact.

The notice is SIGTERM to ONE of the processes (what a TPU VM gets before it is reclaimed, and
what tpu/stop.sh sends first); JAX's preemption service spreads it to the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.ingest.prepare import PrepareOptions, prepare

ROOT = Path(__file__).resolve().parent.parent
PREEMPTED = 75
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preempt")
    prepare(PrepareOptions(["builtin:python-docs"], root / "docs", num_shards=2, progress=False))
    path = root / "data.yaml"
    path.write_text("seed: 5\nseq_len: 32\nglobal_batch_size: 8\nlanes: 2\n"
                    "sources:\n  docs: {path: docs}\nmix: {docs: 1}\n")  # fmt: skip
    return path


def command(config: Path, ckpt: Path, metrics: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "scripts" / "train.py"), "--data-config", str(config),
        "--checkpoint-dir", str(ckpt), "--steps", str(steps), "--save-every", "1000000",
        "--width", "16", "--depth", "1", "--metrics", str(metrics),
        "--num-processes", "2", "--devices-per-process", "2", *extra,
    ]  # fmt: skip


def records(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in ("loss", "checksum", "total_weights")} for r in rows}


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigterm_to_one_process_saves_everywhere_and_resumes_bit_exactly(config, tmp_path):
    ckpt, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    launcher = subprocess.Popen(
        command(config, ckpt, first, 1_000_000),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: first.exists() and len(first.read_text().splitlines()) >= 3, 240, "steps")
        [worker] = [
            pid for pid in children(launcher.pid)
            if "--process-id\x001\x00" in Path(f"/proc/{pid}/cmdline").read_text()
        ]  # fmt: skip
        signalled_after = len(first.read_text().splitlines())
        os.kill(worker, signal.SIGTERM)  # process 1 only: process 0 learns of it through JAX
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == PREEMPTED, output
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert len(saved) == 1 and saved[0] >= signalled_after, (saved, output)
    step = saved[0]
    assert output.count(f"preempted: saved step {step} to {ckpt}") == 2, output
    assert "Traceback" not in output
    assert "[Gloo]" not in output  # JAX's CPU collectives print 8; the launcher drops them
    before = records(first)
    assert sorted(before) == list(range(step))

    resumed = subprocess.run(
        command(config, ckpt, tmp_path / "resumed.jsonl", step + 3, "--resume"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == ""
    reference = subprocess.run(
        command(config, tmp_path / "ref", tmp_path / "ref.jsonl", step + 3),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    expected = records(tmp_path / "ref.jsonl")
    after = records(tmp_path / "resumed.jsonl")
    assert sorted(after) == [step, step + 1, step + 2]
    assert {**before, **after} == expected  # loss and batch checksum, bit for bit
