"""MkDocs hooks (mkdocs.yml): the pages made from the code at build time, and the check that
every public name is documented.

* `cli.md`: `pipeline --help` and every subcommand's, from the CLI's argparse parser itself, so
  the page cannot fall behind the options.
* `index.md` and `changelog.md`: README.md and CHANGELOG.md, their links made relative to docs/.
* Every public name (`pipeline.__all__` and the MaxText iterator's `__all__`) has a docstring,
  its public methods and properties too, and an entry (`::: module.name`) in docs/api.md; a
  name without one fails the build with the list (`mkdocs build --strict` is `make docs`).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
WIDTH = "100"  # the help texts' line width, whatever terminal builds the site


def public_names() -> dict[str, Any]:
    """`module.name` -> object, for every name a user of the library imports."""
    import pipeline
    from pipeline.maxtext import adapter

    names = {}
    for module, listed in ((pipeline, pipeline.__all__), (adapter, adapter.__all__)):
        for name in listed:
            value = getattr(module, name)
            names[f"{value.__module__}.{name}"] = value
    return names


def undocumented(names: dict[str, Any]) -> Iterator[str]:
    """Each public name, method or property without a docstring."""
    for path, value in names.items():
        if not inspect.getdoc(value):
            yield path
        if not inspect.isclass(value):
            continue
        for cls in value.__mro__:
            if not cls.__module__.startswith("pipeline"):
                continue
            for member, raw in vars(cls).items():
                function = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
                if member.startswith("_") or not callable(function):
                    continue
                if not inspect.getdoc(getattr(value, member)):
                    yield f"{path}.{member}"


def api_entries(page: str) -> set[str]:
    """The objects docs/api.md renders (`::: module.name` lines)."""
    return set(re.findall(r"^::: ([\w.]+)", page, re.M))


def check_api(api_page: str) -> None:
    names = public_names()
    problems = [f"no docstring: {name}" for name in sorted(set(undocumented(names)))]
    entries = api_entries(api_page)
    problems += [f"no entry in docs/api.md: ::: {name}" for name in sorted(set(names) - entries)]
    if problems:
        raise PluginError("undocumented public names:\n  " + "\n  ".join(problems))


def cli_page() -> str:
    """Every command's --help, in the parser's order, each under its own heading."""
    from pipeline.commands.cli import build_parser
    from pipeline.commands.help_format import commands

    lines = [
        "# Command line",
        "",
        "Generated from the CLI's parser when the site is built: each command's `--help`.",
        "",
    ]
    for name, parser in commands(build_parser(), "pipeline"):
        lines += [f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def _relative_to_docs(text: str) -> str:
    """A page of the repository root as a page of docs/: its links to docs/ made relative."""
    text = text.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")
    return text.replace("](README.md)", "](index.md)")


def on_files(files: Files, config: Any) -> Files:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        cli = cli_page()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    pages = {
        "cli.md": cli,
        "index.md": _relative_to_docs((ROOT / "README.md").read_text()),
        "changelog.md": _relative_to_docs((ROOT / "CHANGELOG.md").read_text()),
    }
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    return files


def on_pre_build(config: Any) -> None:
    check_api((Path(config["docs_dir"]) / "api.md").read_text())
