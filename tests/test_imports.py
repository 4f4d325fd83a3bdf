"""Light imports: the store, config and plan layers and the store commands start without JAX.

Each check runs in a fresh interpreter (this test process has JAX loaded already) and reads
`sys.modules` afterwards, so any import of JAX, Orbax or Grain on the way fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "orbax", "grain")
REPORT = f"""
import sys
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
print("heavy:" + ",".join(loaded))
"""


def loaded_after(code: str) -> list[str]:
    """The heavy top-level packages a fresh interpreter holds after running `code`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code + REPORT], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("heavy:"))
    return [name for name in line.removeprefix("heavy:").split(",") if name]


def run_cli(*argv: str) -> str:
    """`python -m pipeline ARGV` in-process of a fresh interpreter (exit status kept)."""
    return (
        "import runpy, sys\n"
        f"sys.argv = ['pipeline', *{list(argv)!r}]\n"
        "try:\n"
        "    runpy.run_module('pipeline', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    assert not stop.code, stop.code\n"
    )


@pytest.mark.parametrize(
    "modules",
    [
        "pipeline.config, pipeline.store",
        "pipeline.plan.plan, pipeline.plan.report, pipeline.plan.audit, pipeline.plan.resume",
        "pipeline, pipeline.commands.cli, pipeline.ingest.prepare, pipeline.commands.summary",
    ],
)
def test_the_lower_layers_import_without_jax_orbax_or_grain(modules):
    assert loaded_after(f"import {modules}") == []


def test_pipeline_help_loads_no_jax_orbax_or_grain():
    assert loaded_after(run_cli("--help")) == []


def test_prepare_and_verify_store_run_without_jax_orbax_or_grain(tmp_path):
    (tmp_path / "a.txt").write_text("some text to tokenize\n" * 20)
    store = tmp_path / "store"
    code = run_cli("prepare", str(tmp_path / "a.txt"), "--out", str(store), "--num-shards", "2")
    code += run_cli("verify-store", str(store))
    assert loaded_after(code) == []
    assert (store / "manifest.json").is_file()


def test_the_feed_still_loads_jax_lazily_through_the_package():
    assert "jax" in loaded_after("import pipeline\npipeline.DataFeed")


def test_only_bench_loads_the_benchmark_file():
    help_only = run_cli("--help") + "assert 'pipeline_bench' not in sys.modules\n"
    assert loaded_after(help_only) == []
