"""`pipeline maxtext install` on fixtures of MaxText's files in each layout it supports.

The fixtures (tests/fixtures/maxtext/README.md) have the shape of MaxText's own files at three
points of its history. The patched dispatch is run for real (on 4 forced CPU devices, with the
MaxText-shaped config of tests/test_maxtext.py), the patched types.py is built by pydantic and
the patched base.yml is read by a YAML parser.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

from pipeline.commands.cli import main
from tests.test_maxtext import close, maxtext_config, write_data_yaml

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "maxtext"
LAYOUTS = {  # fixture -> package directory inside it
    "MaxText-2025-07": "MaxText",
    "src-MaxText-2025-12": "src/MaxText",
    "src-maxtext-2026-08": "src/maxtext",
}
KEYS = {
    "pipeline_data_config": "",
    "pipeline_data_switch": False,
    "pipeline_data_skip": 0,
    "pipeline_eval_source": "",
}


@pytest.fixture
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))


def checkout(tmp_path: Path, fixture: str) -> Path:
    root = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, root)
    return root


def install(capsys, *args: str | Path) -> tuple[int, str, str]:
    code = main(["maxtext", "install", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def run_dispatch(interface: Path, config, mesh):
    """Run the patched create_data_iterator alone, without MaxText's imports."""
    tree = ast.parse(interface.read_text())
    function = next(n for n in tree.body if getattr(n, "name", "") == "create_data_iterator")
    function.args.args[0].annotation = None  # `pyconfig.HyperParameters` is MaxText's
    namespace: dict = {}
    exec(compile(ast.Module([function], []), str(interface), "exec"), namespace)
    return namespace["create_data_iterator"](config, mesh)


def load_types(path: Path):
    spec = importlib.util.spec_from_file_location(f"maxtext_types_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fixture", sorted(LAYOUTS))
def test_install_patches_each_layout_and_the_dispatch_serves_batches(
    fixture, tmp_path, capsys, mesh, monkeypatch
):
    monkeypatch.delenv("PIPELINE_DATA_CONFIG", raising=False)
    root = checkout(tmp_path, fixture)
    package = root / LAYOUTS[fixture]
    code, out, err = install(capsys, root)
    assert (code, err) == (0, "")
    assert "patched input_pipeline/input_pipeline_interface.py" in out
    interface = package / "input_pipeline" / "input_pipeline_interface.py"
    text = interface.read_text()
    docstring = '  """Create train and eval data iterators given configs and mesh."""\n\n'
    assert docstring + "  from pipeline import maxtext as pipeline_maxtext" in text
    assert "  if pipeline_maxtext.is_enabled(config):\n    return pipeline_maxtext" in text

    data = write_data_yaml(tmp_path)
    train, evals = run_dispatch(interface, maxtext_config(data), mesh)
    assert set(next(train)) >= {"inputs", "targets", "inputs_segmentation"}
    close(train, evals)
    with pytest.raises(NameError, match=r"SyntheticDataIterator|make_grain_train_iterator"):
        # without the key, MaxText's own dispatch runs (its names are not loaded here)
        run_dispatch(interface, maxtext_config(data, pipeline_data_config=""), mesh)

    base = yaml.safe_load((package / "configs" / "base.yml").read_text())
    assert {key: base[key] for key in KEYS} == KEYS
    assert list(base).index("pipeline_data_config") == list(base).index("dataset_type") + 1
    types = package / "configs" / "types.py"
    if types.exists():
        module = load_types(types)
        config = module.MaxTextConfig()
        assert {key: getattr(config, key) for key in KEYS} == KEYS
        assert module.DatasetGeneral.model_fields["pipeline_data_switch"].annotation is bool
        switched = module.MaxTextConfig(pipeline_data_switch="true", pipeline_data_config="d.yaml")
        assert switched.pipeline_data_switch is True
        assert module.DatasetGeneral.model_fields["pipeline_data_skip"].annotation is int
        assert module.MaxTextConfig(pipeline_data_skip="10").pipeline_data_skip == 10
    else:
        assert "no configs/types.py" in out


