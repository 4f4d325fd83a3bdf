"""A config's store paths resolve as `Path.resolve` resolves them, whatever links lie on the way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.config.paths import resolved

PARTS = ["a", "b", "c", "f", "missing", "to_a", "to_b", "up_c", "dangling", "to_f", ".", ".."]
# a link loop only last: a path through one reaches no store (the system refuses it), and
# `Path.resolve` then gives up and normalises the rest lexically, which nothing should rely on
LAST = [*PARTS, "loop"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Directories, a file, and links of each kind: to a directory (absolute and relative),
    to a file, dangling, and a loop."""
    root = tmp_path_factory.mktemp("links")
    (root / "a" / "b").mkdir(parents=True)
    (root / "c").mkdir()
    (root / "a" / "f").write_bytes(b"")
    for where in (root, root / "a", root / "a" / "b", root / "c"):
        os.symlink(root / "a", where / "to_a")
        os.symlink(root / "a" / "b", where / "to_b")
        os.symlink("../c" if where != root else "c", where / "up_c")
        os.symlink(where / "nowhere", where / "dangling")
        os.symlink(where / "loop", where / "loop")
        os.symlink(root / "a" / "f", where / "to_f")
    return root


PATHS = st.tuples(st.lists(st.sampled_from(PARTS), max_size=3), st.sampled_from(LAST)).map(
    lambda drawn: [*drawn[0], drawn[1]]
)


def _resolve(resolve, path: str) -> str:
    try:
        return resolve(path)
    except (OSError, RuntimeError) as error:
        return type(error).__name__


@settings(max_examples=60, deadline=None)
@given(st.lists(PATHS, min_size=1, max_size=8))
def test_paths_resolved_through_shared_parents_are_path_resolves(tree, paths):
    directories: dict = {}  # shared by every path, as a config's stores share it
    for parts in paths:
        path = os.path.join(tree, *parts)
        want = _resolve(lambda p: str(Path(p).resolve()), path)
        assert _resolve(lambda p: str(resolved(p, directories)), path) == want, path
        got = _resolve(lambda p: resolved(p, directories), path)
        assert isinstance(got, str) or got == Path(want), path  # the same Path, not only text


def test_a_config_names_each_store_by_its_resolved_path(tree):
    """Relative paths against the config's directory, through a link to a directory and to a
    store that is itself a link."""
    raw = {
        "seed": 0,
        "seq_len": 8,
        "global_batch_size": 2,
        "sources": {"s": {"path": "to_a/b"}, "t": {"path": "a/to_b"}, "u": {"path": "c/../c"}},
        "mix": {"s": 1, "t": 1, "u": 1},
    }
    config = parse_config(raw, origin="x.yaml", base_dir=tree)
    assert [str(spec.path) for spec in config.sources] == [
        str(tree.resolve() / "a" / "b"),
        str(tree.resolve() / "a" / "b"),
        str(tree.resolve() / "c"),
    ]
