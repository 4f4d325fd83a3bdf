"""Where a config's relative paths point: its own directory; a config read from a URL has
none, so a relative path there is refused rather than read from the current directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import ConfigError


def anchored(
    path: str,
    key: str,
    base_dir: Path | None,
    fail: Callable[[str, str], ConfigError],
    example: str = "",
    directories: dict[str, tuple[str, Path]] | None = None,
) -> Path:
    """`path` made absolute against `base_dir` (the config's directory; None for a config read
    from a URL, where a relative `path` is refused naming `key`, with `example` of a fix), as
    `Path.resolve` makes it; `directories`: the parents resolved so far (`resolved`)."""
    if base_dir is None and not os.path.isabs(path):
        why = f"relative path {path!r} in a config read from a URL; give an absolute path"
        raise fail(key, why + example)
    joined = os.path.join(os.fspath(base_dir) if base_dir is not None else "", path)
    return resolved(joined, directories)


def resolved(path: str, directories: dict[str, tuple[str, Path]] | None = None) -> Path:
    """`Path(path).resolve()`, resolving each distinct parent directory once across the calls
    that share `directories` (a mixture names hundreds of stores in a few directories:
    `resolve` is ~4 `lstat`s and ~40 us a path, one `lstat` here), and the path made by
    joining its name to its parent's resolved `Path` (~half the cost of parsing the whole
    path again). A name that is a link, or not a plain name, is resolved whole."""
    parent, name = os.path.split(path)
    if directories is None or not parent or name in ("", ".", ".."):
        return Path(path).resolve()
    known = directories.get(parent)
    if known is None:
        real = Path(parent).resolve()
        known = directories[parent] = (str(real), real)
    text, real = known
    candidate = real.joinpath(name)
    return candidate.resolve() if os.path.islink(f"{text}/{name}") else candidate
