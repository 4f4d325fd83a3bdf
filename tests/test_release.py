"""The release: one version everywhere, and the package as a user installs it.

A wheel is built from a copy of the source (`pip wheel --no-build-isolation`, offline) and
installed into a fresh virtual environment; its dependencies come from the environment running
the tests, through a path entry (not a copy, and not the source tree: the commands run from a
temporary directory without PYTHONPATH, and the test checks which `pipeline` they import). There
the CLI's `--help` and `--version` run, and the README's training loop trains two steps, then
resumes from its checkpoint to step 4 with exactly the batches its ledger plans.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from pipeline.commands.cli import main
from pipeline.plan.data_state import load_ledger
from pipeline.plan.ledger import Ledger
from pipeline.read.plan import Plan
from pipeline.store.meta import MANIFEST
from pipeline.version import VERSION_KEY, __version__
from tests.storegen import write_synthetic_store

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The README's training loop: its first python code block."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```python\n(.*?)```", text, re.S)
    assert found, "README.md has no python code block"
    return found.group(1)


def test_the_version_is_one_string_everywhere(capsys):
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = {attr = "pipeline.version.__version__"}' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"pipeline {__version__}\n"
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_stores_indexes_and_ledgers_record_the_version_outside_their_identity(tmp_path):
    """Each file records the release that wrote it; one without it (written before 0.3.0)
    still reads, as the same data: the version is in no fingerprint."""
    from pipeline.store.formats import open_store
    from pipeline.store.identity import MANIFEST_CHECKSUM, manifest_digest
    from pipeline.store.megatron_format import write_megatron
    from pipeline.store.megatron_index import build_index

    store = write_synthetic_store(tmp_path / "store", [[5, 9], [7]])
    write_megatron(tmp_path / "corpus", [[[1, 2, 3, 0]], [[4, 5, 0]]])
    index = build_index(tmp_path / "corpus")
    plan = Plan.from_config(_config(tmp_path / "store"))
    ledger = plan.ledger.to_json()
    files = [tmp_path / "store" / MANIFEST, next(index.glob("*.json"))]
    fingerprints = [store.fingerprint, open_store(index).fingerprint]
    for file in files:
        record = json.loads(file.read_text())
        assert record[VERSION_KEY] == __version__
        del record[VERSION_KEY]  # as 0.2.0 wrote it
        record[MANIFEST_CHECKSUM] = manifest_digest(record)
        file.write_text(json.dumps(record))
    assert store.fingerprint == type(store)(tmp_path / "store").fingerprint == fingerprints[0]
    assert open_store(index).fingerprint == fingerprints[1]
    assert ledger[VERSION_KEY] == __version__
    older = {key: value for key, value in ledger.items() if key != VERSION_KEY}
    assert Ledger.from_json(older).segments == plan.ledger.segments


def _config(store: Path):
    from pipeline.config import parse_config

    raw = {"seed": 1, "seq_len": 4, "global_batch_size": 2, "sources": {"s": {"path": str(store)}},
           "mix": {"s": 1}}  # fmt: skip
    return parse_config(raw, origin="release.yaml")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from this tree; returns its bin directory."""
    root = tmp_path_factory.mktemp("release")
    source = root / "source"  # a copy: the build writes build/ and *.egg-info beside its input
    shutil.copytree(ROOT / "pipeline", source / "pipeline",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist"]
    run([*build, source], cwd=root)
    wheel = next((root / "dist").glob("pipeline-*.whl"))
    assert wheel.name == f"pipeline-{__version__}-py3-none-any.whl"
    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], cwd=root)
    python = root / "venv" / "bin" / "python"
    run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=root)
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               cwd=root).strip()  # fmt: skip
    # the dependencies: this environment's packages, after the venv's own (a path, so its
    # .pth files, an editable install of this tree among them, are not run)
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root / "venv" / "bin"


def run(argv: list, cwd: Path) -> str:
    """Run `argv` without this tree on the path; its stdout (a failure shows stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_installed_wheel_runs_the_cli(installed, tmp_path):
    assert run([installed / "pipeline", "--version"], tmp_path) == f"pipeline {__version__}\n"
    assert "prepare" in run([installed / "pipeline", "--help"], tmp_path)
    where = (
        "import pipeline, importlib.metadata as m; print(pipeline.__file__, m.version('pipeline'))"
    )
    file, version = run([installed / "python", "-c", where], tmp_path).split()
    assert Path(file).is_relative_to(installed.parent) and version == __version__


def test_the_readme_loop_trains_and_resumes_from_the_installed_wheel(installed, tmp_path):
    """Two steps, then a restart to step 4: the checkpoint's model has counted exactly the
    targets of the batches its ledger plans for steps 0..3 (no step replayed or skipped)."""
    example = readme_example()
    assert "STEPS = 4" in example
    saved = "\nimport pipeline\nnp.save('counts.npy', np.asarray(model['counts']))\n"
    saved += "print(pipeline.__file__)\n"
    (tmp_path / "two.py").write_text(example.replace("STEPS = 4", "STEPS = 2") + saved)
    (tmp_path / "four.py").write_text(example + saved)
    out = run([installed / "python", "two.py"], tmp_path)
    assert "trained to step 2" in out and str(installed.parent) in out
    out = run([installed / "python", "four.py"], tmp_path)
    assert "trained to step 4" in out
    state = json.loads((tmp_path / "ckpt" / "4" / "data" / "data_state.json").read_text())
    assert state["ledger"][VERSION_KEY] == __version__
    ledger = load_ledger(tmp_path / "ckpt" / "4")
    plan = Plan(ledger)
    targets = np.concatenate([plan.batch(step)["targets"].ravel() for step in range(4)])
    [store] = plan.stores()
    assert json.loads((Path(store.path) / MANIFEST).read_text())[VERSION_KEY] == __version__
    expected = np.bincount(targets, minlength=store.vocab_size)
    np.testing.assert_array_equal(np.load(tmp_path / "counts.npy"), expected)
