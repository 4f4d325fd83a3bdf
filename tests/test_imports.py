"""The package's shape: layers that import down only, no import circle, small modules, and
light imports (the store, config, plan and ingest layers and the store commands start without
JAX).

The shape is read from the source with `ast`: every `import` of a `pipeline` module, at module
level or inside a function (or under `TYPE_CHECKING`), is an edge of the graph. The light
imports run in a fresh interpreter (this test process has JAX loaded already) and read
`sys.modules` afterwards, so any import of JAX, Orbax or Grain on the way fails the test.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"
# The layers, top to bottom (pipeline/__init__.py's docstring draws them): a module imports
# modules of its own package or of a lower rank only. Rank 0 is the shared top-level modules.
RANKS = {
    "commands": 6,
    "maxtext": 5,
    "feed": 4,
    "read": 3,
    "plan": 2,
    "ingest": 2,
    "config": 1,
    "store": 1,
}
FACADES = {"pipeline", "pipeline.__main__"}  # the package's names and `python -m pipeline`
MAX_LINES = 600
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
        "pipeline.plan.plan, pipeline.plan.report, pipeline.plan.resume, pipeline.read.plan",
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


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth of its source."""
    known = modules()
    graph = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                edges.add(node.module)
                edges.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {edge for edge in edges if edge in known and edge != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each one found as a path that comes back to its start."""
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                walk(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            walk(start, [start])
    return found


def rank(module: str) -> tuple[str, int]:
    """(layer, rank) of a module: its subpackage, or the shared top-level modules' rank 0."""
    parts = module.split(".")
    layer = parts[1] if len(parts) > 2 or parts[1] in RANKS else ""
    return layer, RANKS.get(layer, 0)


def test_the_import_graph_sees_imports_inside_functions_and_type_checking():
    graph = import_graph()
    assert "pipeline.feed.data_feed" in graph["pipeline.feed.eval_feed"]  # module level
    assert "pipeline.feed.metrics" in graph["pipeline.feed.data_feed"]  # in a method
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_package_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers_only():
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module not in FACADES
        for target in sorted(targets)
        if rank(target)[0] != rank(module)[0] and rank(target)[1] >= rank(module)[1]
    ]
    assert upward == []


def test_every_layer_is_ranked():
    layers = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert layers == set(RANKS)


@pytest.mark.parametrize("path", sorted(modules().values()), ids=lambda p: p.name)
def test_no_module_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
