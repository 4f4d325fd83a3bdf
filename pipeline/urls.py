"""Locations a user may give as a URL (`gs://bucket/x`) or as a local path.

`pathlib.Path("gs://b/x")` silently becomes the relative path `gs:/b/x`, so a URL must be
recognised before anything turns it into a `Path`. URLs are read through `etils.epath` (the
library Orbax uses, which reaches Cloud Storage through `gcsfs` or TensorFlow).
"""

from __future__ import annotations

import os
import re

# A scheme followed by ":/" also catches a URL that a Path already collapsed ("gs:/b/x").
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:/")


def is_url(location: str | os.PathLike) -> bool:
    """True for `gs://...`, `s3://...` and the like (and their Path-mangled `gs:/...` form)."""
    return bool(_URL.match(os.fspath(location)))


def read_text(url: str) -> str:
    """The text at a URL; OSError (with the URL) when it cannot be read."""
    from etils import epath

    try:
        return epath.Path(url).read_text()
    except OSError:
        raise
    except Exception as error:  # a missing backend (gcsfs) or a cloud error
        raise OSError(f"{type(error).__name__}: {error}") from error