@pytest.mark.parametrize("fixture", sorted(LAYOUTS))
def test_a_second_install_changes_nothing(fixture, tmp_path, capsys):
    root = checkout(tmp_path, fixture)
    assert install(capsys, root, "--elastic")[0] == 0
    before = snapshot(root)
    code, out, _ = install(capsys, root, "--elastic")
    assert code == 0
    assert "nothing to change, already installed" in out
    assert snapshot(root) == before


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path, capsys):
    root = checkout(tmp_path, "src-maxtext-2026-08")
    before = snapshot(root)
    code, out, _ = install(capsys, root, "--dry-run")
    assert code == 0
    assert snapshot(root) == before
    assert "--- a/src/maxtext/input_pipeline/input_pipeline_interface.py\n" in out
    assert "+++ b/src/maxtext/configs/types.py\n" in out
    assert "+pipeline_data_switch: False\n" in out
    assert '+  pipeline_data_switch: bool = Field(False, description="' in out


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_relative_path_works_and_the_output_names_the_package_patched(
    dry_run, tmp_path, capsys, monkeypatch
):
    root = checkout(tmp_path, "src-maxtext-2026-08")
    monkeypatch.chdir(tmp_path)
    code, out, err = install(capsys, root.name, *(["--dry-run"] if dry_run else []))
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"MaxText package: {(root / 'src/maxtext').resolve()}"
    if dry_run:
        assert "--- a/src/maxtext/input_pipeline/input_pipeline_interface.py\n" in out
    else:
        assert "patched input_pipeline/input_pipeline_interface.py" in out


def test_the_installed_package_directory_is_a_layout_too(tmp_path, capsys):
    package = checkout(tmp_path, "src-maxtext-2026-08") / "src" / "maxtext"
    code, out, _ = install(capsys, package)
    assert code == 0
    assert "patched configs/types.py" in out


@pytest.mark.parametrize("fixture", ["MaxText-2025-07", "src-MaxText-2025-12"])
def test_elastic_adds_a_restore_case_before_the_grain_case(fixture, tmp_path, capsys):
    root = checkout(tmp_path, fixture)
    code, out, _ = install(capsys, root, "--elastic")
    assert code == 0 and "restore the data state with any process count" in out
    path = root / LAYOUTS[fixture] / "checkpointing.py"
    text = path.read_text()
    tree = ast.parse(text)
    function = next(n for n in tree.body if getattr(n, "name", "") == "load_state_if_possible")
    match = next(n for n in ast.walk(function) if isinstance(n, ast.Match))
    guards = [ast.get_source_segment(text, c.guard) or "" for c in match.cases]
    ours = next(i for i, g in enumerate(guards) if 'hasattr(data_iterator, "restore_from")' in g)
    grain = next(i for i, g in enumerate(guards) if '"grain"' in g)
    assert ours == grain - 1
    body = "\n".join(ast.get_source_segment(text, node) for node in match.cases[ours].body)
    assert "data_iterator.restore_from(checkpoint_manager.directory / str(step) / " in body
    assert "Composite(items=checkpoint_args)" in body


def test_elastic_is_not_needed_where_maxtext_has_the_shared_state_path(tmp_path, capsys):
    root = checkout(tmp_path, "src-maxtext-2026-08")
    before = (root / "src/maxtext/common/checkpointing.py").read_text()
    code, out, _ = install(capsys, root, "--elastic")
    assert code == 0
    assert "ElasticIterator path); no change" in out
    assert (root / "src/maxtext/common/checkpointing.py").read_text() == before


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: shutil.rmtree(p / "input_pipeline"), "no MaxText input pipeline found"),
        (
            lambda p: _rewrite(
                p / "input_pipeline/input_pipeline_interface.py",
                "def create_data_iterator(",
                "def make_iterators(",
            ),
            "no top-level function create_data_iterator()",
        ),
        (
            lambda p: _rewrite(p / "configs/base.yml", "dataset_type: tfds", "data: tfds"),
            "no top-level 'dataset_type:' line",
        ),
        (
            lambda p: _rewrite(
                p / "configs/types.py", "  dataset_type: DatasetType", "  kind: str"
            ),
            "no class declares 'dataset_type'",
        ),
        (
            lambda p: _rewrite(p / "checkpointing.py", '"grain"', '"arrayrecord"'),
            'no `match` case for dataset_type "grain"',
        ),
    ],
)
def test_a_missing_anchor_is_refused_in_one_line_and_nothing_is_written(
    damage, message, tmp_path, capsys
):
    root = checkout(tmp_path, "src-MaxText-2025-12")
    damage(root / "src" / "MaxText")
    before = snapshot(root)
    code, _, err = install(capsys, root, "--elastic")
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert snapshot(root) == before


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
