"""scripts/device_check.sh, the accelerator check, in its CPU fallback: it runs end to end and
its table says the compact transfer's expansion equals the six fields on every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_its_cpu_fallback(tmp_path: Path) -> None:
    out = tmp_path / "device_check.md"
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--out", str(out),
         "--cache-dir", str(tmp_path / "cache")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the CPU fallback" in done.stderr
    table = out.read_text()
    assert table.splitlines()[0].startswith("Device check, ")
    assert "2 x cpu (cpu)" in table and "CPU fallback" in table
    identical = re.findall(r"bit for bit .*\| (\d+) of (\d+) steps \|", table)
    assert len(identical) == 2  # windows and whole documents
    assert all(same == total and int(total) > 0 for same, total in identical)
    for measure in (
        "jax.device_put",
        "input-bound fraction",
        "DataFeed free-running, expand: host (what auto picks here)",
        "DataFeed free-running, expand: device",
    ):
        assert measure in table
