"""A missing optional extra stops with one line that names the extra to install (exit 2).

Each case runs in a fresh interpreter whose prelude sets `sys.modules[name] = None`, which makes
every import of that package fail for real, as on a machine without the extra.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipeline.errors import MissingExtraError
from pipeline.extras import require
from pipeline.ingest.prepare import PrepareOptions, prepare

ROOT = Path(__file__).resolve().parents[1]


def run_without(package: str, program: str, *argv: str) -> subprocess.CompletedProcess:
    """`program` (`-m pipeline` or a script path) run as if `package` were not installed."""
    runner = (
        "runpy.run_module('pipeline', run_name='__main__')"
        if program == "pipeline"
        else f"runpy.run_path({program!r}, run_name='__main__')"
    )
    code = (
        f"import runpy, sys\nsys.modules[{package!r}] = None\n"
        f"sys.argv = [{program!r}, *{list(argv)!r}]\n{runner}\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'scripts'}"},
        check=False,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real store and a data config over it, and files the cases name."""
    root = tmp_path_factory.mktemp("extras")
    (root / "text.txt").write_text("a small document to tokenize\n" * 40)
    prepare(PrepareOptions([str(root / "text.txt")], root / "store", num_shards=1, progress=False))
    (root / "data.yaml").write_text(
        "seq_len: 8\nglobal_batch_size: 2\nsources: {a: {path: store}}\nmix: {a: 1}\n"
    )
    (root / "table.parquet").write_bytes(b"PAR1")  # never read: the extra is checked first
    (root / "spm.model").write_bytes(b"")
    (root / "tokenizer.json").write_text("{}")
    return root


CASES = {
    "parquet": ("pyarrow", "pipeline", ["prepare", "{d}/table.parquet", "--out", "{d}/p"]),
    "sentencepiece": (
        "sentencepiece",
        "pipeline",
        ["prepare", "{d}/text.txt", "--tokenizer", "sentencepiece:{d}/spm.model", "--out", "{d}/s"],
    ),
    "hf": (
        "tokenizers",
        "pipeline",
        ["prepare", "{d}/text.txt", "--tokenizer", "hf:{d}/tokenizer.json", "--out", "{d}/h"],
    ),
    "plot": (
        "matplotlib",
        "pipeline",
        ["plot", "{d}/data.yaml", "--steps", "0:4", "--out", "{d}/mix.png"],
    ),
    "beam": (
        "apache_beam",
        "pipeline",
        ["prepare", "{d}/text.txt", "--out", "{d}/b", "--runner", "beam"],
    ),
    "dask": (
        "dask",
        "pipeline",
        ["prepare", "{d}/text.txt", "--out", "{d}/k", "--runner", "beam", "--", "--runner=dask"],
    ),
    "dask-without-beam": (  # the dask extra brings Beam too: named first, not beam then dask
        "apache_beam",
        "pipeline",
        ["prepare", "{d}/text.txt", "--out", "{d}/k", "--runner", "beam", "--", "--runner", "dask"],
    ),
    "gcs": ("gcsfs", "pipeline", ["prepare", "{d}/text.txt", "--out", "gs://my-bucket/stores/t"]),
    "train": (
        "optax",
        "scripts/train.py",
        ["--data-config", "{d}/data.yaml", "--checkpoint-dir", "{d}/ckpt", "--steps", "1"],
    ),
}
EXTRA = {"parquet": "parquet", "sentencepiece": "tokenizers", "hf": "tokenizers", "plot": "plot",
         "beam": "beam", "dask": "dask", "dask-without-beam": "dask", "train": "train",
         "gcs": "gcs"}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_extra_is_one_line_naming_it(case, data):
    package, program, argv = CASES[case]
    done = run_without(package, program, *(a.format(d=data) for a in argv))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    assert f"needs {package}, which is not installed" in done.stderr
    assert f"pip install 'pipeline[{EXTRA[case]}]'" in done.stderr


def test_require_returns_the_module_when_installed():
    assert require("yaml", "core", "a test").safe_load("a: 1") == {"a": 1}


def test_a_failure_inside_an_installed_package_is_not_called_a_missing_extra(tmp_path):
    (tmp_path / "broken_extra").mkdir()
    (tmp_path / "broken_extra" / "__init__.py").write_text("import not_a_real_module_xyz\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError, match="not_a_real_module_xyz"):
            require("broken_extra", "plot", "a test")
        with pytest.raises(MissingExtraError, match=r"pip install 'pipeline\[plot\]'"):
            require("absent_package_xyz", "plot", "a test")
    finally:
        sys.path.remove(str(tmp_path))


def core_distributions() -> set[str]:
    """Every distribution `pip install .` brings, from the installed packages' metadata: the
    core dependencies of pyproject.toml and, transitively, theirs (extras not followed)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    todo = [Requirement(r) for r in re.findall(r'^\s*"([^"]+)"', block[1], re.M)]
    seen: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        with contextlib.suppress(metadata.PackageNotFoundError):
            todo += map(Requirement, metadata.requires(requirement.name) or [])
    return seen


def extra_packages() -> dict[str, set[str]]:
    """pyproject.toml's extras: name -> the distributions it lists."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras: dict[str, set[str]] = {}
    for name, body in re.findall(r"^(\w+) = \[(.*?)\]\s*(?:#[^\n]*)?$", block, re.M | re.S):
        names = re.findall(r'"([^"]+)"', body)
        extras[name] = {canonicalize_name(Requirement(r).name) for r in names}
    return extras


def test_the_install_guide_says_which_extras_the_core_already_brings():
    guide = (ROOT / "docs" / "install.md").read_text()  # the extras table
    core = core_distributions()
    assert {"tensorflow-datasets", "orbax-checkpoint", "numpy"} <= core  # the walk works
    for extra, packages in extra_packages().items():
        [row] = re.findall(rf"^\| `{extra}` \|.*$", guide, re.M) or [f"no row for {extra}"]
        assert ("already in the core install" in row) == (packages <= core), (extra, row)


def test_the_install_guides_missing_extra_example_can_happen_after_a_plain_install(data):
    guide = " ".join((ROOT / "docs" / "install.md").read_text().split())
    example = re.search(r"stops with one line naming it, e\.g\. `(error: [^`]+)`", guide)[1]
    package, extra = re.search(
        r"needs (\S+), which is not installed: pip install 'pipeline\[(\w+)\]'", example
    ).groups()
    assert canonicalize_name(package) in extra_packages()[extra]
    assert canonicalize_name(package) not in core_distributions()
    tokenizer = re.search(r"tokenizer '([^']+)'", example)[1]
    text = data / "text.txt"
    done = run_without(
        package,
        "pipeline",
        "prepare",
        str(text),
        "--tokenizer",
        tokenizer,
        "--out",
        str(data / "x"),
    )
    assert done.stderr == example + "\n"
