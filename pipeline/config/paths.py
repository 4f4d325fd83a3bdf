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
) -> Path:
    """`path` made absolute against `base_dir` (the config's directory; None for a config read
    from a URL, where a relative `path` is refused naming `key`, with `example` of a fix)."""
    if base_dir is None and not os.path.isabs(path):
        why = f"relative path {path!r} in a config read from a URL; give an absolute path"
        raise fail(key, why + example)
    return ((base_dir or Path()) / path).resolve()
