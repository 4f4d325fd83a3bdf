"""The release, written once: the package metadata reads it (pyproject's dynamic version), the
CLI prints it (`pipeline --version`), and every store manifest, index and ledger the package
writes records it as `pipeline_version` (docs/compatibility.md says what a version promises)."""

from __future__ import annotations

__version__ = "0.3.0"

VERSION_KEY = "pipeline_version"
"""The key under which a written file records the release that wrote it; files written before
0.3.0 lack it and read as before."""
