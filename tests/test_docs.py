"""The docs site (mkdocs.yml) builds strictly, as `make docs` builds it: a broken link or
anchor, a missing reference, or a public name without a docstring or an API entry fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_with_every_page(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "api" / "index.html").read_text()
    names = hooks().public_names()
    assert len(names) > 30 and "pipeline.feed.data_feed.DataFeed" in names  # the walk works
    assert [name for name in names if f'id="{name}"' not in api] == []  # each has its entry
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "pipeline maxtext install" in cli and "--version" in cli
    assert "A training loop with save and restore" in (tmp_path / "index.html").read_text()


def test_a_public_name_without_a_docstring_or_an_entry_fails_the_build():
    module = hooks()
    page = (ROOT / "docs" / "api.md").read_text()
    module.check_api(page)  # complete as it is
    with pytest.raises(PluginError, match=r"no entry in docs/api.md: ::: pipeline.feed.data_feed"):
        module.check_api(page.replace("::: pipeline.feed.data_feed.DataFeed\n", ""))

    class Undocumented:
        def public(self) -> None:
            pass

    Undocumented.__module__ = "pipeline.example"
    found = list(module.undocumented({"pipeline.example.Undocumented": Undocumented}))
    assert found == ["pipeline.example.Undocumented", "pipeline.example.Undocumented.public"]
